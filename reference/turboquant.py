"""The TurboQuant codec (spec TQ-1 .. TQ-11).

Keys and values of one attention head are stored per position, in groups of
BLOCK_SIZE = 32 consecutive coordinates of head_dim. Keys: asymmetric uniform codes
per group with a float16 scale and zero point (TQ-4, TQ-5). Values: rotated by
random signs and an orthonormal Walsh-Hadamard transform, then each coordinate is
divided by its group's root mean square and coded by a Gaussian Lloyd-Max codebook
(TQ-6 .. TQ-8). Codes narrower than 8 bits are bit-packed per vector (TQ-9).

Every step is float32 with the operation order the spec gives: products and sums
written out (no FMA, no library reduction whose order is unspecified), rounding
half to even (np.rint).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvspec.reference import bits as bitstream
from kvspec.reference.deferred import failure_rank
from kvspec.reference.dtypes import FLOAT16, FLOAT32, dtype_name, narrow, quiet_nan, widen
from kvspec.reference.turboquant_tables import (
    CODEBOOK_IDS,
    INV_SQRT_BITS,
    POSITIVE_CENTROID_BITS,
    SIGN_HEX,
)

BLOCK_SIZE = 32
HEAD_DIMS = (64, 128, 256, 512)
KEY_BITS = (2, 3, 4, 5, 8)
VALUE_BITS = tuple(CODEBOOK_IDS)
EPS = np.float32(1e-8)
SIGNED_KEY_BITS = 8
SIGNED_KEY_LIMIT = 127
TREE_WIDTHS = (16, 8, 4, 2, 1)


# TQ-1 Parameters and constants


def validate_head_dim(head_dim: int) -> None:
    """Reject a head_dim the format has no sign table for (TQ-1)."""
    if head_dim % BLOCK_SIZE != 0 or head_dim not in HEAD_DIMS:
        raise ValueError(
            f"head_dim {head_dim} is not supported: it must be divisible by {BLOCK_SIZE} "
            f"and one of {HEAD_DIMS}"
        )


def signs(head_dim: int) -> np.ndarray:
    """The +-1 float32 sign vector of a head_dim: bit i of its table set means -1 (TQ-1)."""
    validate_head_dim(head_dim)
    table = np.frombuffer(bytes.fromhex(SIGN_HEX[head_dim]), np.uint8)
    negative = np.unpackbits(table, bitorder="little")
    return np.where(negative == 1, np.float32(-1), np.float32(1))


def inv_sqrt(head_dim: int) -> np.float32:
    """f32(1 / sqrt(head_dim)), from its frozen bit pattern (TQ-1)."""
    validate_head_dim(head_dim)
    return np.array([INV_SQRT_BITS[head_dim]], np.uint32).view(FLOAT32)[0]


# TQ-2 Codebooks


def check_value_bits(bits: int) -> None:
    """Reject a value width without a codebook (TQ-2, TQ-3)."""
    if bits not in VALUE_BITS:
        raise ValueError(f"value bits must be one of {VALUE_BITS}, got {bits}")


def codebook_id(bits: int) -> str:
    """The id of the codebook used at `bits` (TQ-2)."""
    check_value_bits(bits)
    return CODEBOOK_IDS[bits]


def centroids(bits: int) -> np.ndarray:
    """The 2^bits float32 centroids, ascending: the mirrored positive half, then it (TQ-2)."""
    check_value_bits(bits)
    positive = np.array(POSITIVE_CENTROID_BITS[bits], np.uint32).view(FLOAT32)
    return np.concatenate([-positive[::-1], positive])


def boundaries(bits: int) -> np.ndarray:
    """The 2^bits - 1 float32 midpoints (c[i] + c[i+1]) * 0.5 of the centroids (TQ-2)."""
    c = centroids(bits)
    pair_sum = c[:-1] + c[1:]
    return pair_sum * np.float32(0.5)


# TQ-3 Validation


def check_key_bits(bits: int) -> None:
    """Reject an unsupported key width (TQ-3, TQ-4)."""
    if bits not in KEY_BITS:
        raise ValueError(f"key bits must be one of {KEY_BITS}, got {bits}")


def validate(x: np.ndarray, what: str) -> None:
    """Reject input the format cannot hold, before anything is computed (TQ-3)."""
    dtype_name(x.dtype)
    if x.ndim < 1:
        raise ValueError(f"{what} must have a head_dim axis, got shape {x.shape}")
    validate_head_dim(x.shape[-1])
    if not np.all(np.isfinite(widen(x))):
        raise ValueError(f"{what} hold NaN or inf, which the format cannot store")


def _store_float16(x32: np.ndarray, field: str) -> np.ndarray:
    """f16 copy of a float32 field; ValueError if a value is beyond float16 (TQ-3)."""
    with np.errstate(over="ignore"):  # rejected just below
        stored = narrow(x32, FLOAT16)
    if not np.all(np.isfinite(stored)):
        raise ValueError(f"a {field} is beyond the float16 range; the format cannot store it")
    return stored


# TQ-4 Key encoding


def _grouped(x32: np.ndarray) -> np.ndarray:
    *lead, D = x32.shape
    return x32.reshape(*lead, D // BLOCK_SIZE, BLOCK_SIZE)


def encode_keys(k: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(indices, scales, zeros) of keys [..., D] (TQ-4).

    indices: [..., D], int8 in [-127, 127] at 8 bits, else uint8 in [0, 2^bits - 1];
    scales, zeros: float16 [..., D / 32].
    """
    check_key_bits(bits)
    validate(k, "keys")
    codes, scale, zero = key_codes(_grouped(widen(k)), bits)
    scales = _store_float16(scale, "key scale")
    zeros = _store_float16(zero, "key zero point")
    return _key_indices(codes, bits).reshape(k.shape), scales, zeros


