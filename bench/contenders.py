"""The contenders: the same data read through each alternative.

Each contender knows how to set itself up for a scenario (mount, copy, nothing), which epoch
spec to hand the loop (bench/epoch.py), which daemon pid to watch, and how to tear down. The
harness calls teardown() in a finally, whatever happened.

Scenarios: "main" (cold, warm and decode epochs; the dataset fits every cache), "over" (the
dataset is ~4x shardfs's --cache-size) and "meta" (metadata only, many tiny members).
"""

from __future__ import annotations

import concurrent.futures
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import procs
from bench.data import Dataset, MetaDataset

MOUNT_TIMEOUT_S = 300.0


@dataclass
class Ctx:
    work: Path  # this run's scratch dir (mounts, caches, copies); removed at the end
    base_url: str  # the nginx serving the data dir
    data: Dataset
    meta: MetaDataset | None
    workers: int
    batch_size: int
    seed: int
    say: Callable[[str], None]
    # WORKAROUND (shardfs bug): the daemon binds `<cache dir>/control.sock`, and a cache dir
    # deeper than ~90 characters makes the mount fail with "OSError: AF_UNIX path too long"
    # (pytest's tmp paths are that deep). shardfs cache dirs therefore live under this short
    # directory (/tmp/sfbench-XXXX), created and removed by the harness.
    cache_root: Path | None = None
    over_cache_bytes: int = 0  # --cache-size for the "over" scenario
    fits_cache_bytes: int = 0  # --cache-size for the main scenario
    shardfs_args: tuple[str, ...] = ()  # more `shardfs mount` arguments (--shardfs-arg)

    @property
    def images_url(self) -> str:
        return f"{self.base_url}/{self.data.www.name}"

    @property
    def meta_url(self) -> str:
        assert self.meta is not None
        return f"{self.base_url}/{self.meta.www.name}"


def _tail(text: str, n: int = 1500) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _log_tail(path: Path, n: int = 1500) -> str:
    try:
        return _tail(path.read_text(errors="replace"), n)
    except FileNotFoundError:
        return ""


class Contender:
    name = ""
    label = ""
    how = ""  # one line for the docs: what exactly runs
    fuse = False
    resumable = False  # a map-style loop whose sampler state resumes an epoch (bench/epoch.py)

    def __init__(self) -> None:
        self.root: Path | None = None  # the directory the loop reads (folder contenders)
        self.pid: int | None = None  # the daemon to watch (FUSE contenders)
        self.mnt: Path | None = None
        self._proc: subprocess.Popen | None = None
        self.notes: list[str] = []

    # -- what can run where -------------------------------------------------------------
    def unavailable(self) -> str | None:
        """Why this contender cannot run on this machine at all (None: it can)."""
        return None

    def version(self) -> str | None:
        return None

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        return None

    # -- lifecycle ------------------------------------------------------------------------
    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        """Mount/copy/prepare. fresh=False: a remount that keeps the contender's own cache."""
        raise NotImplementedError

    def remount(self, ctx: Ctx, scenario: str) -> None:
        """Unmount and mount again (drops the kernel's page cache of the mount), keeping the
        contender's own disk cache. Only meaningful for FUSE contenders."""
        self.teardown()
        self.setup(ctx, scenario, fresh=False)

    def before_cold_epoch(self, ctx: Ctx) -> None:
        pass

    def spec(self, ctx: Ctx, decode: bool) -> dict:
        assert self.root is not None
        return {"kind": "folder", "root": str(self.root / "train"), "decode": decode}

    def meta_root(self) -> Path:
        assert self.root is not None
        return self.root

    def stats(self) -> dict | None:
        return None

    def teardown(self) -> None:
        if self.mnt is not None:
            note = procs.unmount(self.mnt)
            if note:
                self.notes.append(f"unmount {self.mnt}: {note}")
        if self._proc is not None:
            procs.stop_pid(self._proc.pid)
            self._proc.wait()
            self._proc = None
        elif self.pid is not None:
            procs.stop_pid(self.pid)
        self.mnt = None
        self.pid = None

    def _mountpoint(self, ctx: Ctx, scenario: str) -> Path:
        mnt = ctx.work / f"mnt-{self.name}-{scenario}"
        mnt.mkdir(parents=True, exist_ok=True)
        self.mnt = mnt
        return mnt


