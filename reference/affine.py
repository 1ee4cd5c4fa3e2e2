"""The MLX affine group codec (spec AFF-1 .. AFF-8).

The format `mx.quantize(w, group_size, bits)` produces, with the semantics of MLX's
CPU kernel: every `group_size` consecutive values of the last axis share one scale
and one bias; each value stores an unsigned code of `bits` bits; the codes of a row
form one LSB-first bit stream read as little-endian uint32 words.
"""

from __future__ import annotations

import numpy as np

from kvspec.reference import bits as bitstream
from kvspec.reference.deferred import failure_rank
from kvspec.reference.dtypes import FLOAT32, dtype_name, narrow, quiet_nan, widen

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
EPS = np.float32(1e-7)

#: The value checks of AFF-1 and AFF-7 in the order quantize makes them: what a deferred
#: encode records (DEFER-2).
DEFERRED_CHECKS = (
    "input holds NaN or inf, which the format cannot store",
    "a group's range or edge / scale overflows float32",
)


def validate_layout(w: np.ndarray, group_size: int, bits: int) -> None:
    """Reject parameters, dtypes and shapes the format cannot take (AFF-1)."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    dtype_name(w.dtype)
    if w.ndim < 2:
        raise ValueError(f"input must have at least 2 dimensions, got shape {w.shape}")
    if w.shape[-1] % group_size != 0:
        raise ValueError(f"last axis {w.shape[-1]} is not divisible by group_size {group_size}")


def validate(w: np.ndarray, group_size: int, bits: int) -> None:
    """Reject what the format cannot hold, before anything is computed (AFF-1)."""
    validate_layout(w, group_size, bits)
    if not np.all(np.isfinite(widen(w))):
        raise ValueError(DEFERRED_CHECKS[0])


def group_parameters(groups: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 scale and bias of each group (last axis) (AFF-2, AFF-3).

    Raises ValueError for a group whose range or edge-to-scale ratio overflows
    float32 (AFF-7): MLX stores a zero or infinite scale there.
    """
    scale, bias, span, q0 = unchecked_group_parameters(groups, bits)
    if not np.all(np.isfinite(span)):
        raise ValueError("a group's range (max - min) overflows float32")
    if not np.all(np.isfinite(q0)):
        raise ValueError("a group's edge / scale overflows float32 (a constant group beyond ~3e31)")
    return scale, bias


def unchecked_group_parameters(
    groups: np.ndarray, bits: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """AFF-2, AFF-3 without AFF-7's overflow checks: float32 scale and bias of each group,
    and the range and q0 those checks read (non-finite where a group overflows)."""
    n_bins = np.float32(2**bits - 1)
    w_min = groups.min(axis=-1)
    w_max = groups.max(axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is the caller's to judge
        span = w_max - w_min
        negative = np.abs(w_min) > np.abs(w_max)
        scale = np.maximum(span / n_bins, EPS)
        scale = np.where(negative, scale, -scale)
        edge = np.where(negative, w_min, w_max)
        q0 = np.rint(edge / scale)
        edge_on_grid = q0 != 0
        safe_q0 = np.where(edge_on_grid, q0, np.float32(1))
        scale = np.where(edge_on_grid, edge / safe_q0, scale)
    bias = np.where(edge_on_grid, edge, np.float32(0))
    return scale.astype(FLOAT32), bias.astype(FLOAT32), span, q0


def group_codes(groups: np.ndarray, scale: np.ndarray, bias: np.ndarray, bits: int) -> np.ndarray:
    """Codes of each value from its group's float32 scale and bias (AFF-4)."""
    n_bins = np.float32(2**bits - 1)
    shifted = groups - bias[..., None]
    steps = np.rint(shifted / scale[..., None])
    return np.clip(steps, np.float32(0), n_bins).astype(np.uint32)


def quantize(
    w: np.ndarray, group_size: int = 64, bits: int = 4
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(wq, scales, biases) of `w` in the MLX affine format (AFF-1 .. AFF-5).

    wq: uint32 [..., D * bits / 32]; scales, biases: w's dtype [..., D / group_size].
    """
    validate(w, group_size, bits)
    *lead, D = w.shape
    groups = widen(w).reshape(*lead, D // group_size, group_size)
    scale, bias = group_parameters(groups, bits)
    codes = group_codes(groups, scale, bias, bits).reshape(*lead, D)
    wq = bitstream.pack_words(codes, bits)
    return wq, narrow(scale, w.dtype), narrow(bias, w.dtype)


def quantize_deferred(
    w: np.ndarray, group_size: int = 64, bits: int = 4
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(wq, scales, biases, failure): quantize's fields, except that each group AFF-1 or
    AFF-7 would reject (NaN or inf in it, or an overflowing range or edge / scale) is
    stored as codes 0, bias 0 and a quiet NaN scale (DEFER-1); `failure` is the rank of
    the earliest check of DEFERRED_CHECKS that any group failed, 0 if none (DEFER-2).
    Parameters, dtypes and shapes are still rejected at once (AFF-1)."""
    validate_layout(w, group_size, bits)
    *lead, D = w.shape
    groups = widen(w).reshape(*lead, D // group_size, group_size)
    nonfinite = ~np.all(np.isfinite(groups), axis=-1)
    finite_groups = np.where(nonfinite[..., None], np.float32(0), groups)
    _, _, span, q0 = unchecked_group_parameters(finite_groups, bits)
    overflow = ~(np.isfinite(span) & np.isfinite(q0))
    failed = nonfinite | overflow
    # A failed group is encoded as zeros: codes 0 and bias 0 (AFF-7's all-zero group).
    held = np.where(failed[..., None], np.float32(0), groups)
    scale, bias = group_parameters(held, bits)
    codes = group_codes(held, scale, bias, bits).reshape(*lead, D)
    wq = bitstream.pack_words(codes, bits)
    scales = np.where(failed, quiet_nan(w.dtype), narrow(scale, w.dtype))
    biases = narrow(bias, w.dtype)
    failure = failure_rank(DEFERRED_CHECKS, [bool(nonfinite.any()), bool(overflow.any())])
    return wq, scales, biases, failure


def dequantize(
    wq: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    group_size: int = 64,
    bits: int = 4,
) -> np.ndarray:
    """Values of an affine-quantized array, in the scales' dtype (AFF-6).

    Each value is code * scale rounded to the dtype, then + bias rounded to the dtype.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    dtype = scales.dtype
    dtype_name(dtype)
    if biases.dtype != dtype or biases.shape != scales.shape:
        raise ValueError("scales and biases must share one dtype and shape")
    *lead, n_words = wq.shape
    D = n_words * 32 // bits
    if scales.shape != (*lead, D // group_size):
        raise ValueError(
            f"scales shape {scales.shape} does not match {D} values in groups of {group_size}"
        )
    codes = bitstream.unpack_words(wq, bits, D).astype(FLOAT32)
    codes = codes.reshape(*lead, D // group_size, group_size)
    scaled = narrow(codes * widen(scales)[..., None], dtype)
    values = narrow(widen(scaled) + widen(biases)[..., None], dtype)
    return values.reshape(*lead, D)
