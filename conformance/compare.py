"""Bit-level comparison of stored fields, with reports that locate the first difference."""

from __future__ import annotations

import numpy as np


def bit_view(a: np.ndarray) -> np.ndarray:
    """The raw bits of each element as an unsigned integer array."""
    a = np.ascontiguousarray(a)
    return a.view(f"u{a.dtype.itemsize}")


def mismatches(actual: np.ndarray, expected: np.ndarray) -> int:
    """How many elements differ in their bits (shape or dtype differences count all)."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return max(actual.size, expected.size)
    return int(np.count_nonzero(bit_view(actual) != bit_view(expected)))


def first_difference(actual: np.ndarray, expected: np.ndarray) -> str | None:
    """None when bit-equal, else where and how they first differ."""
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    differ = np.argwhere(bit_view(actual) != bit_view(expected))
    if differ.size == 0:
        return None
    index = tuple(int(i) for i in differ[0])
    return (
        f"{len(differ)} of {actual.size} differ; first at {index}: "
        f"{actual[index]!r} != {expected[index]!r}"
    )


def assert_same_bits(actual: np.ndarray, expected: np.ndarray, field: str) -> None:
    """Fail with the first difference when two arrays do not hold the same bits."""
    difference = first_difference(actual, expected)
    assert difference is None, f"{field}: {difference}"
