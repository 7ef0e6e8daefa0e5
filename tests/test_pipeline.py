"""Loose directory -> `shardfs pack` -> an S3-compatible bucket -> `shardfs mount s3://...`
-> an unchanged ImageFolder run. Every step through the documented commands."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from shardfs.devtools.datagen import make_imagefolder
from tests.conftest import SHARDFS, Mount, Mounter
from tests.moto_fixture import MotoServer

datasets = pytest.importorskip("torchvision.datasets")


def test_directory_to_s3_bucket_to_imagefolder(tmp_path: Path, mounter: Mounter):
    images = tmp_path / "images"
    make_imagefolder(images, classes=4, per_class=15, mean_kb=6, seed=5)
    out = tmp_path / "shards"
    packed = subprocess.run([*SHARDFS, "pack", str(images), str(out), "--prefix", "train",
                             "--shard-size", "96KiB", "--shuffle"],
                            capture_output=True, text=True, check=True)
    pattern = packed.stdout.strip()
    assert "{" in pattern, pattern  # several shards, named by a brace pattern

    with MotoServer(tmp_path / "moto") as moto:
        key, secret = moto.iam_user("trainer", ["s3:GetObject", "s3:ListBucket"])
        admin = moto.client("s3")
        admin.create_bucket(Bucket="datasets")
        for f in sorted(out.iterdir()):  # shards and their index files, like `aws s3 cp -r`
            admin.upload_file(str(f), "datasets", f"imagenet-mini/{f.name}")
        moto.enforce_auth()  # from here on every request must be correctly signed
        secret_file = tmp_path / "secret"
        secret_file.write_text(secret)
        config = tmp_path / "mini.yaml"
        config.write_text(
            "sources: s3://datasets/imagenet-mini/\n"  # a prefix: all shards under it
            f"s3_endpoint: {moto.url}\n"
            "credentials:\n"
            "  access_key_id: {env: TRAINER_KEY}\n"
            f"  secret_access_key: {{file: {secret_file}}}\n")
        mnt, cache = mounter.paths()
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env["TRAINER_KEY"] = key
        result = subprocess.run([*SHARDFS, "mount", "--config", str(config), str(mnt),
                                 "--cache-dir", str(cache), "--no-warm"],
                                capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == 0, result.stderr
        assert secret not in result.stdout + result.stderr
        m = mounter.adopt(Mount.from_result(result, mnt, cache))

        local = datasets.ImageFolder(str(images / "train"))
        mounted = datasets.ImageFolder(str(mnt / "train"))
        assert mounted.classes == local.classes
        rel = [(os.path.relpath(p, images / "train"), t) for p, t in local.samples]
        assert [(os.path.relpath(p, mnt / "train"), t) for p, t in mounted.samples] == rel
        for (path, _), (mpath, _) in zip(local.samples, mounted.samples, strict=True):
            assert Path(mpath).read_bytes() == Path(path).read_bytes()
        stats = m.stats()
        assert stats["shards"] == len(list(out.glob("*.tar")))
        assert stats["reader"]["eio"] == 0
        assert secret not in m.log()
        m.unmount()
