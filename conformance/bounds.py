"""Read-error bounds the spec derives, as functions of stored fields (AFF-8)."""

from __future__ import annotations

import numpy as np

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


# float32 unit roundoff: accumulations inside the backend's attention are float32 (READ-1).
FLOAT32_ROUNDOFF = 2.0**-24


def attention_bound(
    queries: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float
) -> np.ndarray:
    """Per-output bound on |backend attention - reference attention| (READ-1), float64,
    broadcastable to [B, Hq, N, Dv].

    With u the unit roundoff of the keys' dtype, D the head_dim and T the keys:
    each score may be off by e = scale * max_j sum_d |q_d k_jd| * (2u + (D + 2) 2^-24)
    (q * scale rounded, the dot product accumulated in float32 and rounded); the
    softmax weights then move by at most expm1(2e) in l1, the weights and the output are
    rounded once each and the output accumulated in float32:
    bound = max_j |v_j| * (expm1(2e) + 4u + (T + 2) 2^-24).
    """
    u = unit_roundoff(keys.dtype)
    B, Hq, N, D = queries.shape
    _, Hk, T, _ = keys.shape
    group = Hq // Hk
    q = np.abs(queries.astype(np.float64)).reshape(B, Hk, group, N, D)
    k = np.abs(keys.astype(np.float64))[:, :, None]
    magnitude = (q @ np.swapaxes(k, -1, -2)).max(axis=-1)
    score_error = scale * magnitude * (2 * u + (D + 2) * FLOAT32_ROUNDOFF)
    largest_value = np.abs(values.astype(np.float64)).max(axis=(-2, -1))[:, :, None, None]
    bound = largest_value * (np.expm1(2 * score_error) + 4 * u + (T + 2) * FLOAT32_ROUNDOFF)
    return bound.reshape(B, Hq, N, 1)
