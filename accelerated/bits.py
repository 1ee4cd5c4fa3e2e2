"""LSB-first bit streams on MLX (spec BITS-1, BITS-2, BITS-3); same layout as the reference.

Codes expand to their bit planes, the planes of a row are the stream, and each run
of 8 (or 32) stream bits sums into one byte (or word): the bits are disjoint, so the
integer sum is their OR.
"""

from __future__ import annotations

import mlx.core as mx

from kvspec.reference.bits import SUPPORTED_BITS, packed_length

__all__ = [
    "SUPPORTED_BITS",
    "pack_bytes",
    "pack_words",
    "packed_length",
    "unpack_bytes",
    "unpack_words",
]


def _pack(codes: mx.array, bits: int, unit: int, dtype: mx.Dtype) -> mx.array:
    *lead, count = codes.shape
    n_units = packed_length(count, bits, unit)
    planes = (codes.astype(mx.uint32)[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1
    stream = planes.reshape(*lead, n_units, unit)
    return mx.sum(stream << mx.arange(unit, dtype=mx.uint32), axis=-1).astype(dtype)


def _unpack(packed: mx.array, bits: int, count: int, unit: int, dtype: mx.Dtype) -> mx.array:
    *lead, n_units = packed.shape
    if packed.dtype != dtype or n_units != packed_length(count, bits, unit):
        raise ValueError(
            f"expected {dtype} rows of {count * bits // unit} units of {unit} bits, got "
            f"{packed.dtype} rows of {n_units}"
        )
    stream = (packed.astype(mx.uint32)[..., None] >> mx.arange(unit, dtype=mx.uint32)) & 1
    planes = stream.reshape(*lead, count, bits)
    return mx.sum(planes << mx.arange(bits, dtype=mx.uint32), axis=-1).astype(dtype)


def pack_bytes(codes: mx.array, bits: int) -> mx.array:
    """Pack the last axis of unsigned codes into a uint8 stream, LSB first (BITS-1)."""
    return _pack(codes, bits, 8, mx.uint8)


def unpack_bytes(packed: mx.array, bits: int, count: int) -> mx.array:
    """Inverse of pack_bytes: `count` codes per row as uint8 (BITS-1)."""
    return _unpack(packed, bits, count, 8, mx.uint8)


def pack_words(codes: mx.array, bits: int) -> mx.array:
    """Pack the last axis of codes into little-endian uint32 words, LSB first (BITS-2)."""
    return _pack(codes, bits, 32, mx.uint32)


def unpack_words(words: mx.array, bits: int, count: int) -> mx.array:
    """Inverse of pack_words: `count` codes per row as uint32 (BITS-2)."""
    return _unpack(words, bits, count, 32, mx.uint32)
