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

from functools import cache

import mlx.core as mx

from kvspec.accelerated import affine_kernels
from kvspec.accelerated import bits as bitstream
from kvspec.accelerated.device import cuda_available
from kvspec.accelerated.dtypes import dtype_name, narrow, quiet_nan, widen
from kvspec.accelerated.records import RecordLayout, record_layout
from kvspec.reference.affine import (
    DEFERRED_CHECKS,
    EPS,
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
)

__all__ = [
    "DEFERRED_CHECKS",
    "ENCODERS",
    "EPS",
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "available_encoders",
    "dequantize",
    "group_codes",
    "group_parameters",
    "quantize",
    "quantize_deferred",
    "unchecked_group_parameters",
    "validate",
    "validate_layout",
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


NONFINITE_MESSAGE = DEFERRED_CHECKS[0]
OVERFLOW_MESSAGE = DEFERRED_CHECKS[1]
# Below this magnitude no group can overflow (AFF-7 needs |edge| > 3.4e38 * eps).
OVERFLOW_FREE = 2.0**100


def group_parameters(groups: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """float32 scale and bias of each group (last axis) (AFF-2, AFF-3, AFF-7)."""
    scale, bias, span, q0 = unchecked_group_parameters(groups, bits)
    if not mx.all(mx.isfinite(span) & mx.isfinite(q0)).item():
        raise ValueError(OVERFLOW_MESSAGE)
    return scale, bias


def unchecked_group_parameters(
    groups: mx.array, bits: int
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """AFF-2, AFF-3 without AFF-7's overflow checks: scale, bias, and the range and q0
    those checks read."""
    n_bins = float(2**bits - 1)
    w_min = mx.min(groups, axis=-1)
    w_max = mx.max(groups, axis=-1)
    span = w_max - w_min
    negative = mx.abs(w_min) > mx.abs(w_max)
    scale = mx.maximum(span / n_bins, EPS.item())
    scale = mx.where(negative, scale, -scale)
    edge = mx.where(negative, w_min, w_max)
    q0 = mx.round(edge / scale)
    edge_on_grid = q0 != 0
    safe_q0 = mx.where(edge_on_grid, q0, 1.0)
    scale = mx.where(edge_on_grid, edge / safe_q0, scale)
    bias = mx.where(edge_on_grid, edge, 0.0)
    return scale, bias, span, q0


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
    wq, scales, biases, failure = affine_kernels.quantize_groups(w, group_size, bits)
    rank = failure.item()
    if rank:
        raise ValueError(DEFERRED_CHECKS[len(DEFERRED_CHECKS) - rank])
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
    return "cuda" if cuda_available() else "ops"


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


def _quantize_deferred_ops(
    w: mx.array, group_size: int, bits: int
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    *lead, D = w.shape
    groups = widen(w).reshape(*lead, D // group_size, group_size)
    nonfinite = ~mx.all(mx.isfinite(groups), axis=-1)
    finite_groups = mx.where(nonfinite[..., None], 0.0, groups)
    _, _, span, q0 = unchecked_group_parameters(finite_groups, bits)
    overflow = ~(mx.isfinite(span) & mx.isfinite(q0))
    failed = nonfinite | overflow
    held = mx.where(failed[..., None], 0.0, groups)
    scale, bias, _, _ = unchecked_group_parameters(held, bits)
    codes = group_codes(held, scale, bias, bits).reshape(*lead, D)
    scales = mx.where(failed, quiet_nan(w.dtype), narrow(scale, w.dtype))
    failure = mx.where(mx.any(nonfinite), 2, mx.where(mx.any(overflow), 1, 0))
    return bitstream.pack_words(codes, bits), scales, narrow(bias, w.dtype), failure


def quantize_deferred(
    w: mx.array, group_size: int = 64, bits: int = 4, prior: mx.array | None = None
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(wq, scales, biases, failure) with no host read: groups AFF-1 or AFF-7 would reject
    stored as codes 0, bias 0 and a quiet NaN scale (DEFER-1), and a lazy uint32 [1] failure
    rank (DEFER-2), the larger of this encode's and `prior` (a cache's running rank,
    DEFER-3). On CUDA one kernel; elsewhere MLX operations, the same bits."""
    validate_layout(w, group_size, bits)
    if w.size == 0:
        failure = affine_kernels.no_failure() if prior is None else prior
        return (*quantize(w, group_size, bits), failure)
    if _default_encoder() == "cuda":
        return affine_kernels.quantize_groups(w, group_size, bits, prior)
    wq, scales, biases, failure = _quantize_deferred_ops(w, group_size, bits)
    failure = failure.astype(mx.uint32).reshape(1)
    if prior is not None:
        failure = mx.maximum(prior, failure)
    # Evaluating what is stored evaluates the rank (DEFER-3; the kernel's fields and rank
    # come from one launch, these from separate ops).
    return mx.depends(wq, failure), scales, biases, failure


def quantize_deferred_pair(
    k: mx.array,
    v: mx.array,
    group_size: int = 64,
    bits: int = 4,
    prior: mx.array | None = None,
) -> tuple[mx.array, ...]:
    """`quantize_deferred` of keys, then of values with the keys' failure as prior: k's
    (wq, scales, biases), v's, and the failure of both. On CUDA, keys and values of one
    shape and dtype are one kernel launch (a decode step's encode is one op)."""
    validate_layout(k, group_size, bits)
    validate_layout(v, group_size, bits)
    same = k.shape == v.shape and k.dtype == v.dtype
    if same and k.size > 0 and _default_encoder() == "cuda":
        return affine_kernels.quantize_pair_groups(k, v, group_size, bits, prior)
    *keys, failure = quantize_deferred(k, group_size, bits, prior)
    *values, failure = quantize_deferred(v, group_size, bits, failure)
    return (*keys, *values, failure)


@cache
def stored_layout(group_size: int, bits: int, head_dim: int, dtype: mx.Dtype) -> RecordLayout:
    """The record of one position's six affine fields of keys and values (QKV-1) of
    `head_dim` and input `dtype`, its offsets in slot order (accelerated/records.py): what
    the CUDA pair encoder writes and the MLX cache stores."""
    groups = head_dim // group_size
    side = [(mx.uint32, head_dim * bits // 32), (dtype, groups), (dtype, groups)]
    return record_layout(side * 2)


def record_encoder_takes(k: mx.array, v: mx.array) -> bool:
    """Whether `record_encoder` takes keys and values: the CUDA encoder, keys and
    values of one shape and dtype, not empty."""
    same = k.shape == v.shape and k.dtype == v.dtype
    return same and k.size > 0 and _default_encoder() == "cuda"


def record_encoder(k: mx.array, group_size: int, bits: int) -> affine_kernels.EncodeLaunch:
    """`quantize_deferred_pair` of keys and values shaped as `k` where `record_encoder_takes`
    them, as one launch made once per shape: called with (k, v, prior=), it gives the six
    fields as one record uint8 [B, H, L, row_bytes] of `stored_layout`, and the failure.
    It checks nothing: its caller has checked the input as `validate_layout` does and asked
    `record_encoder_takes` (the cache: its layout checks, CACHE-2, and head dims, QKV-1),
    once per shape of append, not at every layer and step."""
    layout = stored_layout(group_size, bits, k.shape[-1], k.dtype)
    return affine_kernels.record_launch(tuple(k.shape), k.dtype, group_size, bits, layout)


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
    if wq.size == 0:  # no rows: mx.dequantize cannot reshape an empty array
        return mx.zeros((*lead, D), scales.dtype)
    return mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)
