"""The MLX affine group codec on MLX ops (spec AFF-1 .. AFF-8).

`mx.quantize` is not used to encode: its GPU kernels start the group maximum at 0
and round half away from zero, so they store other bits than its CPU kernel (spec
AFF-9). This encoder is built from MLX ops that round the same everywhere: exact
min/max, IEEE float32 subtract and divide, `mx.round` (half to even). No step is a
multiply feeding an add, so no backend can contract one into an FMA.
`mx.dequantize` reads the result (AFF-6 states its bound on each backend).
"""

from __future__ import annotations

import mlx.core as mx

from kvspec.accelerated import bits as bitstream
from kvspec.accelerated.dtypes import dtype_name, narrow, widen
from kvspec.reference.affine import EPS, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

__all__ = [
    "EPS",
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "dequantize",
    "group_codes",
    "group_parameters",
    "quantize",
    "validate",
]


def _check_parameters(group_size: int, bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")


def validate(w: mx.array, group_size: int, bits: int) -> None:
    """Reject what the format cannot hold, before anything is computed (AFF-1)."""
    _check_parameters(group_size, bits)
    dtype_name(w.dtype)
    if w.ndim < 2:
        raise ValueError(f"input must have at least 2 dimensions, got shape {tuple(w.shape)}")
    if w.shape[-1] % group_size != 0:
        raise ValueError(f"last axis {w.shape[-1]} is not divisible by group_size {group_size}")
    if not mx.all(mx.isfinite(w)).item():
        raise ValueError("input holds NaN or inf, which the format cannot store")


def group_parameters(groups: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """float32 scale and bias of each group (last axis) (AFF-2, AFF-3, AFF-7)."""
    n_bins = float(2**bits - 1)
    w_min = mx.min(groups, axis=-1)
    w_max = mx.max(groups, axis=-1)
    span = w_max - w_min
    negative = mx.abs(w_min) > mx.abs(w_max)
    scale = mx.maximum(span / n_bins, EPS.item())
    scale = mx.where(negative, scale, -scale)
    edge = mx.where(negative, w_min, w_max)
    q0 = mx.round(edge / scale)
    if not mx.all(mx.isfinite(span) & mx.isfinite(q0)).item():
        raise ValueError("a group's range or edge / scale overflows float32")
    edge_on_grid = q0 != 0
    safe_q0 = mx.where(edge_on_grid, q0, 1.0)
    scale = mx.where(edge_on_grid, edge / safe_q0, scale)
    bias = mx.where(edge_on_grid, edge, 0.0)
    return scale, bias


def group_codes(groups: mx.array, scale: mx.array, bias: mx.array, bits: int) -> mx.array:
    """Codes of each value from its group's float32 scale and bias (AFF-4)."""
    n_bins = float(2**bits - 1)
    steps = mx.round((groups - bias[..., None]) / scale[..., None])
    return mx.clip(steps, 0.0, n_bins).astype(mx.uint32)


def quantize(
    w: mx.array, group_size: int = 64, bits: int = 4
) -> tuple[mx.array, mx.array, mx.array]:
    """(wq, scales, biases) of `w` in the MLX affine format (AFF-1 .. AFF-5)."""
    validate(w, group_size, bits)
    *lead, D = w.shape
    groups = widen(w).reshape(*lead, D // group_size, group_size)
    scale, bias = group_parameters(groups, bits)
    codes = group_codes(groups, scale, bias, bits).reshape(*lead, D)
    wq = bitstream.pack_words(codes, bits)
    return wq, narrow(scale, w.dtype), narrow(bias, w.dtype)


def dequantize(
    wq: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int = 64,
    bits: int = 4,
) -> mx.array:
    """Values of an affine-quantized array, in the scales' dtype (AFF-6)."""
    _check_parameters(group_size, bits)
    dtype_name(scales.dtype)
    if biases.dtype != scales.dtype or biases.shape != scales.shape:
        raise ValueError("scales and biases must share one dtype and shape")
    *lead, n_words = wq.shape
    D = n_words * 32 // bits
    if tuple(scales.shape) != (*lead, D // group_size):
        raise ValueError(
            f"scales shape {tuple(scales.shape)} does not match {D} values "
            f"in groups of {group_size}"
        )
    return mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
