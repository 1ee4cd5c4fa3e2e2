"""Reads on MLX (spec READ-1 .. READ-6); the same reads as the reference's."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from kvspec.accelerated.caches.attention import attention
from kvspec.accelerated.caches.masks import create_causal_mask
from kvspec.accelerated.caches.protocol import Cache, Mask, Read


@dataclass(frozen=True)
class DenseRead:
    """Keys and values [B, Hk, T, D] as one read saw them, and its mask (READ-1)."""

    keys: mx.array
    values: mx.array
    mask: Mask

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """READ-1."""
        return attention(queries, self.keys, self.values, scale, self.mask)


@dataclass(frozen=True)
class PositionwiseRead:
    """One decode read per position of a span (READ-4)."""

    reads: tuple[DenseRead, ...]

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """Query position i through read i."""
        if queries.shape[2] != len(self.reads):
            raise ValueError(f"expected {len(self.reads)} query positions, got {queries.shape[2]}")
        return mx.concatenate(
            [read.attend(queries[:, :, i : i + 1], scale) for i, read in enumerate(self.reads)],
            axis=2,
        )


def append_decode(cache: ReadMethods, k: mx.array, v: mx.array) -> Read:
    """READ-2."""
    cache.check_append(k, v)
    if k.shape[2] != 1:
        raise ValueError(f"a decode appends one position, got {k.shape[2]}")
    return cache.append_and_read(k, v, None)


def append_window(cache: ReadMethods, k: mx.array, v: mx.array) -> Read:
    """READ-3."""
    cache.check_append(k, v)
    mask = cache.make_mask(k.shape[2], None)
    return cache.append_and_read(k, v, mask)


def read_block(cache: ReadMethods, k: mx.array, v: mx.array) -> DenseRead:
    """READ-5."""
    cache.check_append(k, v)
    stored = cache.keys_and_values()
    if stored is None:
        return DenseRead(k, v, None)
    keys = mx.concatenate([stored[0], k], axis=2)
    values = mx.concatenate([stored[1], v], axis=2)
    return DenseRead(keys, values, None)


def check_first_window(
    cache: ReadMethods, k: mx.array, v: mx.array, bidirectional: mx.array, read: str
) -> None:
    """READ-6."""
    cache.check_append(k, v)
    if cache.offset != 0:
        raise ValueError(
            f"{read} reads a sequence's first window (offset 0); this cache holds "
            f"{cache.offset} positions"
        )
    L = k.shape[2]
    if tuple(bidirectional.shape) != (L, L) or bidirectional.dtype != mx.bool_:
        raise ValueError(
            f"bidirectional must be bool [{L}, {L}], got {bidirectional.dtype} "
            f"{tuple(bidirectional.shape)}"
        )


def append_bidirectional(
    cache: ReadMethods, k: mx.array, v: mx.array, bidirectional: mx.array
) -> Read:
    """READ-6."""
    check_first_window(cache, k, v, bidirectional, "append_bidirectional")
    mask = create_causal_mask(k.shape[2], 0, cache.sliding_window) | bidirectional
    return cache.append_and_read(k, v, mask)


def append_encoder_window(
    cache: ReadMethods, k: mx.array, v: mx.array, bidirectional: mx.array
) -> Read:
    """READ-6."""
    check_first_window(cache, k, v, bidirectional, "append_encoder_window")
    if not mx.all(mx.any(bidirectional, axis=-1)).item():
        raise ValueError("an encoder window's query sees no key under `bidirectional`")
    return cache.append_and_read(k, v, bidirectional)


class ReadMethods(Cache[mx.array]):
    """The reads of a storage cache as methods (READ-2 .. READ-6)."""

    def append_and_read(self, k: mx.array, v: mx.array, mask: Mask) -> Read:
        """Append, then what attention sees of the fetched window under `mask` (READ-1).
        TurboQuant's deferred kernels read rotated values instead (TQC-4)."""
        keys, values = self.update_and_fetch(k, v)
        return DenseRead(keys, values, mask)

    def append_decode(self, k: mx.array, v: mx.array) -> Read:
        """READ-2."""
        return append_decode(self, k, v)

    def append_window(self, k: mx.array, v: mx.array) -> Read:
        """READ-3."""
        return append_window(self, k, v)

    def append_committed(self, k: mx.array, v: mx.array) -> Read:
        """READ-4."""
        return append_window(self, k, v)

    def read_block(self, k: mx.array, v: mx.array) -> Read:
        """READ-5."""
        return read_block(self, k, v)

    def append_bidirectional(self, k: mx.array, v: mx.array, bidirectional: mx.array) -> Read:
        """READ-6."""
        return append_bidirectional(self, k, v, bidirectional)

    def append_encoder_window(self, k: mx.array, v: mx.array, bidirectional: mx.array) -> Read:
        """READ-6."""
        return append_encoder_window(self, k, v, bidirectional)
