"""Messages between the processes of one mount over a Unix socket: length-prefixed pickles.

Both ends are shardfs processes of the same user (the listener checks SO_PEERCRED), so pickle
is safe here. A `Channel` sends whole messages (one lock: tasks never interleave their bytes)
and receives them one at a time; `Caller` adds request ids, so that many tasks can wait on
answers over one connection at once.
"""

from __future__ import annotations

import itertools
import pickle
import struct
from collections.abc import Awaitable, Callable
from typing import Any

import trio

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 256 << 20  # a member block (4 MiB) plus headroom; larger means a broken peer


class ChannelClosed(Exception):
    """The other process went away."""


class Channel:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._send_lock = trio.Lock()
        self._buf = bytearray()

    async def send(self, message: Any) -> None:
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        async with self._send_lock:
            try:
                await self.stream.send_all(_HEADER.pack(len(body)) + body)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ChannelClosed(str(exc)) from None

    async def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            try:
                chunk = await self.stream.receive_some(max(65536, n - len(self._buf)))
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise ChannelClosed(str(exc)) from None
            if not chunk:
                raise ChannelClosed("end of stream")
            self._buf += chunk

    async def receive(self) -> Any:
        await self._fill(_HEADER.size)
        (size,) = _HEADER.unpack_from(self._buf)
        if size > MAX_MESSAGE:
            raise ChannelClosed(f"message of {size} bytes")
        await self._fill(_HEADER.size + size)
        body = bytes(self._buf[_HEADER.size : _HEADER.size + size])
        del self._buf[: _HEADER.size + size]
        return pickle.loads(body)

    async def aclose(self) -> None:
        await self.stream.aclose()


class Caller:
    """Request/answer over a Channel: `await call(...)` from any number of tasks. Run
    `dispatch()` in a task of its own; it ends (failing every waiting call) when the channel
    closes."""

    def __init__(self, channel: Channel,
                 on_message: Callable[[tuple], Awaitable[None]] | None = None) -> None:
        self.channel = channel
        self.on_message = on_message  # for messages that are not answers
        self._ids = itertools.count(1)
        self._waiting: dict[int, list[Any]] = {}  # id -> [event, answer]
        self.closed = False

    async def call(self, *request: Any) -> Any:
        if self.closed:
            raise ChannelClosed("closed")
        rid = next(self._ids)
        slot: list[Any] = [trio.Event(), None]
        self._waiting[rid] = slot
        try:
            await self.channel.send(("call", rid, *request))
            await slot[0].wait()
        finally:
            self._waiting.pop(rid, None)
        if self.closed and slot[1] is None:
            raise ChannelClosed("closed while waiting")
        return slot[1]

    async def notify(self, *message: Any) -> None:
        """A message that wants no answer."""
        await self.channel.send(("note", *message))

    async def dispatch(self) -> None:
        try:
            while True:
                message = await self.channel.receive()
                if message[0] != "answer":
                    if self.on_message is not None:
                        await self.on_message(message)
                    continue
                _, rid, answer = message
                slot = self._waiting.get(rid)
                if slot is not None:
                    slot[1] = answer
                    slot[0].set()
        finally:
            self.closed = True
            for slot in self._waiting.values():
                slot[0].set()
