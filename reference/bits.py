"""Least-significant-bit-first bit streams (spec BITS-1, BITS-2, BITS-3).

A row of n codes of `bits` bits each is one bit stream: bit j of code i sits at
stream position i*bits + j. The stream is cut into bytes (position p is bit p % 8
of byte p // 8) and, for the MLX affine format, bytes are read four at a time as
little-endian uint32 words (position p is bit p % 32 of word p // 32).
"""

from __future__ import annotations

import numpy as np

SUPPORTED_BITS = range(1, 9)


def _check_stream(count: int, bits: int, unit: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if (count * bits) % unit != 0:
        raise ValueError(f"{count} codes of {bits} bits do not fill whole {unit}-bit units")


def packed_length(count: int, bits: int, unit: int) -> int:
    """How many `unit`-bit units a row of `count` codes of `bits` bits fills (BITS-3)."""
    _check_stream(count, bits, unit)
    return count * bits // unit


def pack_bytes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack the last axis of unsigned codes into a uint8 stream, LSB first (BITS-1)."""
    count = codes.shape[-1]
    _check_stream(count, bits, 8)
    if np.any(codes >> bits):
        raise ValueError(f"a code does not fit in {bits} bits")
    bit_index = np.arange(bits, dtype=np.uint32)
    stream = (codes.astype(np.uint32)[..., None] >> bit_index) & 1  # [..., count, bits]
    stream = stream.reshape(*codes.shape[:-1], count * bits).astype(np.uint8)
    return np.packbits(stream, axis=-1, bitorder="little")


def unpack_bytes(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of pack_bytes: `count` codes per row as uint8 (BITS-1)."""
    _check_stream(count, bits, 8)
    if packed.dtype != np.uint8 or packed.shape[-1] != count * bits // 8:
        raise ValueError(f"expected uint8 rows of {count * bits // 8} bytes")
    stream = np.unpackbits(packed, axis=-1, bitorder="little")
    stream = stream.reshape(*packed.shape[:-1], count, bits).astype(np.uint32)
    weights = np.uint32(1) << np.arange(bits, dtype=np.uint32)
    return (stream * weights).sum(axis=-1).astype(np.uint8)


def bytes_to_words(packed: np.ndarray) -> np.ndarray:
    """Read each 4 bytes of the last axis as one little-endian uint32 (BITS-2)."""
    if packed.dtype != np.uint8 or packed.shape[-1] % 4 != 0:
        raise ValueError("expected uint8 rows whose length is a multiple of 4")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def words_to_bytes(words: np.ndarray) -> np.ndarray:
    """Inverse of bytes_to_words (BITS-2)."""
    if words.dtype != np.uint32:
        raise ValueError("expected uint32 words")
    return np.ascontiguousarray(words.astype("<u4")).view(np.uint8)


def pack_words(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack the last axis of codes into little-endian uint32 words, LSB first (BITS-2)."""
    _check_stream(codes.shape[-1], bits, 32)
    return bytes_to_words(pack_bytes(codes, bits))


def unpack_words(words: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of pack_words: `count` codes per row as uint32 (BITS-2)."""
    _check_stream(count, bits, 32)
    return unpack_bytes(words_to_bytes(words), bits, count).astype(np.uint32)