def _pkg_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cmd_version(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.strip().splitlines()[0] if out.strip() else None


# --- local disk ------------------------------------------------------------------------------


class LocalDisk(Contender):
    name = "local"
    label = "local disk"
    how = ("the loose files copied to local disk first (timed: all files downloaded from the "
           "same nginx with a pool of 16 threads); the cold epoch runs after "
           "posix_fadvise(DONTNEED) on every file")
    COPY_THREADS = 16

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        if scenario == "over":
            return "no cache involved: see the cold epoch"
        if scenario == "meta" and (ctx.meta is None or not ctx.meta.loose):
            return "no loose tree generated at this scale (--meta-loose)"
        return None

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        if scenario == "meta":
            assert ctx.meta is not None
            self.root = ctx.meta.loose_root  # written locally by the generator
            return
        dest = ctx.work / "local-copy"
        shutil.rmtree(dest, ignore_errors=True)
        src = ctx.data.loose
        rels = [p.relative_to(src) for p in src.rglob("*") if p.is_file()]
        for d in {r.parent for r in rels}:
            (dest / d).mkdir(parents=True, exist_ok=True)
        base = f"{ctx.images_url}/loose"

        def get(rel: Path) -> int:
            with urllib.request.urlopen(f"{base}/{rel.as_posix()}", timeout=60) as r, \
                    open(dest / rel, "wb") as f:
                return f.write(r.read())

        with concurrent.futures.ThreadPoolExecutor(self.COPY_THREADS) as pool:
            copied = sum(pool.map(get, rels))
        if copied != ctx.data.loose_bytes:
            raise RuntimeError(f"copied {copied} bytes, expected {ctx.data.loose_bytes}")
        self.root = dest

    def before_cold_epoch(self, ctx: Ctx) -> None:
        if self.root is not None:
            procs.drop_from_page_cache(self.root)


# --- per-file HTTP through an object-store style FUSE mount ------------------------------------


class RcloneHttp(Contender):
    name = "perfile-http"
    label = "per-file HTTP (rclone mount)"
    how = ("`rclone mount :http: MNT --http-url URL/loose/ --vfs-cache-mode off --read-only` "
           "(nginx autoindex listings; rclone HEADs each file while listing, then one GET per "
           "file read)")
    fuse = True

    def unavailable(self) -> str | None:
        if shutil.which("rclone") is None:
            return "rclone not installed (apt-get install -y rclone)"
        return None

    def version(self) -> str | None:
        return _cmd_version(["rclone", "version"])

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        if scenario == "meta" and (ctx.meta is None or not ctx.meta.loose):
            return "no loose tree generated at this scale (--meta-loose)"
        return None

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        mnt = self._mountpoint(ctx, scenario)
        url = f"{ctx.meta_url}/metaloose/" if scenario == "meta" else f"{ctx.images_url}/loose/"
        log = ctx.work / f"rclone-{scenario}.log"
        cmd = ["rclone", "mount", ":http:", str(mnt), "--http-url", url,
               "--vfs-cache-mode", "off", "--read-only", "--config", "/dev/null"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("RCLONE_")}
        with open(log, "wb") as f:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                          start_new_session=True, env=env)
        self.pid = self._proc.pid
        try:
            procs.wait_mounted(mnt, self._proc, MOUNT_TIMEOUT_S)
        except RuntimeError as exc:
            raise RuntimeError(f"rclone mount: {exc}\n{_log_tail(log)}") from None
        self.root = mnt


# --- ratarmount ------------------------------------------------------------------------------


