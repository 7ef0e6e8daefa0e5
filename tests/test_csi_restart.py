"""Mounts outlive the plugin's and the mounter's containers.

Each runs as a container would run it: its own PID and mount namespace with its own /proc
(`unshare --pid --fork --mount-proc`), the kubelet dir a shared mount, so that the plugin's
mounts propagate out as with Bidirectional. Readers read every file in a loop, with
checksums, dropping each file's pages after reading it so that every read reaches the FUSE
connection; one container's init is killed in the middle (the kernel kills its whole PID
namespace), then the other's.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from shardfs.csi.plugin import kernel
from tests.conftest import Dataset, brace, needs_shim
from tests.csi_node import csi_node, mounter_records, needs_root, node_mount_count
from tests.test_csi import checksums, serve_dataset

pytestmark = needs_root

# Reads every file of ROOT until STOP exists, comparing checksums; each file's pages are
# dropped after reading so that the next round asks the FUSE connection again.
LOOP_READER = """
import hashlib, json, os, sys, time
root, want_path, stop = sys.argv[1:4]
want = json.load(open(want_path))
ok = errors = wrong = rounds = 0
longest = 0.0
messages = []
while not os.path.exists(stop):
    for rel, digest in want.items():
        t0 = time.monotonic()
        try:
            fd = os.open(os.path.join(root, rel), os.O_RDONLY)
            try:
                data = b''
                while chunk := os.read(fd, 1 << 20):
                    data += chunk
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError as exc:
            errors += 1
            messages.append(f'{rel}: {exc}')
            continue
        longest = max(longest, time.monotonic() - t0)
        if hashlib.sha256(data).hexdigest() == digest:
            ok += 1
        else:
            wrong += 1
    rounds += 1
print(json.dumps({'ok': ok, 'errors': errors, 'wrong': wrong, 'rounds': rounds,
                  'longest_read_s': round(longest, 3), 'messages': messages[:5]}))
