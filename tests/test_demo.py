"""`shardfs demo`, one of the two commands the README gives a new user, runs end to end."""

from __future__ import annotations

import os
import re
import subprocess

from tests.conftest import SHARDFS
from tests.reliability import pid_alive


def test_demo_runs_and_cleans_up():
    result = subprocess.run([*SHARDFS, "demo"], capture_output=True, text=True, timeout=240)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    work = re.search(r"\[demo\] working in (\S+)", out).group(1)
    pid = int(re.search(r"daemon pid (\d+)", out).group(1))
    assert "made 400 JPEGs in 10 classes" in out, out
    assert "serving the shards with nginx" in out, out  # not the local-files fallback
    epochs = re.findall(r"(?:one shuffled epoch through the mount|second epoch \(cached\)): "
                        r"(\d+) images", out)
    assert epochs == ["400", "400"], out
    # The point of the demo: a few requests for whole shards, not one per file.
    requests = int(re.search(r"nginx served (\d+) requests for shard data", out).group(1))
    shards = int(re.search(r"packed them into (\d+) shards", out).group(1))
    assert 1 <= requests <= 2 * shards, out
    served, fetched = (int(x.replace(",", "")) for x in re.search(
        r"bytes read through the mount: ([\d,]+); fetched from the source: ([\d,]+)",
        out).groups())
    assert served > 0 and fetched <= 3 * served, out
    assert out.rstrip().endswith("[demo] unmounted and cleaned up"), out
    assert not os.path.exists(work)  # its temp dir is gone, with the mountpoint in it
    assert not pid_alive(pid)