class Ratarmount(Contender):
    name = "ratarmount"
    label = "ratarmount (HTTP)"
    how = ("`ratarmount -f URL... MNT`: a union mount of every shard URL, indexed over HTTP at "
           "mount time (no index published for it)")
    fuse = True

    def unavailable(self) -> str | None:
        if shutil.which("ratarmount") is None and not _pkg_version("ratarmount"):
            return "ratarmount not installed (pip install -e '.[bench]')"
        if importlib.util.find_spec("aiohttp") is None:
            return "aiohttp not installed (fsspec's HTTP needs it; pip install -e '.[bench]')"
        return None

    def version(self) -> str | None:
        return _pkg_version("ratarmount")

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        if scenario == "over":
            return "no cache of its own: see the cold epoch"
        return None

    def _exe(self) -> list[str]:
        exe = Path(sys.executable).parent / "ratarmount"
        return [str(exe)] if exe.exists() else ["ratarmount"]

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        mnt = self._mountpoint(ctx, scenario)
        if scenario == "meta":
            urls = [f"{ctx.meta_url}/meta/train.tar"]
        else:
            urls = ctx.data.shard_urls(ctx.images_url)
        index_dir = ctx.work / f"ratarmount-index-{scenario}"
        shutil.rmtree(index_dir, ignore_errors=True)
        index_dir.mkdir(parents=True)
        log = ctx.work / f"ratarmount-{scenario}.log"
        cmd = [*self._exe(), "-f", "--index-folders", str(index_dir), *urls, str(mnt)]
        with open(log, "wb") as f:
            self._proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                          start_new_session=True)
        self.pid = self._proc.pid
        try:
            procs.wait_mounted(mnt, self._proc, MOUNT_TIMEOUT_S)
        except RuntimeError as exc:
            raise RuntimeError(f"ratarmount: {exc}\n{_log_tail(log)}") from None
        self.root = mnt


# --- wids and webdataset (non-FUSE references) -----------------------------------------------


class Wids(Contender):
    name = "wids"
    label = "wids (map-style)"
    how = ("`wids.ShardListDataset(index.json, cache_dir=...)` + DataLoader(shuffle=True): whole "
           "shards downloaded on first touch (curl) into a local cache dir, kept (no eviction)")

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("wids") is None:
            return ("wids not installed (pip install -e '.[bench]'; webdataset>=1.0 no longer "
                    "ships it)")
        if shutil.which("curl") is None:
            return "curl not installed (wids downloads http:// shards with it)"
        return None

    def version(self) -> str | None:
        return _pkg_version("wids")

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        if scenario == "over":
            return "no cache budget: wids keeps every shard it downloads"
        if scenario == "meta":
            return "no directory tree (samples by index)"
        return None

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        self.cache = ctx.work / f"wids-cache-{scenario}"
        shutil.rmtree(self.cache, ignore_errors=True)
        self.cache.mkdir(parents=True)
        self.index = ctx.work / f"wids-{scenario}.json"
        self.index.write_text(json.dumps(ctx.data.wids_index(ctx.images_url), indent=1))

    def spec(self, ctx: Ctx, decode: bool) -> dict:
        return {"kind": "wids", "index": str(self.index), "cache_dir": str(self.cache),
                "decode": decode}


class WebDatasetStream(Contender):
    name = "webdataset"
    label = "webdataset (streaming)"
    how = ("`webdataset.WebDataset(urls, shardshuffle=True).shuffle(1000)` (iterable; shards "
           "split over DataLoader workers, streamed with curl; no cache)")

    def unavailable(self) -> str | None:
        if importlib.util.find_spec("webdataset") is None:
            return "webdataset not installed"
        if shutil.which("curl") is None:
            return "curl not installed (webdataset streams http:// shards with it)"
        return None

    def version(self) -> str | None:
        return _pkg_version("webdataset")

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        if scenario == "meta":
            return "no directory tree (iterable stream)"
        return None

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        self.urls = ctx.data.shard_urls(ctx.images_url)

    def spec(self, ctx: Ctx, decode: bool) -> dict:
        return {"kind": "webdataset", "urls": self.urls, "decode": decode,
                "seed": ctx.seed}