"""


class Readers:
    def __init__(self, target: Path, want: dict[str, str], work: Path, n: int = 2) -> None:
        self.stop_file = work / "stop-readers"
        self.stop_file.unlink(missing_ok=True)
        want_path = work / "want.json"
        want_path.write_text(json.dumps(want))
        python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else "python3"
        self.procs = [subprocess.Popen(
            [python, "-c", LOOP_READER, str(target), str(want_path), str(self.stop_file)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, user=1000, group=1000,
            extra_groups=[]) for _ in range(n)]

    def finish(self) -> list[dict]:
        self.stop_file.touch()
        results = []
        for proc in self.procs:
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            results.append(json.loads(out))
        return results


def wait_for(predicate, timeout: float, what: str, logs) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{logs()}")
        time.sleep(0.1)


@needs_shim  # a takeover needs the shim (the recorded INIT)
def test_plugin_and_mounter_containers_die_without_a_read_error(
        dataset: Dataset, nginx, tmp_path: Path) -> None:
    serve_dataset(dataset, nginx.root)
    want = checksums(dataset)
    attrs = {"source": brace(dataset, f"{nginx.url}/data"), "workers": "1"}
    with csi_node(tmp_path, isolated=True) as (node, kubelet):
        kubelet.register()
        target = kubelet.publish("pod-a", "data", "ds", attrs)
        work = node.paths.kubelet.root / "readers"  # under /tmp: reachable by uid 1000
        work.mkdir()
        readers = Readers(target, want, work)
        try:
            time.sleep(1.0)
            # 1. The plugin's container dies: the mounts and their daemon live on.
            node.plugin.kill()
            assert node_mount_count(node) == 1
            time.sleep(1.0)
            node.start_plugin()
            kubelet.wait_ready()
            wait_for(lambda: node.mounter.text().count("synced with the plugin") >= 2,
                     30, "the new plugin's sync", node.logs)
            # The new plugin knows the volume: a second pod is a bind of the same mount (one
            # FUSE mount, one mounter record), not a second mount.
            other = kubelet.publish("pod-b", "data", "ds", attrs)
            assert node_mount_count(node) == 1 and len(mounter_records(node)) == 1

            # 2. The mounter's container dies (with the daemon): the plugin holds the FUSE
            # descriptor, the new mounter's daemon takes the live mount over.
            old_daemon_log = node.mounter.text()
            node.mounter.kill()
            time.sleep(1.0)
            node.start_mounter()
            wait_for(lambda: "took over the mount" in node.mounter.text(), 120,
                     "the new mounter's takeover", node.logs)
            time.sleep(1.0)
        finally:
            results = readers.finish()
        print("readers:", results)  # longest_read_s: the gap a reader waited (pytest -s)
        assert "serves the mount" in old_daemon_log
        total_ok = sum(r["ok"] for r in results)
        assert all(r["errors"] == 0 and r["wrong"] == 0 for r in results), results
        assert total_ok >= 2 * len(want), results

        # The new plugin unpublishes cleanly, through the new mounter.
        kubelet.unpublish("pod-a", "data", "ds")
        kubelet.unpublish("pod-b", "data", "ds")
        assert not target.exists() and not other.exists()
        assert node_mount_count(node) == 0 and mounter_records(node) == []
        assert kernel.mount_at(str(target)) is None
        logs = node.logs()
        assert "Traceback" not in logs, logs


def test_plugin_restart_after_both_died(dataset: Dataset, nginx, tmp_path: Path) -> None:
    """Both containers die at once: the last descriptor closes, the connection ends, and
    the mounts left behind are dead (ENOTCONN). The next plugin unmounts them (kubelet's
    `stat` of a pod's volume would fail otherwise) and forgets them; unpublish succeeds and
    the volume can be published afresh."""
    serve_dataset(dataset, nginx.root)
    attrs = {"source": brace(dataset, f"{nginx.url}/data"), "workers": "1"}
    with csi_node(tmp_path, isolated=True) as (node, kubelet):
        target = kubelet.publish("pod-a", "data", "ds", attrs)
        node.plugin.kill()
        node.mounter.kill()

        def dead() -> bool:  # the last descriptor's release may trail the kill a moment
            try:
                os.statvfs(target)
            except OSError as exc:
                assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED), exc
                return True
            return False

        wait_for(dead, 10, "the connection to end", node.logs)
        node.start_mounter()
        node.start_plugin()
        kubelet.wait_ready()
        assert kernel.mount_at(str(target)) is None and node_mount_count(node) == 0
        kubelet.unpublish("pod-a", "data", "ds")
        assert not target.exists()
        state = json.loads((node.paths.plugin_state / "state.json").read_text())
        assert state["volumes"] == {}
        again = kubelet.publish("pod-c", "data", "ds", attrs)
        assert sorted(p.name for p in again.iterdir()) == sorted(
            p.name for p in dataset.root.iterdir())
        kubelet.unpublish("pod-c", "data", "ds")
        assert node_mount_count(node) == 0


def test_a_restarted_plugin_releases_a_volume_no_pod_uses(dataset: Dataset, nginx,
                                                          tmp_path: Path) -> None:
    """The plugin died between mounting a volume and recording its publish: the next plugin
    finds the node mount with no pod on it and releases it (unmount, daemon gone)."""
    serve_dataset(dataset, nginx.root)
    attrs = {"source": brace(dataset, f"{nginx.url}/data"), "workers": "1"}
    with csi_node(tmp_path) as (node, kubelet):
        target = kubelet.publish("pod-a", "data", "ds", attrs)
        (key,) = mounter_records(node)
        node.plugin.kill()
        kernel.unmount(str(target))
        state_file = node.paths.plugin_state / "state.json"
        state = json.loads(state_file.read_text())
        state["volumes"][key]["publishes"] = {}
        state_file.write_text(json.dumps(state))
        node.start_plugin()
        kubelet.wait_ready()
        wait_for(lambda: node_mount_count(node) == 0 and mounter_records(node) == [], 30,
                 "the unused volume's release", node.logs)
        wait_for(lambda: daemon_pids(node.paths.cache_root / key) == [], 30,
                 "its daemon to end", node.logs)


def daemon_pids(cache_dir: Path) -> list[int]:
    """Host pids of shardfs daemons serving from `cache_dir`."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"--fuse-fd" in argv and str(cache_dir).encode() in argv:
                out.append(int(proc.name))
    return out


@needs_shim  # a takeover needs the shim (the recorded INIT)
def serving_pid(cache_dir: Path) -> int | None:
    """The daemon that serves from `cache_dir` now (it holds the cache lock; its spare, also a
    `--fuse-fd` process, does not)."""
    try:
        pid = int((cache_dir / "lock").read_text().split()[0])
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError, IndexError):
        return None
    return pid if str(cache_dir).encode() in argv else None


