"""AIStore buckets, `ais://bucket/path/shard.tar`, through AIStore's S3-compatible API.

An AIStore gateway serves the S3 REST API under `/s3` (path-style: `/s3/<bucket>/<object>`),
for native `ais://` buckets as well as cloud-backed ones. So `ais://B/K` is read as the S3
object `B/K` at the endpoint `$AIS_ENDPOINT/s3` (settings.ais_endpoint overrides
AIS_ENDPOINT; default http://localhost:8080, as AIStore's own CLI assumes), with the same
ranged GETs, If-Match, retries and ListObjectsV2 listings as s3://. Requests are unsigned
(AIStore does not check SigV4 signatures; clusters with AuthN enabled are not supported
here), and redirects are followed (the gateway may redirect a GET to the storage target that
holds the object).

Not tested against a real AIStore cluster (none can run in CI): the tests run this mapping
against moto's S3 server behind a stand-in gateway that 307-redirects `/s3/...` to it.
AIStore's native object API (`/v1/objects/<bucket>/<object>?provider=ais`) is not used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from shardfs.sources.base import SourceSettings
from shardfs.sources.s3 import DEFAULT_REGION, S3Config, S3Source, _check_endpoint

DEFAULT_AIS_ENDPOINT = "http://localhost:8080"


def load_ais_config(settings: SourceSettings, env: Mapping[str, str] | None = None) -> S3Config:
    env = os.environ if env is None else env
    endpoint = settings.ais_endpoint or env.get("AIS_ENDPOINT") or DEFAULT_AIS_ENDPOINT
    return S3Config(region=DEFAULT_REGION, endpoint=_check_endpoint(endpoint) + "/s3",
                    addressing="path", credentials=None)


class AisSource(S3Source):
    """Shards named `ais://bucket/object`, read through the gateway's /s3 API."""

    scheme = "ais"

    @staticmethod
    def _load_config(settings: SourceSettings, env: Mapping[str, str] | None) -> S3Config:
        return load_ais_config(settings, env)