# --- shardfs -------------------------------------------------------------------------------


class Shardfs(Contender):
    name = "shardfs"
    label = "shardfs"
    how = ("`shardfs mount 'URL/shards/train-{000000..N}.tar' MNT --cache-dir DIR --cache-size "
           "SIZE --no-warm` (published .shardfs.idx files), unchanged ImageFolder script")
    fuse = True
    sampler = "random"
    resumable = True

    def version(self) -> str | None:
        return _pkg_version("shardfs")

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        self.scenario = scenario
        mnt = self._mountpoint(ctx, scenario)
        cache = (ctx.cache_root or ctx.work) / f"{self.name}-{scenario}"
        if fresh:
            shutil.rmtree(cache, ignore_errors=True)
        if scenario == "meta":
            source = f"{ctx.meta_url}/meta/train.tar"
            size = max(ctx.fits_cache_bytes, 1 << 30)
        else:
            source = self._shard_source(ctx)
            size = ctx.over_cache_bytes if scenario in ("over", "resume") else \
                ctx.fits_cache_bytes
        self.cache_size = size
        cmd = [sys.executable, "-m", "shardfs", "mount", source, str(mnt), "--cache-dir",
               str(cache), "--cache-size", str(size), "--no-warm", *ctx.shardfs_args]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S)
        match = re.search(r"daemon pid (\d+)", result.stdout)
        if match:
            self.pid = int(match.group(1))
        if result.returncode != 0 or not match:
            raise RuntimeError(f"shardfs mount failed ({result.returncode}): "
                               f"{_tail(result.stderr or result.stdout)}")
        self.log_path = cache / "shardfs.log"
        self.root = mnt

    def spec(self, ctx: Ctx, decode: bool) -> dict:
        s = super().spec(ctx, decode)
        s["sampler"] = self.sampler
        if self.sampler == "shard-aware":
            # Its file -> shard map is cached per run (scratch dir), so the first epoch of a run
            # pays for reading it from the mount and later epochs do not, on every run alike.
            s["map_cache"] = str(ctx.work / f"shardmap-{self.scenario}")
        return s

    def _shard_source(self, ctx: Ctx) -> str:
        return ctx.data.shard_pattern(ctx.images_url)

    def stats(self) -> dict | None:
        if self.mnt is None:
            return None
        try:
            return json.loads(os.getxattr(self.mnt, "user.shardfs.stats"))
        except OSError as exc:
            return {"error": str(exc)}

    def teardown(self) -> None:
        if self.mnt is not None and procs.is_mounted(self.mnt):
            subprocess.run([sys.executable, "-m", "shardfs", "umount", str(self.mnt)],
                           capture_output=True, timeout=60)
        super().teardown()  # falls back to fusermount3 -u / -z, then the daemon's pid


class ShardfsSampler(Shardfs):
    name = "shardfs-sampler"
    label = "shardfs + ShardAwareSampler"
    how = ("as shardfs, with `sampler=shardfs.torch.ShardAwareSampler(dataset, shuffle=True, "
           "seed=0)` instead of shuffle=True (its file-to-shard map cached in the run's scratch "
           "dir: built from xattrs in the first epoch's set-up, reused after)")
    sampler = "shard-aware"
    needs = "ShardAwareSampler"  # what shardfs.torch must provide for this contender

    def unavailable(self) -> str | None:
        try:
            mod = importlib.import_module("shardfs.torch")
        except ImportError as exc:
            return f"not available yet: cannot import shardfs.torch ({exc})"
        if not hasattr(mod, self.needs):
            return f"not available yet: shardfs.torch has no {self.needs}"
        return None

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        if scenario == "meta":
            return "a sampler does not change metadata operations"
        return None


