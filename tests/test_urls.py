"""Signed URLs (util/urls.py): files beside a shard keep its query; signatures are redacted."""

from __future__ import annotations

from shardfs.catalog.archives import shard_format
from shardfs.catalog.codecs import codec_for
from shardfs.catalog.recordio import idx_url_of, rec_url_of
from shardfs.catalog.shardindex import INDEX_SUFFIX
from shardfs.sources import SourceSettings
from shardfs.sources.http import signatures_expire
from shardfs.util.urls import (
    beside,
    earliest_signed_until,
    path_of,
    query_signed_until,
    redact,
    replace_suffix,
    signed_until,
    unsigned,
)

SAS = "?sv=2024-11-04&se=2026-12-01&sr=c&sp=rl&sig=AbC%2Fd%3D"


def test_files_beside_a_signed_shard_keep_its_query() -> None:
    shard = f"https://acct.blob.core.windows.net/data/train-000001.tar{SAS}"
    index = beside(shard, INDEX_SUFFIX)
    assert index == f"https://acct.blob.core.windows.net/data/train-000001.tar{INDEX_SUFFIX}{SAS}"
    assert replace_suffix(index, INDEX_SUFFIX, "") == shard
    assert path_of(index) == f"/data/train-000001.tar{INDEX_SUFFIX}"
    rec = f"https://h/d/train.rec{SAS}"
    assert idx_url_of(rec) == f"https://h/d/train.idx{SAS}"
    assert rec_url_of(f"https://h/d/train.idx{SAS}") == rec
    assert rec_url_of(f"https://h/d/train.tar{SAS}") is None
    # Unsigned URLs, and schemes whose `?` is part of the object's name, as before.
    assert beside("https://h/d/x.tar", ".idx") == "https://h/d/x.tar.idx"
    assert beside("s3://b/odd?name.tar", ".idx") == "s3://b/odd?name.tar.idx"
    assert idx_url_of("file:///d/train.rec") == "file:///d/train.idx"
    assert idx_url_of("https://h/d/train.bin") == "https://h/d/train.bin.idx"
    # A shard's kind and compression come from its name, never from the query.
    assert codec_for(f"https://h/d/x.tar.zst{SAS}") == "zstd"
    assert shard_format(f"https://h/d/x.zip{SAS}") == "zip"
    assert shard_format("https://h/d/x.tar?name=a.zip") == "tar"
    assert codec_for("s3://b/odd?name.tar.gz") == "gzip"  # a `?` in an object key


def test_signatures_are_redacted_and_nothing_else() -> None:
    presigned = ("https://b.s3.amazonaws.com/k.tar?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                 "&X-Amz-Credential=AKIAEXAMPLE%2F20261128&X-Amz-Date=20261128T000000Z"
                 "&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Signature=0123abcd"
                 "&X-Amz-Security-Token=FwoGZX")
    text = redact(f"fetched shard {presigned}: 3 bytes")
    for secret in ("AKIAEXAMPLE", "0123abcd", "FwoGZX"):
        assert secret not in text
    assert "X-Amz-Algorithm=AWS4-HMAC-SHA256" in text and "X-Amz-Expires=3600" in text
    assert text.endswith(": 3 bytes")
    assert redact(f"GET https://h/x.tar{SAS} failed") == \
        "GET https://h/x.tar?sv=2024-11-04&se=2026-12-01&sr=c&sp=rl&sig=REDACTED failed"
    gcs = "https://storage.googleapis.com/b/o?X-Goog-Signature=feed&X-Goog-Date=1"
    assert redact(gcs) == "https://storage.googleapis.com/b/o?X-Goog-Signature=REDACTED&X-Goog-Date=1"
    cloudfront = "https://d.cloudfront.net/x?Policy=eyJ&Signature=abc~&Key-Pair-Id=K2"
    assert redact(cloudfront) == \
        "https://d.cloudfront.net/x?Policy=REDACTED&Signature=REDACTED&Key-Pair-Id=REDACTED"
    assert redact("https://h/x?token=t0k&key=k3y&keyword=fine") == \
        "https://h/x?token=REDACTED&key=REDACTED&keyword=fine"
    plain = "cache 3 of 8 shards; prefix=train/ sig=12 (no URL query)"
    assert redact(plain) == plain


