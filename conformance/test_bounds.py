"""The suite's bounds (conformance/bounds.py) against the spec's formulas, written out here
from the text of AFF-8, TQ-12, READ-1, TQC-4 and READ-7 at points worked by hand: a bound looser
than the spec's lets a wrong port pass, a tighter one fails a right port."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kvspec.conformance.bounds import (
    affine_read_bound,
    attention_bound,
    deferred_attention_bound,
    kernel_attention_bound,
    turboquant_key_read_bound,
)


@pytest.mark.parametrize(
    ("scale_dtype", "u", "tau"),
    [(ml_dtypes.bfloat16, 2.0**-8, 2.0**-133), (np.float16, 2.0**-11, 2.0**-24)],
)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_affine_bound_is_aff8s(scale_dtype, u: float, tau: float, bits: int) -> None:
    """AFF-8: B = S (1 + 2^-13) + 2 n u S + n tau + u (M + 2 S) + tau, S = (|s_T| + tau) /
    (1 - u), n = 2^bits - 1, M the group's largest magnitude; one B for every element of
    the group."""
    w = np.zeros((2, 64), np.float32)
    w[0, :4] = [3.0, -1.0, 0.5, 2.0]  # M = 3
    w[1, 7] = -6.0  # M = 6, the largest magnitude negative
    scales = np.array([[0.25, -0.75]], scale_dtype).reshape(2, 1)
    n = 2**bits - 1
    expected = []
    for M, s_T in ((3.0, 0.25), (6.0, 0.75)):
        S = (s_T + tau) / (1 - u)
        expected.append(S * (1 + 2.0**-13) + 2 * n * u * S + n * tau + u * (M + 2 * S) + tau)
    got = affine_read_bound(w, scales, bits, 64)
    assert got.shape == w.shape
    np.testing.assert_allclose(got, np.repeat(np.array(expected)[:, None], 64, 1), rtol=1e-14)


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("zero", [100.0, -2047.0, 2048.0, -3000.0])
def test_the_turboquant_key_bound_is_tq12s(bits: int, zero: float) -> None:
    """TQ-12, element by element: s_hi, s_lo, t_hi, t_lo, shrink, e_z (0 below |z16| =
    2048, else 2^(floor(log2 |z16|) - 11)), delta and B, n = 127 at 8 bits, else
    2^bits - 1."""
    u, u16, tau16 = 2.0**-24, 2.0**-11, 2.0**-24
    eps = float(np.float32(1e-8))
    n = 127 if bits == 8 else 2**bits - 1
    k = np.linspace(-3.0, 5.0, 32, dtype=np.float32).reshape(1, 32)
    s16, z16 = 0.375, zero
    scales = np.array([[s16]], np.float16)
    zeros = np.array([[z16]], np.float16)
    s_hi = (s16 + tau16 / 2) / (1 - u16)
    s_lo = max(0.0, (s16 - tau16 / 2) / (1 + u16))
    t_hi, t_lo = (s_hi + eps) * (1 + u), (s_lo + eps) * (1 - u)
    shrink = max(abs(1 - s16 / t_lo), abs(1 - s16 / t_hi))
    e_z = 0.0 if abs(z16) < 2048 else 2.0 ** (math.floor(math.log2(abs(z16))) - 11)
    expected = []
    for x in np.abs(k[0].astype(np.float64)):
        delta = u * (2 * x / t_lo + abs(z16) + 2 * n + 2)
        expected.append(x * shrink + s16 * (0.5 + delta + e_z) + u * (n + abs(z16) + 1) * s16)
    got = turboquant_key_read_bound(k, scales, zeros, bits)
    assert got.shape == k.shape
    np.testing.assert_allclose(got[0], expected, rtol=1e-14)


# READ-1 and TQC-4 at one worked point: two query heads over one KV head, three keys of
# head dim 2 in bfloat16 (u = 2^-8, tau = 2^-133); the values hold the largest magnitude 6.
QUERIES = np.array([[[[1.0, -2.0]], [[0.5, 3.0]]]], np.float32)
KEYS = np.array([[[[1.0, 1.0], [-2.0, 0.5], [0.25, -4.0]]]], ml_dtypes.bfloat16)
VALUES = np.array([[[[1.0, -3.0], [2.0, 0.5], [-0.5, 6.0]]]], ml_dtypes.bfloat16)
#: Per query head, max_j sum_d |q_d k_jd|: (0.25 + 8) and (0.125 + 12), both the third key.
LARGEST_PRODUCTS = (8.25, 12.125)


@pytest.mark.parametrize("r", [2.0**-24, 2.0**-11])
def test_the_attention_bound_is_read1s(r: float) -> None:
    """READ-1: e = scale max_j sum_d |q_d k_jd| (2u + (D + 6) r), and each output within
    max_j |v_j| (expm1(2e) + 4u + (T + 6) r) + tau."""
    u, tau, D, T, scale = 2.0**-8, 2.0**-133, 2, 3, 0.5
    expected = []
    for products in LARGEST_PRODUCTS:
        e = scale * products * (2 * u + (D + 6) * r)
        expected.append(6.0 * (math.expm1(2 * e) + 4 * u + (T + 6) * r) + tau)
    got = attention_bound(QUERIES, KEYS, VALUES, scale, r)
    assert got.shape == (1, 2, 1, 1)
    np.testing.assert_allclose(got.reshape(2), expected, rtol=1e-14)


def test_the_deferred_bound_is_tqc4s() -> None:
    """TQC-4: sqrt(D) b + t (2 R (1 + 2^-24) + sqrt(D) b) in each output row's l2 norm, b
    READ-1's bound over the rotated values, R their largest row norm, t = (log2 D + 1)
    2^-24."""
    scale, D = 0.5, 2
    b = attention_bound(QUERIES, KEYS, VALUES, scale).reshape(2)
    R = math.sqrt(0.5**2 + 6.0**2)  # the third row's norm, the largest
    t = (math.log2(D) + 1) * 2.0**-24
    expected = [
        math.sqrt(D) * bound + t * (2 * R * (1 + 2.0**-24) + math.sqrt(D) * bound) for bound in b
    ]
    got = deferred_attention_bound(QUERIES, KEYS, VALUES, scale)
    np.testing.assert_allclose(got.reshape(2), expected, rtol=1e-14)


def test_the_kernel_bound_is_read7s() -> None:
    """READ-7's kernel bound, r = 2^-11, a = 2^-23: e = scale max_j (sum_d |q_d k_jd| (2u +
    3r + (D + 4) a) + F_j), F_j = max(2^-39 max_d |q_d|, 2^-151) sum_d |k_jd|; each output
    within max_j |v_j| (expm1(2e) + 4u + 3r + (2T + 16) a) + tau, or with scaled weights
    of n levels max_j |v_j| expm1(2e) + W (7u + 4r + (4T + 33) a) (1 + expm1(2e)) + tau, W
    the larger of max_j |v_j| and the largest 3 2^bits |s| + |b| of a stored group."""
    u, tau, r, a, D, T, scale = 2.0**-8, 2.0**-133, 2.0**-11, 2.0**-23, 2, 3, 0.5
    q = np.abs(QUERIES.astype(np.float64)).reshape(2, 2)
    k = np.abs(KEYS.astype(np.float64)).reshape(3, 2)
    moved = []
    for head in q:
        F = max(2.0**-39 * head.max(), 2.0**-151) * k.sum(axis=1)
        terms = (k @ head) * (2 * u + 3 * r + (D + 4) * a) + F
        moved.append(math.expm1(2 * scale * terms.max()))
    expected = [6.0 * (m + 4 * u + 3 * r + (2 * T + 16) * a) + tau for m in moved]
    got = kernel_attention_bound(QUERIES, KEYS, VALUES, scale)
    np.testing.assert_allclose(got.reshape(2), expected, rtol=1e-14)
    # Scaled weights, 4 bits, one group of 2 a row: 3 16 |s| + |b| = 13, 50, 24.5.
    scales = np.array([0.25, -1.0, 0.5], ml_dtypes.bfloat16).reshape(1, 1, 3, 1)
    biases = np.array([-1.0, 2.0, 0.5], ml_dtypes.bfloat16).reshape(1, 1, 3, 1)
    W = 50.0
    expected = [6.0 * m + W * (7 * u + 4 * r + (4 * T + 33) * a) * (1 + m) + tau for m in moved]
    got = kernel_attention_bound(QUERIES, KEYS, VALUES, scale, value_groups=(scales, biases, 4))
    np.testing.assert_allclose(got.reshape(2), expected, rtol=1e-14)


def test_the_interval_ends_widen_to_zero_below_the_normal_range_alone() -> None:
    """The rounded interval (the suite's own measure beside READ-1): an end that rounds
    below float32's smallest normal may be flushed to zero by MLX's attention, so the
    interval reaches 0 there; the smallest normal itself is kept."""
    from kvspec.conformance.bounds import FLOAT32_TINY, _high_end, _low_end

    ends = np.array([FLOAT32_TINY, -FLOAT32_TINY, FLOAT32_TINY / 2, -FLOAT32_TINY / 2])
    half = FLOAT32_TINY / 2
    low, high = _low_end(ends, np.float32), _high_end(ends, np.float32)
    np.testing.assert_array_equal(low, [FLOAT32_TINY, -FLOAT32_TINY, 0.0, -half])
    np.testing.assert_array_equal(high, [FLOAT32_TINY, -FLOAT32_TINY, half, 0.0])
