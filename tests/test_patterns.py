"""Brace patterns: ranges (zero padding), alternatives, several groups, and every error."""

from __future__ import annotations

import time

import pytest

from shardfs.catalog.patterns import PatternError, expand_braces


def test_no_braces_is_returned_as_is() -> None:
    assert expand_braces("https://host/data/train-000000.tar") == [
        "https://host/data/train-000000.tar"
    ]
    assert expand_braces("") == [""]


def test_zero_padded_range() -> None:
    assert expand_braces("train-{000000..000003}.tar") == [
        "train-000000.tar",
        "train-000001.tar",
        "train-000002.tar",
        "train-000003.tar",
    ]
    # Numbers wider than the padding are not cut.
    assert expand_braces("s{08..11}") == ["s08", "s09", "s10", "s11"]


def test_unpadded_range() -> None:
    assert expand_braces("s{0..10}") == [f"s{n}" for n in range(11)]
    assert expand_braces("s{7..7}") == ["s7"]
    assert expand_braces("s{-2..1}") == ["s-2", "s-1", "s0", "s1"]


def test_padding_uses_the_wider_bound() -> None:
    # {00..100}: every name gets three digits, as in braceexpand (WebDataset's expander).
    names = expand_braces("{00..100}")
    assert names[0] == "000" and names[99] == "099" and names[-1] == "100"
    assert {len(n) for n in names} == {3}
    assert expand_braces("{0..010}")[:2] == ["000", "001"]


def test_matches_braceexpand_on_ranges() -> None:
    braceexpand = pytest.importorskip("braceexpand").braceexpand
    for pattern in ["a{0..12}b", "{000..012}", "{00..100}", "{0..010}", "{-05..5}",
                    "{-3..3}", "{0..0}", "{007..9}", "x{1..3}y{a,b}z", "{a,b}{00..02}"]:
        assert expand_braces(pattern) == list(braceexpand(pattern)), pattern


def test_alternatives() -> None:
    assert expand_braces("{train,val}.tar") == ["train.tar", "val.tar"]
    assert expand_braces("a{x,,y}b") == ["axb", "ab", "ayb"]


def test_several_groups_in_order() -> None:
    assert expand_braces("{a,b}-{0..2}/{x,y}") == [
        "a-0/x", "a-0/y", "a-1/x", "a-1/y", "a-2/x", "a-2/y",
        "b-0/x", "b-0/y", "b-1/x", "b-1/y", "b-2/x", "b-2/y",
    ]
    assert len(expand_braces("{0..9}{0..9}{0..9}")) == 1000
    assert expand_braces("{0..9}{0..9}{0..9}")[123] == "123"


@pytest.mark.parametrize(
    "pattern",
    [
        "train-{0..3.tar",  # unclosed
        "train-0..3}.tar",  # close without open
        "a}{b,c}",  # stray close before a group
        "{a,b}}",  # stray close after a group
        "{a,b}{",  # open at the end
    ],
)
def test_unbalanced(pattern: str) -> None:
    with pytest.raises(PatternError, match="unbalanced"):
        expand_braces(pattern)


def test_reversed_range() -> None:
    with pytest.raises(PatternError, match="backwards"):
        expand_braces("s{5..3}")


@pytest.mark.parametrize("pattern", ["s{}", "s{abc}", "s{1..}", "s{..3}", "s{1...3}"])
def test_empty_or_meaningless_body(pattern: str) -> None:
    with pytest.raises(PatternError, match="cannot expand"):
        expand_braces(pattern)


def test_nested() -> None:
    with pytest.raises(PatternError, match="nested"):
        expand_braces("{a,{b,c}}")


def test_huge_range_fails_fast() -> None:
    began = time.monotonic()
    with pytest.raises(PatternError, match="too large"):
        expand_braces("s{0..99999999999}")
    assert time.monotonic() - began < 5  # building them would take minutes


def test_huge_product_of_groups_fails_before_building_it() -> None:
    # Each group alone is allowed; their product (10**8 names, gigabytes) must be refused
    # before it is materialized.
    began = time.monotonic()
    with pytest.raises(PatternError, match="more than"):
        expand_braces("{0..9999}-{0..9999}")
    assert time.monotonic() - began < 5  # building them would take minutes


def test_pattern_error_is_a_value_error() -> None:
    assert issubclass(PatternError, ValueError)
