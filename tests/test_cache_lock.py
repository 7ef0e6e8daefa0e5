"""The cache dir's lock and a daemon that cannot finish dying.

A daemon killed while one of its threads waits in a FUSE request on its own mount (the page
pusher's lookup) lingers: its main thread is gone, the waiting thread stays until the next
daemon answers that request, and with it the process's descriptors, the cache dir's lock
among them. The next daemon must take the cache dir over anyway, or the holder's takeovers
all fail ("in use by another shardfs daemon") and the mount is given up with readers hung.
Here the lingering process is made for real: a process holding the lock, with a thread in a
lookup that tests/otherfs.py never answers, killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardfs.cache.shardcache import CacheError, ShardCache
from shardfs.util.proc import leader_exited
from tests.test_guards import other_fuse_mount, wait_for

REPO = Path(__file__).resolve().parent.parent

HOLD_AND_STALL = """
import os, sys, threading
from pathlib import Path
from shardfs.cache.shardcache import ShardCache
cache = ShardCache(Path(sys.argv[1]), 1000)
cache.open()
threading.Thread(target=os.stat, args=(sys.argv[2],), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


def test_a_killed_daemon_stuck_on_a_mount_leaves_its_cache_dir_to_the_next(tmp_path: Path):
    other, cache_dir, mark = tmp_path / "other", tmp_path / "cache", tmp_path / "stalled"
    with other_fuse_mount(other, env={"OTHERFS_STALL_MARK": str(mark)}) as otherfs:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        stuck = subprocess.Popen([sys.executable, "-c", HOLD_AND_STALL, str(cache_dir),
                                  str(other / "stall")], stdout=subprocess.PIPE, text=True,
                                 env=env)
        try:
            assert stuck.stdout is not None and stuck.stdout.readline() == "ready\n"
            wait_for(mark.exists, "the lookup to reach otherfs", timeout=20)
            with pytest.raises(CacheError, match=rf"in use .*pid {stuck.pid}\b"):
                ShardCache(cache_dir, 1000).open()  # alive: its lock is respected
            stuck.send_signal(signal.SIGKILL)
            wait_for(lambda: leader_exited(stuck.pid), "the main thread to exit", timeout=20)
            assert stuck.poll() is None  # lingering: the lookup is never answered

            taker = ShardCache(cache_dir, 1000)
            taker.open()  # the killed process's lock does not stop it
            try:
                assert (cache_dir / "lock").read_text() == str(os.getpid())
                with pytest.raises(CacheError, match=rf"in use .*pid {os.getpid()}\b"):
                    ShardCache(cache_dir, 1000).open()  # and its own lock is a real one
            finally:
                taker.close()
            assert not list(cache_dir.glob("lock.*"))
        finally:
            otherfs.kill()  # ends the connection: the lookup fails, the killed process ends
            otherfs.wait()
            stuck.kill()
            stuck.wait(20)
