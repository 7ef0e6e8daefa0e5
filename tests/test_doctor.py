"""`shardfs doctor` on a healthy set-up, and with each fault injected for real: no access to
/dev/fuse (another user, in a mount namespace of its own), an unreachable source, wrong S3
credentials (SeaweedFS), a cache smaller than the largest shard, a mount without the shim."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from shardfs.devtools.nginx import free_port
from tests.conftest import SHARDFS, Dataset, Mounter, brace, needs_shim
from tests.test_mount import publish

REPO = Path(__file__).resolve().parents[1]


def doctor(*args: str, env: dict | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess:
    # SHARDFS_NO_SHIM (the suite's run without the shim) would be a finding of its own.
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k != "SHARDFS_NO_SHIM"}
    command = [*SHARDFS, "doctor", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env=env)


def last_line(result: subprocess.CompletedProcess) -> str:
    return result.stdout.strip().splitlines()[-1]


@pytest.fixture
def open_cache_dir() -> Iterator[Path]:
    """A cache dir another user may write to (tmp_path is root's alone)."""
    path = Path(tempfile.mkdtemp(prefix="shardfs-doctor-"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_healthy_sources_and_a_small_cache(dataset: Dataset, nginx, tmp_path: Path):
    publish(dataset, nginx.root)
    source = brace(dataset, f"{nginx.url}/data")
    healthy = doctor(source, "--cache-dir", str(tmp_path / "cache"), "--cache-size", "64M",
                     "--json")
    report = json.loads(healthy.stdout)
    assert healthy.returncode == 0 and report["ok"], healthy.stdout + healthy.stderr
    verdicts = {c["name"]: c["verdict"] for c in report["checks"]}
    for name in ("/dev/fuse", "fusermount3", "pyfuse3 shim", "download check",
                 "download thread", "cache space", "sources", "store speed", "cache size"):
        assert verdicts[name] == "ok", report["checks"]
    assert verdicts["index files"] == "note"  # only the shards were published
    assert "OK" in report["summary"]
    # The same in words: the last line says so.
    text = doctor(source, "--cache-dir", str(tmp_path / "cache"), "--cache-size", "64M")
    assert text.returncode == 0 and "OK, nothing blocks" in last_line(text), text.stdout
    # A cache smaller than the largest shard, in a mount's config file: slow, named in the
    # last line.
    largest = max(s.size for s in dataset.shards.shards)
    config = tmp_path / "mount.yaml"
    config.write_text(f"sources: ['{source}']\ncache_dir: {tmp_path / 'cache'}\n"
                      f"cache_size: {largest // 2}\n")
    small = doctor("--config", str(config))
    assert small.returncode == 1, small.stdout
    assert "cache size slows reads" in last_line(small), small.stdout
    assert "smaller than the largest shard" in last_line(small)


def test_a_python_without_the_crc32c_instructions(tmp_path: Path):
    """CRC-32C computed in software (the crc32c package told so, as on a CPU without the
    instructions): `doctor` calls the download check slow, says what it costs and how to
    fix it, and names it in the last line."""
    env = {**os.environ, "CRC32C_SW_MODE": "force"}
    result = doctor("--cache-dir", str(tmp_path / "cache"), "--json", env=env)
    report = json.loads(result.stdout)
    check = next(c for c in report["checks"] if c["name"] == "download check")
    assert check["verdict"] == "slow" and "no CRC-32C instructions" in check["detail"], check
    assert "CRC32C_SW_MODE" in check["fix"]
    assert result.returncode == 1
    text = doctor("--cache-dir", str(tmp_path / "cache"), env=env)
    assert "download check" in last_line(text), text.stdout


def test_downloads_kept_on_the_loop_are_a_note(tmp_path: Path):
    """SHARDFS_BODIES_BY_THREAD=0 (downloads spliced by the loop's thread): `doctor` notes
    it and how to undo it; nothing is blocked."""
    env = {**os.environ, "SHARDFS_BODIES_BY_THREAD": "0"}
    report = json.loads(doctor("--cache-dir", str(tmp_path / "cache"), "--json",
                               env=env).stdout)
    check = next(c for c in report["checks"] if c["name"] == "download thread")
    assert check["verdict"] == "note" and "SHARDFS_BODIES_BY_THREAD" in check["fix"], check


def test_unreachable_source(tmp_path: Path):
    port = free_port()  # nothing listens there
    result = doctor(f"http://127.0.0.1:{port}/train-{{0..3}}.tar", "--timeout", "2",
                    "--cache-dir", str(tmp_path / "cache"))
    assert result.returncode == 1, result.stdout
    assert "sources blocks mounting: unreachable" in last_line(result), result.stdout


def test_no_access_to_dev_fuse(open_cache_dir: Path):
    if not shutil.which("unshare") or not shutil.which("setpriv") or os.geteuid() != 0:
        pytest.skip("needs root, unshare and setpriv")
    # In a mount namespace of its own, /dev/fuse is a root-only node (the real one untouched),
    # and the doctor runs as nobody.
    node = open_cache_dir / "fuse"
    os.mknod(node, 0o600 | 0o020000, os.makedev(10, 229))
    inner = (f"mount --bind {node} /dev/fuse && exec setpriv --reuid=65534 --regid=65534 "
             f"--clear-groups {sys.executable} -m shardfs doctor --cache-dir {open_cache_dir}")
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(open_cache_dir)}
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                            capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "/dev/fuse blocks mounting: cannot open /dev/fuse: Permission denied" \
        in last_line(result), result.stdout
    assert "fix:" in result.stdout


def test_wrong_s3_credentials(dataset: Dataset, tmp_path: Path):
    from tests.seaweed_fixture import SeaweedServer

    key, secret = "DOCTORKEY0000001", "doctor-secret"
    with SeaweedServer(tmp_path / "weed", {"reader": (key, secret, ["Read", "List"])}) as weed:
        weed.admin.create_bucket(Bucket="shards")
        for shard in dataset.shards.shards:
            weed.admin.put_object(Bucket="shards", Key=shard.path.name,
                                  Body=shard.path.read_bytes())
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=key, AWS_REGION="us-east-1",
                   AWS_CONFIG_FILE=str(tmp_path / "none"),
                   AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
                   AWS_EC2_METADATA_DISABLED="true")
        source = brace(dataset, "s3://shards")
        args = (source, "--s3-endpoint", weed.url, "--cache-dir", str(tmp_path / "cache"),
                "--cache-size", "64M")
        good = doctor(*args, env={**env, "AWS_SECRET_ACCESS_KEY": secret})
        assert good.returncode == 0, good.stdout + good.stderr
        assert "environment variables [env]" in good.stdout  # which provider answered
        bad = doctor(*args, env={**env, "AWS_SECRET_ACCESS_KEY": "not-the-secret"})
    assert bad.returncode == 1, bad.stdout
    line = last_line(bad)
    assert "credentials blocks mounting: credentials rejected" in line, bad.stdout
    assert "secret key is wrong" in line and "not-the-secret" not in bad.stdout


@needs_shim
def test_a_mount_with_and_without_the_shim(dataset: Dataset, mounter: Mounter):
    source = brace(dataset, str(dataset.shard_dir))
    with_shim = mounter.mount([source], None, None)
    ok = doctor(str(with_shim.mountpoint))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    # The mount's own sources are checked, found through its stats.
    shards = len(dataset.shards.shards)
    assert "in effect at" in ok.stdout and f"{shards} shards reachable" in ok.stdout, ok.stdout
    mnt, cache = mounter.paths()
    env = {**os.environ, "SHARDFS_NO_SHIM": "1"}
    result = subprocess.run([*SHARDFS, "mount", source, str(mnt), "--cache-dir", str(cache)],
                            capture_output=True, text=True, timeout=120, env=env)
    from tests.conftest import Mount

    without = mounter.adopt(Mount.from_result(result, mnt, cache))
    slow = doctor(str(without.mountpoint))
    assert slow.returncode == 1, slow.stdout
    assert "mount's shim slows reads" in last_line(slow), slow.stdout
    assert "runs without the pyfuse3 shim" in last_line(slow)


def test_shards_on_a_local_disk_copied_or_read_in_place(dataset: Dataset, mounter: Mounter,
                                                       tmpfs: Path):
    """Plain shards on a local file system: read in place by default (ok); copied into the
    cache (`in_place: off`): a note naming the option (not a problem: exit 0); a mount
    reading them in place: ok."""
    for shard in dataset.shards.shards:
        shutil.copy(shard.path, tmpfs)
    source = brace(dataset, str(tmpfs))
    shards = len(dataset.shards.shards)
    auto = doctor(source, "--cache-dir", str(tmpfs / "cache"), "--json")
    check = next(c for c in json.loads(auto.stdout)["checks"] if c["name"] == "shard files")
    assert check["verdict"] == "ok", check
    assert check["detail"].endswith("on a local disk: read in place (--in-place auto)"), check
    config = tmpfs / "mount.yaml"
    config.write_text(f"sources: ['{source}']\ncache_dir: {tmpfs / 'cache'}\nin_place: off\n")
    copied = doctor("--config", str(config), "--json")
    check = next(c for c in json.loads(copied.stdout)["checks"] if c["name"] == "shard files")
    assert check["verdict"] == "note", check
    assert f"{shards} shard files on tmpfs (a local disk), copied" in check["detail"], check
    assert "without --in-place off" in check["fix"] and copied.returncode == 0, copied.stdout
    m = mounter.mount([source], None, None, "--in-place", "on")
    in_place = doctor(str(m.mountpoint), "--json")
    check = next(c for c in json.loads(in_place.stdout)["checks"] if c["name"] == "shard files")
    assert check["verdict"] == "ok" and check["detail"].endswith("read in place"), check


def test_shards_on_a_spinning_disk_beside_a_cache_dir_on_a_faster_one(dataset: Dataset,
                                                                      loop_disks):
    """Shards on a disk that spins, the cache dir on one that does not: by default they are
    copied, and doctor says why; `in_place: off` then gets no note (it does what auto does)."""
    shard_disk, cache_disk = loop_disks("shards"), loop_disks("cache")
    shard_disk.set_rotational(True)
    cache_disk.set_rotational(False)
    for shard in dataset.shards.shards:
        shutil.copy(shard.path, shard_disk.path)
    source = brace(dataset, str(shard_disk.path))
    shards = len(dataset.shards.shards)
    auto = doctor(source, "--cache-dir", str(cache_disk.path / "cache"), "--json")
    check = next(c for c in json.loads(auto.stdout)["checks"] if c["name"] == "shard files")
    assert check["verdict"] == "ok", check
    assert (f"copied into the cache (--in-place auto: {shards} on a rotational disk "
            f"({shard_disk.device}; the cache dir on {cache_disk.device}, not rotational))"
            ) in check["detail"], check
    config = cache_disk.path / "mount.yaml"
    config.write_text(f"sources: ['{source}']\ncache_dir: {cache_disk.path / 'cache'}\n"
                      "in_place: off\n")
    copied = doctor("--config", str(config), "--json")
    check = next(c for c in json.loads(copied.stdout)["checks"] if c["name"] == "shard files")
    assert check["verdict"] == "ok" and "as auto would" in check["detail"], check


def test_shards_read_in_place_need_no_room_in_the_cache(dataset: Dataset, tmpfs: Path):
    """A cache smaller than the largest shard slows reads only for shards that come into it:
    local shards read in place (the default) need no room there; copied (`in_place: off`),
    they do."""
    for shard in dataset.shards.shards:
        shutil.copy(shard.path, tmpfs)
    source = brace(dataset, str(tmpfs))
    shards = len(dataset.shards.shards)
    auto = doctor(source, "--cache-dir", str(tmpfs / "cache"), "--cache-size", "4k", "--json")
    check = next(c for c in json.loads(auto.stdout)["checks"] if c["name"] == "cache size")
    assert check["verdict"] == "ok", check
    assert f"all {shards} shards are read in place and need no room in it" in check["detail"]
    config = tmpfs / "mount.yaml"
    config.write_text(f"sources: ['{source}']\ncache_dir: {tmpfs / 'cache'}\n"
                      "cache_size: 4k\nin_place: off\n")
    copied = doctor("--config", str(config), "--json")
    check = next(c for c in json.loads(copied.stdout)["checks"] if c["name"] == "cache size")
    assert check["verdict"] == "slow" and "smaller than the largest shard" in check["detail"]
