"""The columnar shard index and its file format: round trips, and damage always detected."""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from shardfs.catalog.shardindex import (
    INDEX_FORMAT,
    KIND_DIR,
    KIND_FILE,
    KIND_LINK,
    IndexFormatError,
    ShardIndex,
    decode_index,
    encode_index,
)
from shardfs.catalog.tar import Member

AWKWARD_NAMES = [
    b"plain/file.jpg",
    b"with\ttab/and\ttabs.txt",
    b"new\nline/x",
    b"back\\slash\\",
    b"\\t-is-not-a-tab",
    b"\\\\n-double",
    b"latin1-\xe9\xff\xfe/raw-\x80bytes",
    b"trailing-backslash\\",
    b"mixed\\\t\n\\n\\",
    b"\xc3\xa9t\xc3\xa9/caf\xc3\xa9.png",
]


def sample_index() -> ShardIndex:
    index = ShardIndex(size=1 << 20, sha256="ab" * 32, skipped={"device": 2, "fifo": 1})
    index.add(Member(b"dir", "d", 512, 0, 1_600_000_000, 0o755))
    offset = 1024
    for n, name in enumerate(AWKWARD_NAMES):
        index.add(Member(b"dir/" + name, "f", offset, 100 + n, 1_700_000_000 + n, 0o644 | n))
        offset += 1024
    index.add(Member(b"dir/empty", "f", offset, 0, -5, 0o600))  # pre-1970 mtime
    index.add(Member(b"dir/link\twith\ntab", "l", offset + 512, 0, 7, 0o777,
                     b"plain/file.jpg"))
    index.add(Member(b"dir/sub/up", "l", offset + 1024, 0, 7, 0o777, b"../with\ttab"))
    index.add(Member(b"dir/odd-link", "l", offset + 1536, 0, 7, 0o777, b"\xff\\x\n"))
    return index


def assert_same(a: ShardIndex, b: ShardIndex) -> None:
    assert a.size == b.size
    assert a.sha256 == b.sha256
    assert a.skipped == b.skipped
    assert a.paths == b.paths
    assert a.kinds == b.kinds
    assert a.offsets == b.offsets
    assert a.sizes == b.sizes
    assert a.mtimes == b.mtimes
    assert a.modes == b.modes
    assert a.links == b.links


def test_round_trip_with_awkward_names_and_links() -> None:
    index = sample_index()
    data = encode_index(index)
    back = decode_index(data, expect_size=index.size)
    assert_same(index, back)
    assert back.kinds[0] == KIND_DIR
    assert back.kinds[1] == KIND_FILE
    link_positions = [i for i, k in enumerate(back.kinds) if k == KIND_LINK]
    assert sorted(back.links) == link_positions
    assert back.links[link_positions[0]] == b"plain/file.jpg"
    # One line per member after the header: escapes leave no raw tab/newline in a name.
    assert data.count(b"\n") == len(index)
    # Encoding is deterministic.
    assert encode_index(back) == data


def test_round_trip_empty_index() -> None:
    index = ShardIndex(size=1024)
    back = decode_index(encode_index(index), expect_size=1024)
    assert len(back) == 0
    assert back.size == 1024 and back.sha256 is None and back.skipped == {}


