"""A per-mount request budget: a token bucket whose rate adapts to the store's throttling.

Object stores limit request rates per prefix (S3: ~5,500 GET/s per prefix, answered with
503 SlowDown beyond), and Hugging Face / GCS answer 429. Retrying each refused request on its
own (even with backoff) keeps the aggregate rate at the limit. So every request of a mount
first takes a token from one shared bucket:

- no configured rate (`request_rate: None`, the default): unlimited until the store throttles;
- on a throttling answer the rate is cut to half of the rate actually observed over the last
  seconds (multiplicative decrease), at least MIN_RATE, at most once per HOLD_S (the answers
  to requests already in flight do not cut it again);
- while requests go through, the rate grows back from the cut, doubling every DOUBLE_S
  seconds (quick to recover when the throttling was a burst, as at start-up), until it is
  back at the configured rate, or, unconfigured, until it is LIFT_FACTOR above what was
  observed when throttled, where the limit is lifted again.

The retry delays themselves use full jitter (sources/http.py: `_Patience`), so that many
nodes started at once, all throttled at the same moment, do not come back in lockstep.
"""

from __future__ import annotations

import collections
import logging

import trio

log = logging.getLogger(__name__)

MIN_RATE = 1.0  # requests/s: the floor after repeated throttling
WINDOW_S = 2.0  # how far back the observed request rate is measured
LIFT_FACTOR = 4.0  # unconfigured budget: lift the limit once the rate is this far above its cut
DOUBLE_S = 2.0  # a cut rate doubles this often while no throttling answers come
HOLD_S = 1.0  # after a cut, further throttling answers (already in flight) do not cut again


class RequestBudget:
    def __init__(self, rate: float | None = None, burst: int = 64) -> None:
        if rate is not None and rate <= 0:
            raise ValueError(f"request rate must be positive, not {rate}")
        self.configured = rate
        self.rate = rate  # None: unlimited right now
        self.burst = max(1, burst)
        self._tokens = float(self.burst)
        self._stamp = trio.current_time() if _in_trio() else 0.0
        self._recent: collections.deque[float] = collections.deque()
        self._cut_from: float | None = None  # the rate that was cut, while adapting
        self._cut_at = float("-inf")
        self._cut_rate = 0.0  # the rate set by the last cut
        self.waits = 0
        self.wait_s = 0.0
        self.throttles = 0

    async def acquire(self) -> float:
        """Take one token, waiting for it if the bucket is empty; return the seconds waited."""
        now = trio.current_time()
        self._note(now)
        if self.rate is None:
            return 0.0
        self._fill(now)
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        # Reserve the token now (tokens go negative), so waiters queue in arrival order.
        self._tokens -= 1
        delay = -self._tokens / self.rate
        self.waits += 1
        self.wait_s += delay
        await trio.sleep(delay)
        return delay

    def throttled(self) -> None:
        """The store answered 429 / 503 SlowDown: cut the rate."""
        now = trio.current_time()
        self.throttles += 1
        if now - self._cut_at < HOLD_S:
            return  # answers to requests sent before the last cut took effect
        observed = self._observed(now)
        base = self.rate if self.rate is not None else observed
        if self.rate is not None:
            base = min(base, max(observed, MIN_RATE))
        new = max(MIN_RATE, base / 2)
        if self.rate is None or new < self.rate:
            if self._cut_from is None:
                self._cut_from = base
            self._fill(now)
            self.rate = self._cut_rate = new
            self._cut_at = now
            self._tokens = min(self._tokens, 1.0)
            log.info("store is throttling: request budget cut to %.1f requests/s", new)

    def succeeded(self) -> None:
        """A request went through: raise a cut rate a little."""
        if self.rate is None or self._cut_from is None:
            return
        now = trio.current_time()
        self._fill(now)
        self.rate = self._cut_rate * 2 ** ((now - self._cut_at) / DOUBLE_S)
        if self.configured is not None and self.rate >= self.configured:
            self.rate, self._cut_from = self.configured, None
        elif self.configured is None and self.rate >= LIFT_FACTOR * self._cut_from:
            self.rate, self._cut_from = None, None
            log.info("store stopped throttling: request budget lifted")

    def snapshot(self) -> dict[str, float | int | None]:
        return {"rate": self.rate, "waits": self.waits, "wait_s": round(self.wait_s, 3),
                "throttles": self.throttles}

    def _fill(self, now: float) -> None:
        if self.rate is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def _note(self, now: float) -> None:
        self._recent.append(now)
        while self._recent and self._recent[0] < now - WINDOW_S:
            self._recent.popleft()

    def _observed(self, now: float) -> float:
        while self._recent and self._recent[0] < now - WINDOW_S:
            self._recent.popleft()
        if not self._recent:
            return MIN_RATE
        # Over the time the window really covers (short just after start-up).
        span = max(now - self._recent[0], 0.25)
        return max(len(self._recent) / span, MIN_RATE)


def _in_trio() -> bool:
    try:
        trio.current_time()
    except RuntimeError:
        return False
    return True