def key_codes(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TQ-4 without TQ-3's checks: float32 codes (clipped), scale and zero point of each
    32-group of finite keys x [..., D / 32, 32]."""
    signed = bits == SIGNED_KEY_BITS
    levels = np.float32(2 * SIGNED_KEY_LIMIT if signed else 2**bits - 1)
    top = x.max(axis=-1)
    bottom = x.min(axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is the caller's to judge
        span = top - bottom
        scale = span / levels
        step = scale + EPS
        if signed:
            middle = top + bottom
            twice_step = step * np.float32(2)
            zero = np.rint(middle / twice_step)
        else:
            zero = np.rint(bottom / step)
        zero = zero + np.float32(0)  # a zero point of -0 is stored as +0
        # TQ-11: a constant group stores its magnitude as the scale and its sign as code
        # plus zero point, so that it reads back as f16(c) (the formula above gives 0/EPS).
        constant = span == 0
        sign = np.where(top > 0, np.float32(1), np.where(top < 0, np.float32(-1), np.float32(0)))
        scale = np.where(constant, np.abs(top), scale)
        constant_zero = np.float32(0) if signed else np.minimum(sign, np.float32(0))
        zero = np.where(constant, constant_zero, zero)
        quotient = x / step[..., None]
        shifted = quotient - zero[..., None]
        codes = np.rint(shifted)
    codes = np.where(constant[..., None], (sign - zero)[..., None], codes)
    if signed:
        codes = np.clip(codes, np.float32(-SIGNED_KEY_LIMIT), np.float32(SIGNED_KEY_LIMIT))
    else:
        codes = np.clip(codes, np.float32(0), levels)
    return codes, scale, zero


def _key_indices(codes: np.ndarray, bits: int) -> np.ndarray:
    """Clipped float32 key codes as stored: int8 at 8 bits, else uint8 (TQ-4)."""
    *lead, groups, size = codes.shape
    stored_dtype = np.int8 if bits == SIGNED_KEY_BITS else np.uint8
    return codes.astype(stored_dtype).reshape(*lead, groups * size)


# TQ-5 Key decoding


def decode_keys(indices: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> np.ndarray:
    """float32 keys (index + zero) * scale, per group, in that order (TQ-5)."""
    *lead, D = indices.shape
    _check_group_fields(D, scales, zeros)
    codes = _grouped(indices.astype(FLOAT32))
    offset = codes + widen(zeros)[..., None]
    keys = offset * widen(scales)[..., None]
    return keys.reshape(*lead, D)


def _check_group_fields(head_dim: int, *fields: np.ndarray) -> None:
    for field in fields:
        if field.dtype != FLOAT16 or field.shape[-1] * BLOCK_SIZE != head_dim:
            raise ValueError(
                f"expected float16 group fields of {head_dim // BLOCK_SIZE} per vector, "
                f"got {field.dtype} {field.shape}"
            )


# TQ-6 Rotation


def hadamard(x32: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh-Hadamard transform of the last axis, float32 (TQ-6).

    Butterflies (a + b, a - b) at strides h = 1, 2, ..., D/2, then one multiply by
    f32(1 / sqrt(D)).
    """
    *lead, D = x32.shape
    validate_head_dim(D)
    y = x32.astype(FLOAT32)
    h = 1
    while h < D:
        pairs = y.reshape(*lead, D // (2 * h), 2, h)
        a = pairs[..., 0, :]
        b = pairs[..., 1, :]
        y = np.stack([a + b, a - b], axis=-2).reshape(*lead, D)
        h *= 2
    return y * inv_sqrt(D)


def rotate(x: np.ndarray) -> np.ndarray:
    """Signs, then the Hadamard transform: the value rotation, float32 (TQ-6)."""
    signed = widen(x) * signs(x.shape[-1])
    return hadamard(signed)


def unrotate(y: np.ndarray) -> np.ndarray:
    """Inverse of rotate: the Hadamard transform, then the signs (TQ-6, TQ-8)."""
    transformed = hadamard(widen(y))
    return transformed * signs(y.shape[-1])


# TQ-7 Value encoding


def group_rms(y: np.ndarray) -> np.ndarray:
    """Root mean square of each 32-group of the last axis, by the halving tree (TQ-7)."""
    squares = _grouped(y) * _grouped(y)
    partial = squares
    for w in TREE_WIDTHS:
        partial = partial[..., :w] + partial[..., w : 2 * w]
    total = partial[..., 0]
    with np.errstate(over="ignore", invalid="ignore"):  # rejected by the caller
        mean = total / np.float32(BLOCK_SIZE)
        return np.sqrt(mean)


def encode_values(v: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, scales) of values [..., D] (TQ-7).

    indices: uint8 [..., D], each the number of codebook boundaries strictly below
    u = y / (rms + EPS); scales: float16 rms [..., D / 32].
    """
    check_value_bits(bits)
    validate(v, "values")
    indices, rms = value_codes(v, bits)
    scales = _store_float16(rms, "value scale (group rms)")
    return indices, scales


def value_codes(v: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """TQ-7 without TQ-3's checks: uint8 indices [..., D] and the float32 group rms
    [..., D / 32] of values v."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is the caller's to judge
        y = rotate(v)
        rms = group_rms(y)
        denominator = rms + EPS
        u = _grouped(y) / denominator[..., None]
    below = boundaries(bits) < u[..., None]
    indices = np.count_nonzero(below, axis=-1).astype(np.uint8)
    return indices.reshape(v.shape), rms


# TQ-8 Value decoding


def decode_values_rotated(indices: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """float32 values left in the rotated domain: centroid[index] * scale (TQ-8)."""
    *lead, D = indices.shape
    _check_group_fields(D, scales)
    levels = centroids(bits)
    if np.any(indices >= levels.size):
        raise ValueError(f"a value index is beyond the {levels.size} centroids")
    coded = _grouped(levels[indices])
    values = coded * widen(scales)[..., None]
    return values.reshape(*lead, D)


def decode_values(indices: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """float32 values: decode_values_rotated, then unrotate (TQ-8)."""
    rotated = decode_values_rotated(indices, scales, bits)
    return unrotate(rotated)


# TQ-9 Packing


def _check_bits(bits: int) -> None:
    if bits not in KEY_BITS and bits not in VALUE_BITS:
        raise ValueError(f"bits must be one of {sorted({*KEY_BITS, *VALUE_BITS})}, got {bits}")


def packed_dim(dim: int, bits: int) -> int:
    """Bytes per vector of `dim` codes of `bits` bits (TQ-9)."""
    _check_bits(bits)
    return bitstream.packed_length(dim, bits, 8)


def pack_bits(indices: np.ndarray, bits: int) -> np.ndarray:
    """Each vector's codes as one LSB-first byte stream; 8-bit codes unchanged (TQ-9)."""
    _check_bits(bits)
    if bits == 8:
        return indices
    return bitstream.pack_bytes(indices, bits)


def unpack_bits(packed: np.ndarray, bits: int, dim: int) -> np.ndarray:
    """Inverse of pack_bits: `dim` uint8 codes per vector (TQ-9)."""
    _check_bits(bits)
    if bits == 8:
        if packed.shape[-1] != dim:
            raise ValueError(f"expected {dim} 8-bit codes per vector, got {packed.shape[-1]}")
        return packed
    return bitstream.unpack_bytes(packed, bits, dim)


# TQ-10 Stored tensor


@dataclass
class TurboQuantTensor:
    """The five stored arrays of encoded keys and values [B, H, L, *] (TQ-10).

    The field order is the persistence slot order. k_idx: int8 [.., D] at 8 bits,
    else uint8 [.., packed_dim(D, k_bits)]; k_scales, k_zeros, v_scales: float16
    [.., D / 32]; v_packed: uint8 [.., packed_dim(D, v_bits)].
    """

    k_idx: np.ndarray
    k_scales: np.ndarray
    k_zeros: np.ndarray
    v_packed: np.ndarray
    v_scales: np.ndarray


def encode(k: np.ndarray, v: np.ndarray, k_bits: int, v_bits: int) -> TurboQuantTensor:
    """Encode keys and values [B, H, L, D] into one TurboQuantTensor (TQ-10)."""
    check_key_bits(k_bits)
    check_value_bits(v_bits)
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"keys and values must share one [B, H, L, D] shape, got {k.shape} and {v.shape}"
        )
    validate(k, "keys")
    validate(v, "values")
    k_indices, k_scales, k_zeros = encode_keys(k, k_bits)
    v_indices, v_scales = encode_values(v, v_bits)
    return TurboQuantTensor(
        k_idx=pack_bits(k_indices, k_bits),
        k_scales=k_scales,
        k_zeros=k_zeros,
        v_packed=pack_bits(v_indices, v_bits),
        v_scales=v_scales,
    )


#: TQ-3's value checks in the order encode makes them: what a deferred encode records
#: (DEFER-2).
DEFERRED_CHECKS = (
    "keys hold NaN or inf, which the format cannot store",
    "values hold NaN or inf, which the format cannot store",
    "a key scale is beyond the float16 range; the format cannot store it",
    "a key zero point is beyond the float16 range; the format cannot store it",
    "a value scale (group rms) is beyond the float16 range; the format cannot store it",
)


def encode_deferred(
    k: np.ndarray, v: np.ndarray, k_bits: int, v_bits: int
) -> tuple[TurboQuantTensor, int]:
    """(tensor, failure): encode's fields, except that each group TQ-3 would reject is
    stored as codes 0 and a quiet NaN scale, a key group also with zero point 0 (DEFER-1):
    a key group holding NaN or inf, or whose scale or zero point is beyond float16; a
    value group whose rms is beyond float16 (NaN or inf in a value vector reaches every
    group's rms through the rotation). `failure` is the rank of the earliest check of
    DEFERRED_CHECKS that failed, 0 if none (DEFER-2). Widths, shapes and dtypes are still
    rejected at once."""
    check_key_bits(k_bits)
    check_value_bits(v_bits)
    if k.ndim != 4 or k.shape != v.shape:
        raise ValueError(
            f"keys and values must share one [B, H, L, D] shape, got {k.shape} and {v.shape}"
        )
    for x in k, v:
        dtype_name(x.dtype)
        validate_head_dim(x.shape[-1])
    x = _grouped(widen(k))
    key_nonfinite = ~np.all(np.isfinite(x), axis=-1)
    finite_x = np.where(key_nonfinite[..., None], np.float32(0), x)
    codes, scale, zero = key_codes(finite_x, k_bits)
    with np.errstate(over="ignore"):  # judged just below
        scales = narrow(scale, FLOAT16)
        zeros = narrow(zero, FLOAT16)
    scale_beyond = ~np.isfinite(scales)
    zero_beyond = ~np.isfinite(zeros)
    key_failed = key_nonfinite | scale_beyond | zero_beyond
    codes = np.where(key_failed[..., None], np.float32(0), codes)
    k_scales = np.where(key_failed, quiet_nan(FLOAT16), scales)
    k_zeros = np.where(key_failed, np.float16(0), zeros)
    value_nonfinite = not np.all(np.isfinite(widen(v)))
    indices, rms = value_codes(v, v_bits)
    with np.errstate(over="ignore", invalid="ignore"):  # judged just below
        v_scales = narrow(rms, FLOAT16)
    value_failed = ~np.isfinite(v_scales)
    indices = np.where(value_failed[..., None], np.uint8(0), _grouped(indices)).reshape(v.shape)
    v_scales = np.where(value_failed, quiet_nan(FLOAT16), v_scales)
    failure = failure_rank(
        DEFERRED_CHECKS,
        [
            bool(key_nonfinite.any()),
            value_nonfinite,
            bool(scale_beyond.any()),
            bool(zero_beyond.any()),
            bool(value_failed.any()),
        ],
    )
    tensor = TurboQuantTensor(
        k_idx=pack_bits(_key_indices(codes, k_bits).reshape(k.shape), k_bits),
        k_scales=k_scales,
        k_zeros=k_zeros,
        v_packed=pack_bits(indices, v_bits),
        v_scales=v_scales,
    )
    return tensor, failure


def stored_bits(t: TurboQuantTensor, head_dim: int) -> tuple[int, int]:
    """(k_bits, v_bits) of a tensor, from its code widths and dtypes (TQ-10)."""
    validate_head_dim(head_dim)
    k_bits = t.k_idx.shape[-1] * 8 // head_dim
    v_bits = t.v_packed.shape[-1] * 8 // head_dim
    k_dtype = np.int8 if k_bits == SIGNED_KEY_BITS else np.uint8
    if (
        k_bits not in KEY_BITS
        or t.k_idx.dtype != k_dtype
        or packed_dim(head_dim, k_bits) != (t.k_idx.shape[-1])
    ):
        raise ValueError(
            f"k_idx {t.k_idx.dtype} {t.k_idx.shape} is no key code width of head_dim {head_dim}"
        )
    if (
        v_bits not in VALUE_BITS
        or t.v_packed.dtype != np.uint8
        or packed_dim(head_dim, v_bits) != t.v_packed.shape[-1]
    ):
        raise ValueError(
            f"v_packed {t.v_packed.dtype} {t.v_packed.shape} is no value code "
            f"width of head_dim {head_dim}"
        )
    return k_bits, v_bits


def decode(
    t: TurboQuantTensor, up_to: int, head_dim: int, defer_v: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """float32 keys and values [B, H, up_to, head_dim] of positions [0, up_to) (TQ-10).

    defer_v leaves the values rotated (decode_values_rotated); the caller unrotates
    the attention output instead (TQ-8).
    """
    k_bits, v_bits = stored_bits(t, head_dim)
    length = t.k_idx.shape[2]
    if not 0 <= up_to <= length:
        raise ValueError(f"up_to {up_to} is outside the {length} stored positions")
    k_idx = t.k_idx[:, :, :up_to]
    v_packed = t.v_packed[:, :, :up_to]
    k_indices = unpack_bits(k_idx, k_bits, head_dim)
    keys = decode_keys(k_indices, t.k_scales[:, :, :up_to], t.k_zeros[:, :, :up_to])
    v_indices = unpack_bits(v_packed, v_bits, head_dim)
    v_scales = t.v_scales[:, :, :up_to]
    if defer_v:
        values = decode_values_rotated(v_indices, v_scales, v_bits)
    else:
        values = decode_values(v_indices, v_scales, v_bits)
    return keys, values