@needs_shim  # a takeover needs the shim (the recorded INIT)
@pytest.mark.parametrize("spares", [True, False], ids=["spare", "no-spares"])
def test_a_dead_daemon_is_replaced_by_the_mounter(dataset: Dataset, nginx, tmp_path: Path,
                                                  spares: bool) -> None:
    """Killed alone, the daemon is replaced by its spare (or, with --no-spares, a new
    process) taking the mount over; the readers' longest read is printed (pytest -s): the gap
    the death cost them (docs/benchmarks-notes.md)."""
    serve_dataset(dataset, nginx.root)
    want = checksums(dataset)
    attrs = {"source": brace(dataset, f"{nginx.url}/data"), "workers": "1"}
    with csi_node(tmp_path, mounter_args=() if spares else ("--no-spares",)) as (node,
                                                                                 kubelet):
        target = kubelet.publish("pod-a", "data", "ds", attrs)
        (key,) = mounter_records(node)
        if spares:
            wait_for(lambda: "stands by" in node.mounter.text(), 60, "the spare", node.logs)
        pid = serving_pid(node.paths.cache_root / key)
        assert pid is not None
        work = node.paths.kubelet.root / "readers"
        work.mkdir()
        readers = Readers(target, want, work)
        try:
            time.sleep(1.0)
            os.kill(pid, 9)  # the OOM killer, a bug: the mounter starts a successor
            wait_for(lambda: "took over the mount" in node.mounter.text(), 60,
                     "the successor daemon", node.logs)
            time.sleep(1.0)
        finally:
            results = readers.finish()
        print(f"readers ({'spare' if spares else 'no spares'}):", results)
        assert all(r["errors"] == 0 and r["wrong"] == 0 for r in results), results
        assert "ended (signal 9) while the volume is published" in node.mounter.text()
        assert ("took over the mount (a spare)" in node.mounter.text()) == spares
        assert ("stands by" in node.mounter.text()) == spares
        assert serving_pid(node.paths.cache_root / key) not in (None, pid)
        kubelet.unpublish("pod-a", "data", "ds")
        assert node_mount_count(node) == 0


@needs_shim  # a takeover needs the shim (the recorded INIT)
def test_a_daemon_that_keeps_dying_is_given_up(dataset: Dataset, nginx,
                                               tmp_path: Path) -> None:
    """After DEATHS_LIMIT deaths in DEATHS_WINDOW_S the mounter stops replacing the daemon and
    both processes let go of the connection: readers get an error, not an endless wait;
    unpublish cleans up and a new publish mounts afresh."""
    from shardfs.csi.mounter.volumes import DEATHS_LIMIT

    serve_dataset(dataset, nginx.root)
    attrs = {"source": brace(dataset, f"{nginx.url}/data"), "workers": "1"}
    with csi_node(tmp_path) as (node, kubelet):
        target = kubelet.publish("pod-a", "data", "ds", attrs)
        (key,) = mounter_records(node)
        cache = node.paths.cache_root / key
        for death in range(DEATHS_LIMIT):
            wait_for(lambda: serving_pid(cache) is not None, 60, "a daemon", node.logs)
            os.kill(serving_pid(cache), 9)
            if death < DEATHS_LIMIT - 1:
                wait_for(lambda n=death: node.mounter.text().count("took over the mount")
                         == n + 1, 60, "the successor", node.logs)
        wait_for(lambda: "the mount is given up" in node.mounter.text(), 30, "the give-up",
                 node.logs)

        def failing() -> bool:
            try:
                os.statvfs(target)
            except OSError as exc:
                assert exc.errno in (errno.ENOTCONN, errno.ECONNABORTED), exc
                return True
            return False

        wait_for(failing, 30, "readers to get an error", node.logs)
        assert daemon_pids(cache) == []
        kubelet.unpublish("pod-a", "data", "ds")
        assert node_mount_count(node) == 0 and mounter_records(node) == []
        again = kubelet.publish("pod-b", "data", "ds", attrs)
        assert sorted(p.name for p in again.iterdir()) == sorted(
            p.name for p in dataset.root.iterdir())
        kubelet.unpublish("pod-b", "data", "ds")
