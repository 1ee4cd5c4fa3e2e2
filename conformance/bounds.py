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
