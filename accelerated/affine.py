"""The MLX affine group codec on MLX (spec AFF-1 .. AFF-9).

Three encoders store the same bits, one chosen by the device (AFF-9):
- "mlx_cpu": `mx.quantize` on the CPU stream, whose kernel is the one the spec follows
  (the conformance suite holds it to the reference);
- "cuda": one custom kernel (`affine_kernels`) on MLX's CUDA backend, where
  `mx.quantize` starts the group maximum at 0 and rounds half away from zero;
- "ops": MLX element-wise operations that round the same everywhere (exact min/max,
  IEEE float32 subtract and divide, `mx.round`), none a multiply feeding an add, for
  any other device.
`mx.dequantize` reads the result (AFF-6 states its bound on each backend).
"""

from __future__ import annotations

import mlx.core as mx

from kvspec.accelerated import affine_kernels
from kvspec.accelerated import bits as bitstream
from kvspec.accelerated.dtypes import dtype_name, narrow, widen
from kvspec.reference.affine import EPS, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES

__all__ = [
    "ENCODERS",
    "EPS",
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "available_encoders",
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


def validate_layout(w: mx.array, group_size: int, bits: int) -> None:
    """Reject parameters, dtypes and shapes the format cannot take (AFF-1)."""
    _check_parameters(group_size, bits)
    dtype_name(w.dtype)
    if w.ndim < 2:
        raise ValueError(f"input must have at least 2 dimensions, got shape {tuple(w.shape)}")
    if w.shape[-1] % group_size != 0:
        raise ValueError(f"last axis {w.shape[-1]} is not divisible by group_size {group_size}")


def _reject_nonfinite(w: mx.array) -> float:
    """The largest magnitude in `w`, after rejecting NaN and inf (one host sync)."""
    finite, largest = mx.all(mx.isfinite(w)), mx.max(mx.abs(w))
    mx.eval(finite, largest)
    if not finite.item():
        raise ValueError(NONFINITE_MESSAGE)
    return largest.item()


def validate(w: mx.array, group_size: int, bits: int) -> None:
    """Reject what the format cannot hold, before anything is computed (AFF-1)."""
    validate_layout(w, group_size, bits)
    _reject_nonfinite(w)


NONFINITE_MESSAGE = "input holds NaN or inf, which the format cannot store"
OVERFLOW_MESSAGE = "a group's range or edge / scale overflows float32"
# Below this magnitude no group can overflow (AFF-7 needs |edge| > 3.4e38 * eps).
OVERFLOW_FREE = 2.0**100


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
        raise ValueError(OVERFLOW_MESSAGE)
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


def _quantize_ops(w: mx.array, group_size: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    _reject_nonfinite(w)
    *lead, D = w.shape
    groups = widen(w).reshape(*lead, D // group_size, group_size)
    scale, bias = group_parameters(groups, bits)
    codes = group_codes(groups, scale, bias, bits).reshape(*lead, D)
    wq = bitstream.pack_words(codes, bits)
    return wq, narrow(scale, w.dtype), narrow(bias, w.dtype)


def _quantize_mlx_cpu(
    w: mx.array, group_size: int, bits: int
) -> tuple[mx.array, mx.array, mx.array]:
    if _reject_nonfinite(w) >= OVERFLOW_FREE:
        # MLX's CPU kernel stores an infinite or zero scale where AFF-7 rejects a group.
        groups = widen(w).reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
        group_parameters(groups, bits)
    return mx.quantize(w, group_size=group_size, bits=bits, stream=mx.cpu)


def _quantize_cuda(w: mx.array, group_size: int, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    wq, scales, biases, status = affine_kernels.quantize_groups(w, group_size, bits)
    worst = mx.max(status).item()
    if worst == affine_kernels.NONFINITE:
        raise ValueError(NONFINITE_MESSAGE)
    if worst == affine_kernels.OVERFLOW:
        raise ValueError(OVERFLOW_MESSAGE)
    return wq, scales, biases


#: The encoders, by name; each stores the bits of kvspec.reference.affine.quantize.
ENCODERS = {"mlx_cpu": _quantize_mlx_cpu, "cuda": _quantize_cuda, "ops": _quantize_ops}


def available_encoders() -> list[str]:
    """The encoders that can run here: "ops" and "mlx_cpu" always, "cuda" with a CUDA GPU."""
    return ["mlx_cpu", "ops"] + (["cuda"] if mx.cuda.is_available() else [])


def _default_encoder() -> str:
    device = mx.default_device()
    if device.type == mx.DeviceType.cpu:
        return "mlx_cpu"
    return "cuda" if mx.cuda.is_available() else "ops"


def quantize(
    w: mx.array, group_size: int = 64, bits: int = 4, encoder: str | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """(wq, scales, biases) of `w` in the MLX affine format (AFF-1 .. AFF-5).

    `encoder` names one of ENCODERS; by default the one for MLX's default device.
    """
    validate_layout(w, group_size, bits)
    name = encoder or _default_encoder()
    if name not in ENCODERS:
        raise ValueError(f"encoder must be one of {sorted(ENCODERS)}, got {name!r}")
    if w.size == 0:  # no rows: nothing to reduce, launch or check
        *lead, D = w.shape
        groups = (*lead, D // group_size)
        return (
            mx.zeros((*lead, D * bits // 32), mx.uint32),
            mx.zeros(groups, w.dtype),
            mx.zeros(groups, w.dtype),
        )
    return ENCODERS[name](w, group_size, bits)


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
            f"scales shape {tuple(scales.shape)} does not match "
            f"{D} values in groups of {group_size}"
        )
    if wq.size == 0:
        # mx.dequantize cannot reshape an empty array (a cache trimmed to offset 0).
        return mx.zeros((*lead, D), scales.dtype)
    return mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
