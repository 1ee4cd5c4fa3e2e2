"""The TurboQuant codec on MLX ops (spec TQ-1 .. TQ-11, TQ-14); stores the reference's bits.

Every float step is one IEEE float32 operation that rounds the same on every MLX
backend: min/max, add, subtract, multiply, divide, sqrt, `mx.round` (half to even).
No step is a multiply feeding an add inside one kernel, and nothing is compiled
with `mx.compile`, so no backend can contract a pair into an FMA. The Hadamard
transform is `mx.hadamard_transform` in float32, whose butterfly order is the
spec's (TQ-6); the conformance suite checks it bit for bit. Codebook indices come
from a binary search over the sorted boundaries, which counts exactly the
boundaries strictly below u without materialising a [.., D, 2^bits] comparison.

On a CUDA device `decode` runs one fused kernel (turboquant_kernels.py) that
unpacks and decodes keys and values with the same float32 operations.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from kvspec.accelerated import bits as bitstream
from kvspec.accelerated.affine_kernels import EncodeLaunch, no_failure
from kvspec.accelerated.device import fused_kernels_enabled
from kvspec.accelerated.dtypes import FLOAT16, FLOAT32, dtype_name, narrow, quiet_nan, widen
from kvspec.accelerated.records import RecordLayout, record_layout, unpacked
from kvspec.accelerated.turboquant_kernels import encode_launch, fused_decode
from kvspec.reference import turboquant as reference
from kvspec.reference.turboquant import (
    BLOCK_SIZE,
    DEFERRED_CHECKS,
    EPS,
    HEAD_DIMS,
    KEY_BITS,
    SIGNED_KEY_BITS,
    SIGNED_KEY_LIMIT,
    TREE_WIDTHS,
    VALUE_BITS,
    check_key_bits,
    check_value_bits,
    codebook_id,
    packed_dim,
    validate_head_dim,
)

__all__ = [
    "BLOCK_SIZE",
    "DEFERRED_CHECKS",
    "EPS",
    "HEAD_DIMS",
    "KEY_BITS",
    "VALUE_BITS",
    "TurboQuantTensor",
    "boundaries",
    "centroids",
    "codebook_id",
    "decode",
    "decode_keys",
    "decode_plain",
    "decode_values",
    "decode_values_rotated",
    "encode",
    "encode_deferred",
    "encode_keys",
    "encode_values",
    "group_rms",
    "hadamard",
    "inv_sqrt",
    "key_codes",
    "pack_bits",
    "packed_dim",
    "rotate",
    "signs",
    "stored_bits",
    "unpack_bits",
    "unrotate",
    "validate",
    "validate_head_dim",
    "value_codes",
]


# TQ-1, TQ-2 Constants, from the reference's frozen tables


@cache
def signs(head_dim: int) -> mx.array:
    """The +-1 float32 sign vector of a head_dim (TQ-1)."""
    return mx.array(reference.signs(head_dim))


def inv_sqrt(head_dim: int) -> float:
    """f32(1 / sqrt(head_dim)) as a Python float (exact) (TQ-1)."""
    return float(reference.inv_sqrt(head_dim))


@cache
def centroids(bits: int) -> mx.array:
    """The 2^bits float32 centroids, ascending (TQ-2)."""
    return mx.array(reference.centroids(bits))


@cache
def boundaries(bits: int) -> mx.array:
    """The 2^bits - 1 float32 boundaries (c[i] + c[i+1]) * 0.5 (TQ-2)."""
    return mx.array(reference.boundaries(bits))


# TQ-3 Validation


#: A lazy all-true flag and the message of the ValueError it raises when false.
Check = tuple[mx.array, str]


def _check_layout(x: mx.array, what: str) -> None:
    dtype_name(x.dtype)
    if x.ndim < 1:
        raise ValueError(f"{what} must have a head_dim axis, got shape {tuple(x.shape)}")
    validate_head_dim(x.shape[-1])


def _finite(x: mx.array, what: str) -> Check:
    return mx.all(mx.isfinite(x)), f"{what} hold NaN or inf, which the format cannot store"


def _float16_field(x32: mx.array, field: str) -> tuple[mx.array, Check]:
    stored = narrow(x32, FLOAT16)
    message = f"a {field} is beyond the float16 range; the format cannot store it"
    return stored, (mx.all(mx.isfinite(stored)), message)


def _raise_first(checks: list[Check]) -> None:
    """Evaluate every check in one host sync, then raise the first that fails (TQ-3)."""
    mx.eval([passed for passed, _ in checks])
    for passed, message in checks:
        if not passed.item():
            raise ValueError(message)


def validate(x: mx.array, what: str) -> None:
    """Reject input the format cannot hold, before anything is computed (TQ-3)."""
    _check_layout(x, what)
    _raise_first([_finite(x, what)])


def _grouped(x: mx.array) -> mx.array:
    *lead, D = x.shape
    return x.reshape(*lead, D // BLOCK_SIZE, BLOCK_SIZE)


def _check_group_fields(head_dim: int, *fields: mx.array) -> None:
    for field in fields:
        if field.dtype != FLOAT16 or field.shape[-1] * BLOCK_SIZE != head_dim:
            raise ValueError(
                f"expected float16 group fields of {head_dim // BLOCK_SIZE} per vector, "
                f"got {field.dtype} {tuple(field.shape)}"
            )


# TQ-4, TQ-5 Keys


def key_codes(x: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """TQ-4 without TQ-3's checks: float32 codes (clipped), scale and zero point of each
    32-group of finite keys x [..., D / 32, 32]."""
    signed = bits == SIGNED_KEY_BITS
    levels = float(2 * SIGNED_KEY_LIMIT if signed else 2**bits - 1)
    top = mx.max(x, axis=-1)
    bottom = mx.min(x, axis=-1)
    span = top - bottom
    scale = span / levels
    step = scale + EPS.item()
    if signed:
        zero = mx.round((top + bottom) / (step * 2.0)) + 0.0
    else:
        zero = mx.round(bottom / step) + 0.0
    constant = span == 0
    sign = mx.where(top > 0, 1.0, mx.where(top < 0, -1.0, 0.0))
    scale = mx.where(constant, mx.abs(top), scale)
    zero = mx.where(constant, 0.0 if signed else mx.minimum(sign, 0.0), zero)
    codes = mx.round(x / step[..., None] - zero[..., None])
    codes = mx.where(constant[..., None], (sign - zero)[..., None], codes)
    low = -SIGNED_KEY_LIMIT if signed else 0.0
    high = SIGNED_KEY_LIMIT if signed else levels
    return mx.clip(codes, low, high), scale, zero


def _key_indices(codes: mx.array, bits: int) -> mx.array:
    *lead, groups, size = codes.shape
    stored_dtype = mx.int8 if bits == SIGNED_KEY_BITS else mx.uint8
    return codes.astype(stored_dtype).reshape(*lead, groups * size)


def _key_fields(k: mx.array, bits: int) -> tuple[tuple[mx.array, ...], list[Check]]:
    """encode_keys' fields and its float16 checks, not yet evaluated (TQ-4)."""
    codes, scale, zero = key_codes(_grouped(widen(k)), bits)
    scales, scales_fit = _float16_field(scale, "key scale")
    zeros, zeros_fit = _float16_field(zero, "key zero point")
    return (_key_indices(codes, bits), scales, zeros), [scales_fit, zeros_fit]


