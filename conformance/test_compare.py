"""The suite's own bit comparison (conformance/compare.py): every test of stored bits
goes through it, so a weaker comparison would pass a wrong port silently. Held here on
arrays whose differences are known."""

from __future__ import annotations

import numpy as np
import pytest

from kvspec.conformance.compare import (
    assert_same_bits,
    first_difference,
    mismatches,
    rank_of,
)


def test_equal_bits_pass_even_where_values_are_not_equal() -> None:
    nan = np.array([np.nan, -0.0, 1.5], np.float32)
    assert_same_bits(nan, nan.copy(), "nan")
    assert mismatches(nan, nan.copy()) == 0
    assert first_difference(nan, nan.copy()) is None


def test_one_differing_bit_fails_with_its_place() -> None:
    expected = np.zeros((2, 3), np.float32)
    actual = expected.copy()
    actual[1, 2] = -0.0  # equal as values, one bit apart
    assert mismatches(actual, expected) == 1
    report = first_difference(actual, expected)
    assert report.startswith("1 of 6 differ; first at (1, 2): ") and "-0.0" in report
    with pytest.raises(AssertionError, match=r"keys: 1 of 6 differ; first at \(1, 2\)"):
        assert_same_bits(actual, expected, "keys")
    actual[0, 1] = 1.0
    assert mismatches(actual, expected) == 2
    assert first_difference(actual, expected).startswith("2 of 6 differ; first at (0, 1)")


def test_nan_payloads_are_bits_apart() -> None:
    quiet = np.array([0x7FC00000], np.uint32).view(np.float32)
    other = np.array([0x7FC00001], np.uint32).view(np.float32)
    with pytest.raises(AssertionError):
        assert_same_bits(other, quiet, "nan")


def test_another_dtype_or_shape_fails_whatever_the_bits() -> None:
    codes = np.arange(6, dtype=np.uint16)
    with pytest.raises(AssertionError, match="dtype int16 != uint16"):
        assert_same_bits(codes.view(np.int16), codes, "codes")
    with pytest.raises(AssertionError, match=r"shape \(2, 3\) != \(6,\)"):
        assert_same_bits(codes.reshape(2, 3), codes, "codes")
    assert mismatches(codes.view(np.int16), codes) == 6
    assert mismatches(codes[:4], codes) == 6
    assert mismatches(codes, codes[:4]) == 6


def test_a_rank_is_one_element() -> None:
    assert rank_of(np.uint32(2)) == 2
    assert rank_of(np.array([3], np.uint32)) == 3
    with pytest.raises(ValueError):
        rank_of(np.array([1, 2], np.uint32))