class ShardfsLookahead(ShardfsSampler):
    name = "shardfs-lookahead"
    label = "shardfs + Lookahead(RandomSampler)"
    how = ("as shardfs, with `sampler=shardfs.torch.Lookahead(RandomSampler(dataset, "
           "generator=g))` instead of shuffle=True: the stock order (same generator), announced "
           "to the daemon 2048 samples ahead")
    sampler = "lookahead"
    needs = "Lookahead"


class ShardfsZip(Shardfs):
    name = "shardfs-zip"
    label = "shardfs, zip shards"
    how = ("as shardfs, over the same files packed as stored zips (`shardfs pack --format zip`, "
           "same shuffle seed and shard size; published .shardfs.idx files): "
           "`shardfs mount 'URL/zipshards/train-{000000..N}.zip' ...`")

    def not_applicable(self, scenario: str, ctx: Ctx) -> str | None:
        if scenario == "meta":
            return "the metadata scenario has a tar only"
        return None

    @staticmethod
    def stored_zips(ctx: Ctx) -> int:
        """Pack the dataset as stored zips once per cached dataset (outside any timing);
        their number."""
        from shardfs.pack import pack

        shards = ctx.data.www / "zipshards"
        marker = shards / ".done"
        if not marker.exists():
            shutil.rmtree(shards, ignore_errors=True)
            params = ctx.data.params
            result = pack(ctx.data.loose, shards, prefix="train",
                          shard_size=int(params.shard_mb * 2**20), shuffle=True,
                          seed=params.seed, fmt="zip")
            marker.write_text(str(len(result.shards)))
        return int(marker.read_text())

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        n = self.stored_zips(ctx)
        self._source = f"{ctx.images_url}/zipshards/train-{{{0:06d}..{n - 1:06d}}}.zip"
        super().setup(ctx, scenario, fresh)

    def _shard_source(self, ctx: Ctx) -> str:
        return self._source


class ShardfsZipDeflate(ShardfsZip):
    name = "shardfs-zip-deflate"
    label = "shardfs, deflated zip shards"
    how = ("as shardfs-zip, every member deflated (zipfile, level 6; no published index: the "
           "mount indexes the zips by ranged reads during set-up): "
           "`shardfs mount 'URL/zipdeflate/train-{000000..N}.zip' ...`")

    def setup(self, ctx: Ctx, scenario: str, fresh: bool = True) -> None:
        import zipfile

        n = self.stored_zips(ctx)
        stored, deflated = ctx.data.www / "zipshards", ctx.data.www / "zipdeflate"
        marker = deflated / ".done"
        if not marker.exists():
            shutil.rmtree(deflated, ignore_errors=True)
            deflated.mkdir()
            for src in sorted(stored.glob("*.zip")):
                with zipfile.ZipFile(src) as zin, zipfile.ZipFile(
                        deflated / src.name, "w", zipfile.ZIP_DEFLATED) as zout:
                    for info in zin.infolist():
                        zout.writestr(info.filename, zin.read(info))
            marker.write_text(str(n))
        self._source = f"{ctx.images_url}/zipdeflate/train-{{{0:06d}..{n - 1:06d}}}.zip"
        Shardfs.setup(self, ctx, scenario, fresh)


def all_contenders() -> list[Contender]:
    return [LocalDisk(), RcloneHttp(), Ratarmount(), Wids(), WebDatasetStream(), Shardfs(),
            ShardfsSampler(), ShardfsLookahead(), ShardfsZip(), ShardfsZipDeflate()]


CONTENDER_NAMES = [c.name for c in all_contenders()]
# Run only when named with --contenders (the format comparison is not part of the docs' page).
OPT_IN = ("shardfs-zip", "shardfs-zip-deflate")
DEFAULT_CONTENDERS = [name for name in CONTENDER_NAMES if name not in OPT_IN]


@dataclass
class Outcome:
    """What happened to one contender in one scenario."""

    status: str = "ok"  # ok | failed | timeout | unavailable | n/a
    reason: str | None = None
    data: dict = field(default_factory=dict)