def encode_keys(k: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """(indices, scales, zeros) of keys [..., D] (TQ-4)."""
    check_key_bits(bits)
    _check_layout(k, "keys")
    fields, checks = _key_fields(k, bits)
    _raise_first([_finite(k, "keys"), *checks])
    indices, scales, zeros = fields
    return indices, scales, zeros


def decode_keys(indices: mx.array, scales: mx.array, zeros: mx.array) -> mx.array:
    """float32 keys (index + zero) * scale (TQ-5)."""
    *lead, D = indices.shape
    _check_group_fields(D, scales, zeros)
    offset = _grouped(indices.astype(FLOAT32)) + widen(zeros)[..., None]
    return (offset * widen(scales)[..., None]).reshape(*lead, D)


# TQ-6 Rotation


def hadamard(x32: mx.array) -> mx.array:
    """Orthonormal Walsh-Hadamard transform of the last axis, float32 (TQ-6)."""
    D = x32.shape[-1]
    validate_head_dim(D)
    if x32.size == 0:  # mx.hadamard_transform rejects empty arrays
        return x32.astype(FLOAT32)
    return mx.hadamard_transform(x32.astype(FLOAT32), scale=inv_sqrt(D))


def rotate(x: mx.array) -> mx.array:
    """Signs, then the Hadamard transform (TQ-6)."""
    return hadamard(widen(x) * signs(x.shape[-1]))


def unrotate(y: mx.array) -> mx.array:
    """Inverse of rotate: the Hadamard transform, then the signs (TQ-6, TQ-8)."""
    return hadamard(widen(y)) * signs(y.shape[-1])


# TQ-7, TQ-8 Values


def group_rms(y: mx.array) -> mx.array:
    """Root mean square of each 32-group of the last axis, by the halving tree (TQ-7)."""
    grouped = _grouped(y)
    partial = grouped * grouped
    for w in TREE_WIDTHS:
        partial = partial[..., :w] + partial[..., w : 2 * w]
    return mx.sqrt(partial[..., 0] / float(BLOCK_SIZE))


def _count_below(u: mx.array, bits: int) -> mx.array:
    """Number of boundaries strictly below u, by binary search over the sorted table."""
    table = boundaries(bits)
    count = mx.zeros(u.shape, mx.uint32)
    stride = 2 ** (bits - 1)
    while stride >= 1:
        candidate = count + stride
        below = mx.take(table, candidate - 1) < u
        count = mx.where(below, candidate, count)
        stride //= 2
    return count.astype(mx.uint8)


def value_codes(v: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """TQ-7 without TQ-3's checks: uint8 indices [..., D] and the float32 group rms."""
    y = rotate(v)
    rms = group_rms(y)
    u = _grouped(y) / (rms + EPS.item())[..., None]
    return _count_below(u, bits).reshape(v.shape), rms


def _value_fields(v: mx.array, bits: int) -> tuple[tuple[mx.array, ...], list[Check]]:
    """encode_values' fields and its float16 check, not yet evaluated (TQ-7)."""
    indices, rms = value_codes(v, bits)
    scales, scales_fit = _float16_field(rms, "value scale (group rms)")
    return (indices, scales), [scales_fit]


def encode_values(v: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """(indices, scales) of values [..., D] (TQ-7)."""
    check_value_bits(bits)
    _check_layout(v, "values")
    fields, checks = _value_fields(v, bits)
    _raise_first([_finite(v, "values"), *checks])
    indices, scales = fields
    return indices, scales


def _centroid_values(indices: mx.array, scales: mx.array, bits: int) -> mx.array:
    """centroid[index] * scale for indices known to be below 2^bits (TQ-8)."""
    *lead, D = indices.shape
    coded = _grouped(mx.take(centroids(bits), indices.astype(mx.uint32)))
    return (coded * widen(scales)[..., None]).reshape(*lead, D)


def decode_values_rotated(indices: mx.array, scales: mx.array, bits: int) -> mx.array:
    """float32 values left in the rotated domain: centroid[index] * scale (TQ-8)."""
    _check_group_fields(indices.shape[-1], scales)
    levels = centroids(bits)
    if mx.any(indices.astype(mx.uint32) >= levels.size).item():
        raise ValueError(f"a value index is beyond the {levels.size} centroids")
    return _centroid_values(indices, scales, bits)


def decode_values(indices: mx.array, scales: mx.array, bits: int) -> mx.array:
    """float32 values: decode_values_rotated, then unrotate (TQ-8)."""
    return unrotate(decode_values_rotated(indices, scales, bits))


# TQ-9 Packing


def pack_bits(indices: mx.array, bits: int) -> mx.array:
    """Each vector's codes as one LSB-first byte stream; 8-bit codes unchanged (TQ-9)."""
    packed_dim(indices.shape[-1], bits)
    if bits == 8:
        return indices
    return bitstream.pack_bytes(indices, bits)


def unpack_bits(packed: mx.array, bits: int, dim: int) -> mx.array:
    """Inverse of pack_bits: `dim` uint8 codes per vector (TQ-9)."""
    packed_dim(dim, bits)
    if bits == 8:
        if packed.shape[-1] != dim:
            raise ValueError(f"expected {dim} 8-bit codes per vector, got {packed.shape[-1]}")
        return packed
    return bitstream.unpack_bytes(packed, bits, dim)


# TQ-10 Stored tensor


@dataclass
class TurboQuantTensor:
    """The five stored arrays [B, H, L, *], in persistence slot order (TQ-10)."""

    k_idx: mx.array
    k_scales: mx.array
    k_zeros: mx.array
    v_packed: mx.array
    v_scales: mx.array


def _check_encode_layout(k: mx.array, v: mx.array, k_bits: int, v_bits: int) -> None:
    check_key_bits(k_bits)
    check_value_bits(v_bits)
    if k.ndim != 4 or tuple(k.shape) != tuple(v.shape):
        raise ValueError(
            f"keys and values must share one [B, H, L, D] shape, got {tuple(k.shape)} "
            f"and {tuple(v.shape)}"
        )
    _check_layout(k, "keys")
    _check_layout(v, "values")


@cache
def stored_layout(k_bits: int, v_bits: int, head_dim: int) -> RecordLayout:
    """The record of one position's five stored fields (TQ-10), its offsets in slot order
    (accelerated/records.py): what the CUDA encoder writes and the MLX cache stores."""
    groups = head_dim // BLOCK_SIZE
    return record_layout(
        [
            (mx.int8 if k_bits == 8 else mx.uint8, head_dim * k_bits // 8),
            (mx.float16, groups),
            (mx.float16, groups),
            (mx.uint8, head_dim * v_bits // 8),
            (mx.float16, groups),
        ]
    )


def encode_record_deferred(
    k: mx.array, v: mx.array, k_bits: int, v_bits: int, prior: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """`encode_deferred` on CUDA (fused_kernels_enabled): the five fields as one record
    uint8 [B, H, L, row_bytes] of `stored_layout`, and the failure rank, from one launch;
    no positions (L = 0) launch nothing: an empty record, and the prior rank kept."""
    if k.size == 0:
        _check_encode_layout(k, v, k_bits, v_bits)
        layout = stored_layout(k_bits, v_bits, k.shape[-1])
        record = mx.zeros((*k.shape[:-1], layout.row_bytes), mx.uint8)
        return record, no_failure() if prior is None else prior
    record, failure = record_encoder(k, v, k_bits, v_bits)(k, v, prior=prior)
    return record, failure


def record_encoder(k: mx.array, v: mx.array, k_bits: int, v_bits: int) -> EncodeLaunch:
    """`encode_record_deferred` of keys and values shaped as `k`, `v`, checked once: one
    launch made once per shape, which takes (k, v, prior=) of those shapes and dtype
    unchecked, so that a decode step's appends check their layout once, not at every layer
    and step."""
    _check_encode_layout(k, v, k_bits, v_bits)
    return _record_launch(k, k_bits, v_bits)


def _record_launch(k: mx.array, k_bits: int, v_bits: int) -> EncodeLaunch:
    layout = stored_layout(k_bits, v_bits, k.shape[-1])
    return encode_launch(tuple(k.shape), k.dtype, k_bits, v_bits, layout)


def _fused_encode(
    k: mx.array, v: mx.array, k_bits: int, v_bits: int, prior: mx.array | None
) -> tuple[TurboQuantTensor, mx.array]:
    """The tensor and lazy uint32 [1] failure rank from the fused CUDA kernel (DEFER-1,
    DEFER-2), folded with `prior`: the fields are views of the record it writes."""
    record, failure = _record_launch(k, k_bits, v_bits)(k, v, prior=prior)
    fields = unpacked(record, stored_layout(k_bits, v_bits, k.shape[-1]))
    return TurboQuantTensor(*fields), failure


def encode(k: mx.array, v: mx.array, k_bits: int, v_bits: int) -> TurboQuantTensor:
    """Encode keys and values [B, H, L, D] into one TurboQuantTensor (TQ-10); TQ-3's checks
    in one host read (on CUDA, one fused kernel computes fields and checks)."""
    _check_encode_layout(k, v, k_bits, v_bits)
    if fused_kernels_enabled() and k.size > 0:
        tensor, failure = _fused_encode(k, v, k_bits, v_bits, None)
        rank = failure.item()
        if rank:
            raise ValueError(DEFERRED_CHECKS[len(DEFERRED_CHECKS) - rank])
        return tensor
    (k_indices, k_scales, k_zeros), key_checks = _key_fields(k, k_bits)
    (v_indices, v_scales), value_checks = _value_fields(v, v_bits)
    # One host sync for all of TQ-3, in the reference's order of checks.
    _raise_first([_finite(k, "keys"), _finite(v, "values"), *key_checks, *value_checks])
    return TurboQuantTensor(
        k_idx=pack_bits(k_indices, k_bits),
        k_scales=k_scales,
        k_zeros=k_zeros,
        v_packed=pack_bits(v_indices, v_bits),
        v_scales=v_scales,
    )


def encode_deferred(
    k: mx.array, v: mx.array, k_bits: int, v_bits: int, prior: mx.array | None = None
) -> tuple[TurboQuantTensor, mx.array]:
    """(tensor, failure) with no host read: groups TQ-3 would reject stored as DEFER-1
    says, and a lazy uint32 [1] failure rank (DEFER-2), the larger of this encode's and
    `prior` (a cache's running rank, DEFER-3). On CUDA one fused kernel; elsewhere MLX
    operations, the same bits."""
    _check_encode_layout(k, v, k_bits, v_bits)
    if fused_kernels_enabled() and k.size > 0:
        return _fused_encode(k, v, k_bits, v_bits, prior)
    x = _grouped(widen(k))
    key_nonfinite = ~mx.all(mx.isfinite(x), axis=-1)
    codes, scale, zero = key_codes(mx.where(key_nonfinite[..., None], 0.0, x), k_bits)
    scales = narrow(scale, FLOAT16)
    zeros = narrow(zero, FLOAT16)
    scale_beyond = ~mx.isfinite(scales)
    zero_beyond = ~mx.isfinite(zeros)
    key_failed = key_nonfinite | scale_beyond | zero_beyond
    codes = mx.where(key_failed[..., None], 0.0, codes)
    nan16 = quiet_nan(FLOAT16)
    value_nonfinite = ~mx.all(mx.isfinite(v))
    indices, rms = value_codes(v, v_bits)
    v_scales = narrow(rms, FLOAT16)
    value_failed = ~mx.isfinite(v_scales)
    indices = mx.where(value_failed[..., None], 0, _grouped(indices)).astype(mx.uint8)
    failed = [mx.any(key_nonfinite), value_nonfinite, mx.any(scale_beyond)]
    failed += [mx.any(zero_beyond), mx.any(value_failed)]
    failure = no_failure() if prior is None else prior
    for i, failed_here in reversed(list(enumerate(failed))):
        failure = mx.where(failed_here, mx.maximum(failure, len(DEFERRED_CHECKS) - i), failure)
    failure = failure.astype(mx.uint32)
    k_idx = pack_bits(_key_indices(codes, k_bits).reshape(k.shape), k_bits)
    tensor = TurboQuantTensor(
        # Evaluating what is stored evaluates the rank (DEFER-3; the kernel's fields and
        # rank come from one launch, these from separate ops).
        k_idx=mx.depends(k_idx, failure),
        k_scales=mx.where(key_failed, nan16, scales),
        k_zeros=mx.where(key_failed, mx.array(0, FLOAT16), zeros),
        v_packed=pack_bits(indices.reshape(v.shape), v_bits),
        v_scales=mx.where(value_failed, nan16, v_scales),
    )
    return tensor, failure


def stored_bits(t: TurboQuantTensor, head_dim: int) -> tuple[int, int]:
    """(k_bits, v_bits) of a tensor, from its code widths and dtypes (TQ-10)."""
    validate_head_dim(head_dim)
    k_bits = t.k_idx.shape[-1] * 8 // head_dim
    v_bits = t.v_packed.shape[-1] * 8 // head_dim
    k_dtype = mx.int8 if k_bits == SIGNED_KEY_BITS else mx.uint8
    if (
        k_bits not in KEY_BITS
        or t.k_idx.dtype != k_dtype
        or packed_dim(head_dim, k_bits) != t.k_idx.shape[-1]
    ):
        raise ValueError(
            f"k_idx {t.k_idx.dtype} {tuple(t.k_idx.shape)} is no key code width of "
            f"head_dim {head_dim}"
        )
    if (
        v_bits not in VALUE_BITS
        or t.v_packed.dtype != mx.uint8
        or packed_dim(head_dim, v_bits) != t.v_packed.shape[-1]
    ):
        raise ValueError(
            f"v_packed {t.v_packed.dtype} {tuple(t.v_packed.shape)} is no value code "
            f"width of head_dim {head_dim}"
        )
    return k_bits, v_bits


def decode(
    t: TurboQuantTensor, up_to: int, head_dim: int, defer_v: bool = False
) -> tuple[mx.array, mx.array]:
    """float32 keys and values [B, H, up_to, head_dim] of positions [0, up_to) (TQ-10)."""
    k_bits, v_bits = stored_bits(t, head_dim)
    length = t.k_idx.shape[2]
    if not 0 <= up_to <= length:
        raise ValueError(f"up_to {up_to} is outside the {length} stored positions")
    fields = [a[:, :, :up_to] for a in (t.k_idx, t.k_scales, t.k_zeros, t.v_packed, t.v_scales)]
    if fused_kernels_enabled():
        codebook = centroids(v_bits)
        return fused_decode(*fields, codebook, signs(head_dim), k_bits, v_bits, head_dim, defer_v)
    return decode_plain(*fields, k_bits, v_bits, head_dim, defer_v)


def decode_plain(
    k_idx: mx.array,
    k_scales: mx.array,
    k_zeros: mx.array,
    v_packed: mx.array,
    v_scales: mx.array,
    k_bits: int,
    v_bits: int,
    head_dim: int,
    defer_v: bool,
) -> tuple[mx.array, mx.array]:
    """decode's unfused path: unpack, then decode keys and values with MLX ops (TQ-10).
    Unpacked codes are below 2^bits, so no index check (and no host sync) is needed."""
    keys = decode_keys(unpack_bits(k_idx, k_bits, head_dim), k_scales, k_zeros)
    _check_group_fields(head_dim, v_scales)
    rotated = _centroid_values(unpack_bits(v_packed, v_bits, head_dim), v_scales, v_bits)
    return keys, rotated if defer_v else unrotate(rotated)