def test_a_cache_identity_leaves_the_signature_out() -> None:
    """`unsigned`: what names a shard's bytes in the cache. Every parameter of a SAS, a
    presigned S3 or GCS URL and a CloudFront signature goes; what may select content stays."""
    assert unsigned(f"https://acct.blob.core.windows.net/data/x.tar{SAS}") == \
        "https://acct.blob.core.windows.net/data/x.tar"
    presigned = ("https://b.s3.amazonaws.com/k.tar?versionId=3&X-Amz-Algorithm=AWS4-HMAC-SHA256"
                 "&X-Amz-Credential=AKIAEXAMPLE%2F20261128&X-Amz-Date=20261128T000000Z"
                 "&X-Amz-Expires=3600&X-Amz-SignedHeaders=host&X-Amz-Signature=0123abcd"
                 "&X-Amz-Security-Token=FwoGZX")
    assert unsigned(presigned) == "https://b.s3.amazonaws.com/k.tar?versionId=3"
    gcs = ("https://storage.googleapis.com/b/o.tar?generation=17&X-Goog-Algorithm=GOOG4-RSA-SHA256"
           "&X-Goog-Credential=sa%40p.iam&X-Goog-Date=20261128T000000Z&X-Goog-Expires=600"
           "&X-Goog-SignedHeaders=host&X-Goog-Signature=feed")
    assert unsigned(gcs) == "https://storage.googleapis.com/b/o.tar?generation=17"
    assert unsigned("https://d.cloudfront.net/x.tar?Expires=1&Signature=abc~&Key-Pair-Id=K2") \
        == "https://d.cloudfront.net/x.tar"
    assert unsigned("https://h/x.tar?token=t0k&snapshot=2026-11-01&part=2") == \
        "https://h/x.tar?snapshot=2026-11-01&part=2"
    for same in ("https://h/x.tar", "s3://b/k.tar?sig=1", "file:///d/x.tar?se=1"):
        assert unsigned(same) == same


def test_when_a_signature_expires() -> None:
    """`signed_until`: a SAS's `se` (a time or a date, UTC), SigV4's and Google's V4 date plus
    expires, an `Expires` time stamp (SigV2, Google V2, CloudFront); the earliest of the URL's
    and the added query's; nothing for URLs that say nothing or are not http(s)."""
    day = 1796083200.0  # 2026-12-01T00:00:00Z
    assert signed_until("https://h/x.tar?sv=1&se=2026-12-01T00%3A00%3A00Z&sig=a") == day
    assert signed_until("https://h/x.tar?se=2026-12-01T00:00Z&sig=a") == day
    assert signed_until("https://h/x.tar?se=2026-12-01&sig=a") == day
    assert signed_until("https://b.s3.amazonaws.com/k.tar?X-Amz-Date=20261130T230000Z"
                        "&X-Amz-Expires=3600&X-Amz-Signature=f") == day
    assert signed_until("https://storage.googleapis.com/b/o?X-Goog-Date=20261130T000000Z"
                        "&X-Goog-Expires=86400&X-Goog-Signature=f") == day
    assert signed_until(f"https://d.cloudfront.net/x.tar?Expires={int(day)}&Signature=s") == day
    assert query_signed_until("se=2026-12-01&sig=a") == day
    assert earliest_signed_until(["https://h/x.tar?se=2026-12-01", "https://h/y.tar",
                                  "https://h/z.tar?se=2026-12-02"]) == day
    settings = SourceSettings(url_query="sv=1&se=2026-12-01&sig=a")
    # The added query's expiry counts for http(s) shards, whichever comes first.
    for urls in (["https://h/x.tar?se=2026-12-02"], ["https://h/x.tar"]):
        assert signatures_expire(urls, settings) == day
    assert signatures_expire(["https://h/x.tar?se=2026-11-30"], settings) == day - 86400
    assert signatures_expire(["s3://b/x.tar"], settings) is None  # S3 does not carry it
    for silent in ("https://h/x.tar", "https://h/x.tar?versionid=3", "https://h/x?se=soon",
                   "s3://b/k.tar?se=2026-12-01"):
        assert signed_until(silent) is None