def test_round_trip_random_names() -> None:
    rng = random.Random(7)
    index = ShardIndex(size=1 << 40)
    alphabet = b"ab\\\t\n/.\x00\xff-"
    seen = set()
    offset = 0
    while len(index) < 500:
        parts = [bytes(rng.choice(alphabet.replace(b"/", b"").replace(b"\x00", b""))
                       for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        path = b"/".join(parts)
        if path in seen or any(p in (b".", b"..") for p in parts):
            continue
        seen.add(path)
        size = rng.randint(0, 5000)
        index.add(Member(path, "f", offset, size, rng.randint(-(2**33), 2**33), 0o644))
        offset += size + 512
    back = decode_index(encode_index(index))
    assert_same(index, back)


def test_data_end() -> None:
    index = sample_index()
    assert index.data_end() == max(o + s for o, s in zip(index.offsets, index.sizes,
                                                          strict=True))
    assert ShardIndex(size=0).data_end() == 0


def test_every_flipped_byte_in_the_body_is_detected() -> None:
    data = encode_index(sample_index())
    body_start = data.index(b"\n") + 1
    rng = random.Random(1)
    positions = [*rng.sample(range(body_start, len(data)), 60), body_start, len(data) - 1]
    for pos in positions:
        damaged = bytearray(data)
        damaged[pos] ^= 0x01
        with pytest.raises(IndexFormatError, match="checksum"):
            decode_index(bytes(damaged))


@pytest.mark.parametrize("cut", [1, 2, 17, 100, 0.5])
def test_truncated_index_is_detected(cut: float) -> None:
    data = encode_index(sample_index())
    keep = int(len(data) * cut) if isinstance(cut, float) else len(data) - cut
    with pytest.raises(IndexFormatError):
        decode_index(data[:keep])


def test_truncated_to_nothing_or_header_only() -> None:
    data = encode_index(sample_index())
    header = data[: data.index(b"\n")]
    with pytest.raises(IndexFormatError):
        decode_index(b"")
    with pytest.raises(IndexFormatError):
        decode_index(header)
    with pytest.raises(IndexFormatError):
        decode_index(header[:-5])


def test_damaged_header() -> None:
    data = encode_index(sample_index())
    head, _, body = data.partition(b"\n")
    header = json.loads(head)
    for bad in [b"not json", b"[1, 2]", b"5", b"\xff\xfe"]:
        with pytest.raises(IndexFormatError):
            decode_index(bad + b"\n" + body)
    for key, value in [("format", "shardfs-index/0"), ("format", None),
                       ("body_sha256", "00" * 32), ("members", len(sample_index()) + 1),
                       ("size", "1048576"), ("size", None), ("skipped", 3)]:
        changed = dict(header, **{key: value})
        with pytest.raises(IndexFormatError):
            decode_index(json.dumps(changed).encode() + b"\n" + body)


def test_wrong_expected_size() -> None:
    index = sample_index()
    data = encode_index(index)
    assert decode_index(data, expect_size=index.size).size == index.size
    for other in (index.size - 1, index.size + 1, 0):
        with pytest.raises(IndexFormatError, match="bytes"):
            decode_index(data, expect_size=other)


def test_data_past_the_shard_end_is_rejected() -> None:
    index = ShardIndex(size=2048)
    index.add(Member(b"a", "f", 512, 1024, 0, 0o644))
    assert decode_index(encode_index(index)).data_end() == 1536
    index.add(Member(b"b", "f", 2048, 1, 0, 0o644))  # one byte past the end
    with pytest.raises(IndexFormatError, match="past the end"):
        decode_index(encode_index(index))
    exact = ShardIndex(size=2049)
    exact.extend([Member(b"a", "f", 512, 1024, 0, 0o644), Member(b"b", "f", 2048, 1, 0, 0o644)])
    assert len(decode_index(encode_index(exact))) == 2


def forge(body: bytes, *, size: int = 1 << 20, members: int = 1) -> bytes:
    """An index whose body checksum is right but whose content was written by someone else."""
    header = {"format": INDEX_FORMAT, "size": size, "sha256": None, "members": members,
              "body_sha256": hashlib.sha256(body).hexdigest(), "skipped": {}}
    return json.dumps(header).encode() + b"\n" + body


def test_forged_body_that_is_sane_is_accepted() -> None:
    index = decode_index(forge(b"f\t512\t10\t0\t420\ta/b"))
    assert index.paths == [b"a/b"] and index.sizes[0] == 10 and index.modes[0] == 0o644


@pytest.mark.parametrize(
    "body",
    [
        b"f\tx\t10\t0\t420\ta",  # not a number
        b"f\t-512\t10\t0\t420\ta",  # negative offset
        b"f\t512\t10\t0\t999999\ta",  # mode out of range
        b"f\t512\t10\t0\t420",  # too few fields
        b"ff\t512\t10\t0\t420\ta",  # kind of two letters
        b"z\t512\t10\t0\t420\ta",  # unknown kind
        b"f\t512\t10\t0\t420\t../../etc/passwd",  # escapes the mount
        b"f\t512\t10\t0\t420\t/etc/passwd",  # absolute
        b"f\t512\t10\t0\t420\ta//b",  # empty component
        b"f\t512\t10\t0\t420\ta/./b",  # '.' component
        b"f\t512\t10\t0\t420\t",  # empty name
        b"l\t512\t0\t0\t511\ta\t../../outside",  # symlink escapes the mount
        b"l\t512\t0\t0\t511\ta\t/etc/passwd",  # absolute symlink
        b"l\t512\t0\t0\t511\td/l2\tl/..",  # '..' after a name: l may be a link to ..
        b"f\t512\t10\t0\t420\t" + b"x" * 256,  # component longer than NAME_MAX
        b"f\t512\t10\t0\t420\ta\tb",  # link target on a regular file
    ],
)
def test_forged_body_that_is_unsafe_or_malformed_is_rejected(body: bytes) -> None:
    with pytest.raises(IndexFormatError):
        decode_index(forge(body))
