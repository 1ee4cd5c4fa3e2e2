"""Read-error bounds the spec derives (AFF-8, TQ-12, READ-1, READ-7, TQC-4)."""

from __future__ import annotations

import numpy as np

from kvspec.reference.caches.reads import DenseRead
from kvspec.reference.caches.turboquant import DeferredRead
from kvspec.reference.dtypes import smallest_subnormal, unit_roundoff

# Relative slack for the float32 steps of the encoder (AFF-8: subtract, divide,
# and the scale's own division, each one rounding of at most 256 code steps).
ENCODE_SLACK = 2.0**-13


def affine_read_bound(w: np.ndarray, scales: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """Per-element bound on |w - dequantize(quantize(w))| (AFF-8), float64.

    S = (|s_d| + tau) / (1 - u) bounds the float32 scale from the stored one;
    bound = S (1 + 2^-13) + 2 n u S + n tau + u (M + 2 S) + tau, with n = 2^bits - 1,
    u and tau the dtype's unit roundoff and smallest subnormal, M the group's
    largest magnitude.
    """
    dtype = scales.dtype
    u = unit_roundoff(dtype)
    tau = smallest_subnormal(dtype)
    n = 2**bits - 1
    *lead, D = w.shape
    groups = w.astype(np.float64).reshape(*lead, D // group_size, group_size)
    magnitude = np.abs(groups).max(axis=-1)
    S = (np.abs(scales.astype(np.float64)) + tau) / (1 - u)
    bound = S * (1 + ENCODE_SLACK) + 2 * n * u * S + n * tau + u * (magnitude + 2 * S) + tau
    return np.broadcast_to(bound[..., None], groups.shape).reshape(w.shape)


def turboquant_key_read_bound(
    k: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int
) -> np.ndarray:
    """Per-element bound on |k - decode_keys(encode_keys(k))| (TQ-12), float64.

    From the stored scale s16 and zero point z16 of each group: the float32 scale s
    lies in [s_lo, s_hi] (one float16 rounding), the code step t = f32(s + EPS) in
    [t_lo, t_hi]; then
    bound = |k| max|1 - s16 / t| + s16 (1/2 + delta + e_z) + u32 (n + |z16| + 1) s16,
    with n the largest code magnitude, e_z the float16 rounding of the zero point (0
    below 2048, half its spacing above) and delta the float32 slack of the code.
    """
    u32 = 2.0**-24
    u16 = unit_roundoff(scales.dtype)
    tau16 = smallest_subnormal(scales.dtype)
    eps = float(np.float32(1e-8))
    levels = 127 if bits == 8 else 2**bits - 1
    *lead, D = k.shape
    x = np.abs(k.astype(np.float64)).reshape(*lead, D // 32, 32)
    s16 = scales.astype(np.float64)[..., None]
    z16 = np.abs(zeros.astype(np.float64))[..., None]
    s_hi = (s16 + tau16 / 2) / (1 - u16)
    s_lo = np.maximum((s16 - tau16 / 2) / (1 + u16), 0.0)
    t_hi = (s_hi + eps) * (1 + u32)
    t_lo = (s_lo + eps) * (1 - u32)
    shrink = np.maximum(np.abs(1 - s16 / t_lo), np.abs(1 - s16 / t_hi))
    binade = np.floor(np.log2(np.maximum(z16, 1.0)))
    e_z = np.where(z16 < 2048, 0.0, 2.0 ** (binade - 11))
    delta = u32 * (2 * x / t_lo + z16 + 2 * levels + 2)
    bound = x * shrink + s16 * (0.5 + delta + e_z) + u32 * (levels + z16 + 1) * s16
    return bound.reshape(k.shape)


# float32 unit roundoff: accumulations inside the backend's attention are float32 (READ-1).
FLOAT32_ROUNDOFF = 2.0**-24


def attention_bound(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    scale: float,
    roundoff: float = FLOAT32_ROUNDOFF,
) -> np.ndarray:
    """Per-output bound on |backend attention - reference attention| (READ-1), float64,
    broadcastable to [B, Hq, N, Dv].

    With u the unit roundoff of the keys' dtype, D the head_dim and T the keys:
    each score may be off by e = scale * max_j sum_d |q_d k_jd| * (2u + (D + 2) 2^-24)
    (q * scale rounded, the dot product accumulated in float32 and rounded); the
    softmax weights then move by at most expm1(2e) in l1, the weights and the output are
    rounded once each and the output accumulated in float32:
    bound = max_j |v_j| * (expm1(2e) + 4u + (T + 2) 2^-24) + tau, tau the keys' format's
    smallest subnormal: the output's rounding below the normal range is tau/2 absolute.
    `roundoff` replaces 2^-24 for a backend whose attention multiplies and adds with less
    precision (READ-1: MLX's CUDA attention brings float32 operands to TF32, 2^-11); the
    operands' own rounding or truncation to it adds up to 4 roundoff to each product.
    """
    u = unit_roundoff(keys.dtype)
    D, T = queries.shape[-1], keys.shape[2]
    _, _, products = _products(queries, keys)
    score_error = scale * products.max(axis=-1) * (2 * u + (D + 6) * roundoff)
    return _output_bound(queries, keys, values, score_error, 4 * u + (T + 6) * roundoff)


def _products(queries: np.ndarray, keys: np.ndarray):
    """|q| [B, Hk, G, N, D] by KV head, |k| [B, Hk, 1, T, D] and sum_d |q_d k_jd|
    [B, Hk, G, N, T], float64."""
    B, Hq, N, D = queries.shape
    Hk = keys.shape[1]
    q = np.abs(queries.astype(np.float64)).reshape(B, Hk, Hq // Hk, N, D)
    k = np.abs(keys.astype(np.float64))[:, :, None]
    return q, k, q @ np.swapaxes(k, -1, -2)


def _output_bound(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    score_error: np.ndarray,
    slack: float,
    value_magnitude: np.ndarray | None = None,
) -> np.ndarray:
    """max_j |v_j| (expm1(2e) + slack) + tau [B, Hq, N, 1] for score errors e
    [B, Hk, G, N], tau the keys' format's smallest subnormal; with `value_magnitude` W
    [B, Hk] (the terms a read sums, where they exceed the values), max_j |v_j| expm1(2e) +
    max(W, max_j |v_j|) slack (1 + expm1(2e)) + tau."""
    B, Hq, N, _ = queries.shape
    largest_value = np.abs(values.astype(np.float64)).max(axis=(-2, -1))[:, :, None, None]
    tau = smallest_subnormal(keys.dtype)
    # Scores near float32's limit have an error bound past float64's, and values near it
    # a bound that overflows with it: no bound (inf), as the formula says.
    with np.errstate(over="ignore"):
        moved = np.expm1(2 * score_error)
        if value_magnitude is None:
            bound = largest_value * (moved + slack) + tau
        else:
            terms = np.maximum(largest_value, value_magnitude[:, :, None, None])
            bound = largest_value * moved + terms * slack * (1 + moved) + tau
    return bound.reshape(B, Hq, N, 1)


def deferred_attention_bound(
    queries: np.ndarray,
    keys: np.ndarray,
    rotated_values: np.ndarray,
    scale: float,
    roundoff: float = FLOAT32_ROUNDOFF,
) -> np.ndarray:
    """Per-output bound on |backend deferred read - reference deferred read| (TQC-4),
    float64, broadcastable to [B, Hq, N, D].

    Both attend over the rotated values, within b = attention_bound of each other per
    element, then unrotate in float32 (`unrotated_bound`)."""
    b = attention_bound(queries, keys, rotated_values, scale, roundoff)
    return unrotated_bound(b, queries, keys, rotated_values)


def unrotated_bound(
    b: np.ndarray, queries: np.ndarray, keys: np.ndarray, rotated_values: np.ndarray
) -> np.ndarray:
    """TQC-4: the bound on each output row's l2 norm (`read_error`), hence on each element
    too, of two reads over the rotated values within b of each other per element, each
    unrotated in float32. The orthogonal transform keeps the l2 norm of an error of at most
    b per element, at most sqrt(D) b, and each side's float32 transform adds at most t ||x||
    to it (t = (log2 D + 1) 2^-24, TQ-6) for an input row x, whose norm is at most
    R (1 + 2^-24) on the reference's side (R the largest row norm of the rotated values; the
    output is a convex combination of rows, rounded once) and sqrt(D) b more on the
    backend's:
    bound = sqrt(D) b + t (2 R (1 + 2^-24) + sqrt(D) b).
    """
    B, Hq, _, _ = queries.shape
    Hk, D = keys.shape[1], rotated_values.shape[-1]
    norms = np.linalg.norm(rotated_values.astype(np.float64), axis=-1).max(axis=-1)
    R = np.repeat(norms, Hq // Hk, axis=1).reshape(B, Hq, 1, 1)
    t = (np.log2(D) + 1) * FLOAT32_ROUNDOFF
    spread = np.sqrt(D) * b
    return spread + t * (2 * R * (1 + FLOAT32_ROUNDOFF) + spread)


#: READ-7: the unit roundoff of the kernels' rounded operands (TF32 and float16).
KERNEL_ROUNDOFF = 2.0**-11
#: READ-7: a float32 sum of the kernels, as the tensor cores accumulate (truncating).
ACCUMULATION_ROUNDOFF = 2.0**-23


def kernel_attention_bound(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    scale: float,
    key_scales: np.ndarray | None = None,
    key_zeros: np.ndarray | None = None,
    value_groups: tuple[np.ndarray, np.ndarray, int] | None = None,
) -> np.ndarray:
    """Per-output bound on |decode-attention kernel - reference attention| (READ-7's kernel
    bound), float64, broadcastable to [B, Hq, N, Dv]; with the float16 key scales and zeros
    [B, Hk, T, D / 32] of TurboQuant's 8-bit keys, for their group scores; with the
    stored scales and biases [B, Hk, T, Dv / group] and bits of affine values read with
    scaled weights, for those.

    With r = 2^-11, a = 2^-23 and u the unit roundoff of the keys' dtype, each score may be
    off by e = scale * max_j (sum_d |q_d k_jd| (2u + 3r + (D + 4) a) + F_j + G_j): the
    query rounded and the stored operand truncated, products exact, float32 sums
    accumulated as the tensor cores do; F_j = 2^-39 max_d |q_d| sum_d |k_jd|, at least
    2^-151 sum_d |k_jd|, covers the group scores' float16 query elements below float16's
    normal range; G_j = a (1 + 2^-10) sum_g (64349 + 18 |zero_jg|) scale_jg
    sum_(d in g) |q_d| covers the group scores' float32 sums, whose cancellation of
    1152 Q_g and zero_jg Q_g the scale multiplies: P's 32 products with 1152 + code, each at
    most 1279 |q_d|, 34 a each (34 * 1279 = 43486); Q's sum, 34 a / 2 each, times
    |zero - 1152| <= 1152 + |zero| (17 * 1152 = 19584, and 17 |zero|); the rounding of
    P + (zero - 1152) Q (1279 + |zero|); (1 + 2^-10) for the query's rounding to float16.
    The output is then within max_j |v_j| (expm1(2e) + 4u + 3r + (2T + 16) a) + tau:
    weights rounded and values truncated to TF32, exp2 and the float32 sums of T positions,
    splits and their merge.

    Scaled weights (affine values of n = 2^bits - 1 levels, their codes c entering as
    2^bits + c, each weight p times its group's scale s rounded to TF32 as B, the sum of
    p b - 2^bits B apart): a position's term B c + p b is within p (r + 3u) (|s c| + |b|)
    of p v, v = T(T(s c) + b) (B's rounding, 2^-24 for p s before it, and v's two
    roundings), and the float32 sums of the codes' products and of the biases' terms, T
    positions each and their final sum, hold terms up to p ((2^(bits + 1) + n) |s| + |b|).
    The weights' error moves the output by max_j |v_j| expm1(2e) as before; with W the
    larger of max_j |v_j| and the largest 3 2^bits |s| + |b| of a stored group, the output
    is within max_j |v_j| expm1(2e) + W (7u + 4r + (4T + 33) a) (1 + expm1(2e)) + tau.
    """
    u = unit_roundoff(keys.dtype)
    B, Hq, N, D = queries.shape
    _, Hk, T, _ = keys.shape
    q, k, products = _products(queries, keys)
    largest_query = q.max(axis=-1, keepdims=True)
    subnormal = np.maximum(2.0**-39 * largest_query, 2.0**-151) * k.sum(axis=-1)[..., None, :]
    score = products * (2 * u + 3 * KERNEL_ROUNDOFF + (D + 4) * ACCUMULATION_ROUNDOFF)
    score = score + subnormal
    if key_scales is not None:
        scales = np.abs(key_scales.astype(np.float64))[:, :, None, None]  # [B, Hk, 1, 1, T, G]
        zeros = np.abs(key_zeros.astype(np.float64))[:, :, None, None]
        weights = ACCUMULATION_ROUNDOFF * (64349 + 18 * zeros) * (1 + 2.0**-10) * scales
        query_groups = q.reshape(B, Hk, Hq // Hk, N, D // 32, 32).sum(axis=-1)[..., None, :]
        score = score + (weights * query_groups).sum(axis=-1)
    score_error = scale * score.max(axis=-1)
    if value_groups is None:
        slack = 4 * u + 3 * KERNEL_ROUNDOFF + (2 * T + 16) * ACCUMULATION_ROUNDOFF
        return _output_bound(queries, keys, values, score_error, slack)
    value_scales, value_biases, bits = value_groups
    groups = 3 * 2**bits * np.abs(value_scales.astype(np.float64)) + np.abs(
        value_biases.astype(np.float64)
    )
    slack = 7 * u + 4 * KERNEL_ROUNDOFF + (4 * T + 33) * ACCUMULATION_ROUNDOFF
    return _output_bound(queries, keys, values, score_error, slack, groups.max(axis=(-2, -1)))


def read_error(actual: np.ndarray, expected: np.ndarray, read: DenseRead | DeferredRead):
    """What `read_bound` bounds of |actual - expected|, float64: each element's error for a
    dense read; for a deferred read (TQC-4) each output row's l2 norm, broadcast over the
    row, since the orthogonal transform keeps a row's norm, not its elements."""
    error = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
    if isinstance(read, DeferredRead):
        return np.broadcast_to(np.linalg.norm(error, axis=-1, keepdims=True), error.shape)
    return error


def read_bound(
    queries: np.ndarray,
    read: DenseRead | DeferredRead,
    scale: float,
    roundoff: float = FLOAT32_ROUNDOFF,
) -> np.ndarray:
    """The bound of a backend's read around the reference's `read` (READ-1, TQC-4)."""
    if isinstance(read, DeferredRead):
        return deferred_attention_bound(queries, read.keys, read.rotated_values, scale, roundoff)
    return attention_bound(queries, read.keys, read.values, scale, roundoff)


#: The smallest normal float32: MLX's CPU attention may flush results below it to zero.
FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def _in_format(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x rounded to `dtype` (through float32: both roundings are monotone), as float64."""
    return np.asarray(x, np.float64).astype(np.float32).astype(dtype).astype(np.float64)


def _low_end(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The low end of an interval rounded to `dtype`; 0 where a flush to zero may lower it."""
    rounded = _in_format(x, dtype)
    return np.where(np.abs(rounded) < FLOAT32_TINY, np.minimum(rounded, 0.0), rounded)


def _high_end(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The high end of an interval rounded to `dtype`; 0 where a flush to zero may raise it."""
    rounded = _in_format(x, dtype)
    return np.where(np.abs(rounded) < FLOAT32_TINY, np.maximum(rounded, 0.0), rounded)


def rounded_attention_interval(
    queries: np.ndarray,
    keys: np.ndarray,
    values: np.ndarray,
    scale: float,
    visible: np.ndarray,
    roundoff: float = FLOAT32_ROUNDOFF,
) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi] per output [B, Hq, N, Dv] of an attention that rounds as MLX's
    `scaled_dot_product_attention` on the CPU does (READ-1), float64.

    With T the keys' format: the scale and q * scale are rounded to T; each score is
    accumulated in float32 (within (D + 2) r sum_d |q_d k_d| of the exact dot product) and
    rounded to T; the softmax runs in float32 and its weights are rounded to T; the output
    is accumulated in float32 and rounded to T. Rounding is monotone, so each stage maps an
    interval to an interval: scores to [T(x - e), T(x + e)]; weight j is smallest with its
    own score low and the others high (and the reverse), widened by the float32 softmax's
    (T + 8) r + 2 r (max - s_j); the output by (T + 2) r sum_j w_j |v_j|. Results below the
    smallest normal float32 may be flushed to zero, so those ends reach 0. Not a bound for
    any attention: one for a backend that declares this rounding (Backend.rounded_attention).
    """
    dtype = keys.dtype
    B, Hq, N, D = queries.shape
    _, Hk, T, _ = keys.shape
    group = Hq // Hk
    if visible.ndim == 4:
        # Rows of their own lengths (ROWS-6): [B, 1, N, T] over the query-head group axis.
        visible = visible[:, :, None]
    q = queries.astype(np.float64).reshape(B, Hk, group, N, D)
    k = np.swapaxes(keys.astype(np.float64), -1, -2)[:, :, None]
    v = values.astype(np.float64)[:, :, None]
    scaled = _in_format(_in_format(np.float64(scale), dtype) * q, dtype)
    dots = scaled @ k
    slack = (D + 2) * roundoff * (np.abs(scaled) @ np.abs(k)) + D * FLOAT32_TINY
    low = np.where(visible, _low_end(dots - slack, dtype), -np.inf)
    high = np.where(visible, _high_end(dots + slack, dtype), -np.inf)
    top = high.max(axis=-1, keepdims=True)
    e_low, e_high = np.exp(low - top), np.exp(high - top)
    sum_low, sum_high = e_low.sum(-1, keepdims=True), e_high.sum(-1, keepdims=True)
    w_low = e_low / (sum_high - e_high + e_low)
    w_high = e_high / (sum_low - e_low + e_high)
    with np.errstate(invalid="ignore"):  # masked keys: inf * 0, replaced just below
        softmax_slack = np.where(visible, (T + 8) * roundoff + 2 * roundoff * (top - low), 0.0)
    w_low = _low_end(w_low * (1 - softmax_slack), dtype)
    w_high = _high_end(np.minimum(w_high * (1 + softmax_slack), 1.0), dtype)
    positive, negative = np.maximum(v, 0.0), np.minimum(v, 0.0)
    accumulation = (T + 2) * (roundoff * (w_high @ np.abs(v)) + FLOAT32_TINY)
    lo = _low_end(w_low @ positive + w_high @ negative - accumulation, dtype)
    hi = _high_end(w_high @ positive + w_low @ negative + accumulation, dtype)
    Dv = values.shape[-1]
    return lo.reshape(B, Hq, N, Dv), hi.reshape(B, Hq, N, Dv)
