"""parse_size: K/M/G and KiB/MiB/GiB are binary, KB/MB/GB decimal, units case-insensitive."""

from __future__ import annotations

import pytest

from shardfs.util.sizes import format_size, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("123456", 123456),
        ("12B", 12),
        ("12 bytes", 12),
        ("1K", 1024),
        ("1k", 1024),
        ("1KiB", 1024),
        ("1KB", 1000),
        ("1kb", 1000),
        ("256MiB", 256 * 2**20),
        ("256M", 256 * 2**20),
        ("100MB", 100_000_000),
        ("1G", 2**30),
        ("1 GiB", 2**30),
        ("2GB", 2_000_000_000),
        ("1T", 2**40),
        ("3TB", 3 * 10**12),
        ("1.5K", 1536),
        ("0.5GiB", 2**29),
        (".5M", 2**19),
        ("  64K  ", 65536),
        ("1.0", 1),
    ],
)
def test_parse_size_accepts(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "expected a number"),
        ("abc", "expected a number"),
        ("K", "expected a number"),
        ("1..5M", "expected a number"),
        ("1 2K", "expected a number"),
        ("-5M", "negative"),
        ("12X", "unknown unit 'X'"),
        ("5MiBs", "unknown unit"),
        ("1.5", "whole number"),
        ("1.5B", "whole number"),
    ],
)
def test_parse_size_rejects_with_clear_message(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as excinfo:
        parse_size(text)
    assert repr(text) in str(excinfo.value)  # the message quotes what the user typed


def test_format_size() -> None:
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(3 * 2**30) == "3.0 GiB"
    assert parse_size(format_size(256 * 2**20).replace(" ", "")) == 256 * 2**20
