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


def first_differing(actual: np.ndarray, expected: np.ndarray) -> tuple[tuple[int, ...], int] | None:
    """None when two arrays of one dtype and shape hold the same bits, else the index of
    the first differing element and how many differ."""
    differ = np.argwhere(bit_view(actual) != bit_view(expected))
    if differ.size == 0:
        return None
    return tuple(int(i) for i in differ[0]), len(differ)


def first_difference(actual: np.ndarray, expected: np.ndarray) -> str | None:
    """None when bit-equal, else where and how they first differ."""
    if actual.dtype != expected.dtype:
        return f"dtype {actual.dtype} != {expected.dtype}"
    if actual.shape != expected.shape:
        return f"shape {actual.shape} != {expected.shape}"
    found = first_differing(actual, expected)
    if found is None:
        return None
    index, count = found
    values = f"{actual[index]!r} != {expected[index]!r}"
    return f"{count} of {actual.size} differ; first at {index}: {values}"


def assert_same_bits(actual: np.ndarray, expected: np.ndarray, field: str) -> None:
    """Fail with the first difference when two arrays do not hold the same bits."""
    difference = first_difference(actual, expected)
    assert difference is None, f"{field}: {difference}"


def rank_of(failure: np.ndarray) -> int:
    """A failure rank (DEFER-2) as an int, whether a backend returns a scalar or one
    element."""
    (rank,) = np.asarray(failure).reshape(-1)
    return int(rank)
