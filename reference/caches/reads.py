"""Reads: an append (or none) and what attention sees of it (spec READ-1 .. READ-6).

Each read returns an object whose `attend(queries, scale)` is the attention of the
queries over the keys and values the read saw, under the read's mask. Queries may have
more heads than keys (READ-1).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvspec.reference.caches.attention import attention
from kvspec.reference.caches.masks import create_causal_mask
from kvspec.reference.caches.protocol import Cache, Mask, Read


@dataclass(frozen=True)
class DenseRead:
    """Keys and values [B, Hk, T, D] as one read saw them, and its mask (READ-1)."""

    keys: np.ndarray
    values: np.ndarray
    mask: Mask

    def attend(self, queries: np.ndarray, scale: float) -> np.ndarray:
        """READ-1 attention of `queries` [B, Hq, N, D]."""
        return attention(queries, self.keys, self.values, scale, self.mask)


@dataclass(frozen=True)
class PositionwiseRead:
    """One decode read per position of a span (READ-4): query i attends with read i."""

    reads: tuple[DenseRead, ...]

    def attend(self, queries: np.ndarray, scale: float) -> np.ndarray:
        """Query position i of `queries` [B, Hq, N, D] through read i; N = len(reads)."""
        if queries.shape[2] != len(self.reads):
            raise ValueError(f"expected {len(self.reads)} query positions, got {queries.shape[2]}")
        outputs = [
            read.attend(queries[:, :, i : i + 1], scale) for i, read in enumerate(self.reads)
        ]
        return np.concatenate(outputs, axis=2)


def append_decode(cache: ReadMethods, k: np.ndarray, v: np.ndarray) -> Read:
    """Append one position; its query sees the whole fetched window, no mask (READ-2)."""
    cache.check_append(k, v)
    if k.shape[2] != 1:
        raise ValueError(f"a decode appends one position, got {k.shape[2]}")
    return cache.append_and_read(k, v, None)


def append_window(cache: ReadMethods, k: np.ndarray, v: np.ndarray) -> Read:
    """Append L positions; causal, and windowed on a ring (READ-3). The mask is the cache's
    `make_mask(L, None)` taken before the append (MASK-2, MASK-3)."""
    cache.check_append(k, v)
    mask = cache.make_mask(k.shape[2], None)
    return cache.append_and_read(k, v, mask)


def read_block(cache: ReadMethods, k: np.ndarray, v: np.ndarray) -> DenseRead:
    """The stored window followed by a block that is not appended, no mask (READ-5)."""
    cache.check_append(k, v)
    stored = cache.keys_and_values()
    if stored is None:
        return DenseRead(k, v, None)
    keys = np.concatenate([stored[0], k], axis=2)
    values = np.concatenate([stored[1], v], axis=2)
    return DenseRead(keys, values, None)


def check_first_window(
    cache: ReadMethods, k: np.ndarray, v: np.ndarray, bidirectional: np.ndarray, read: str
) -> None:
    """Reject a first-window read on a cache that holds positions, or a malformed
    bidirectional mask, before anything is appended (READ-6)."""
    cache.check_append(k, v)
    if cache.offset != 0:
        raise ValueError(
            f"{read} reads a sequence's first window (offset 0); this cache holds "
            f"{cache.offset} positions"
        )
    L = k.shape[2]
    if bidirectional.shape != (L, L) or bidirectional.dtype != np.bool_:
        raise ValueError(
            f"bidirectional must be bool [{L}, {L}], got {bidirectional.dtype} "
            f"{tuple(bidirectional.shape)}"
        )


def append_bidirectional(
    cache: ReadMethods, k: np.ndarray, v: np.ndarray, bidirectional: np.ndarray
) -> Read:
    """The first window, causal (windowed on a ring) or marked in `bidirectional` [L, L]
    (READ-6)."""
    check_first_window(cache, k, v, bidirectional, "append_bidirectional")
    causal = create_causal_mask(k.shape[2], 0, cache.sliding_window)
    mask = causal | bidirectional
    return cache.append_and_read(k, v, mask)


def append_encoder_window(
    cache: ReadMethods, k: np.ndarray, v: np.ndarray, bidirectional: np.ndarray
) -> Read:
    """The first window, each query seeing exactly the keys `bidirectional` [L, L] marks
    (READ-6); every query must see at least one key."""
    check_first_window(cache, k, v, bidirectional, "append_encoder_window")
    if not np.all(np.any(bidirectional, axis=-1)):
        raise ValueError("an encoder window's query sees no key under `bidirectional`")
    return cache.append_and_read(k, v, bidirectional)


class ReadMethods(Cache[np.ndarray]):
    """The reads of a storage cache as methods (READ-2 .. READ-6)."""

    def append_and_read(self, k: np.ndarray, v: np.ndarray, mask: Mask) -> Read:
        """Append, then what attention sees of the fetched window under `mask` (READ-1).
        TurboQuant's deferred kernels read rotated values instead (TQC-4)."""
        keys, values = self.update_and_fetch(k, v)
        return DenseRead(keys, values, mask)

    def append_decode(self, k: np.ndarray, v: np.ndarray) -> Read:
        """READ-2."""
        return append_decode(self, k, v)

    def append_window(self, k: np.ndarray, v: np.ndarray) -> Read:
        """READ-3."""
        return append_window(self, k, v)

    def append_committed(self, k: np.ndarray, v: np.ndarray) -> Read:
        """READ-4: on storage caches, the window read."""
        return append_window(self, k, v)

    def read_block(self, k: np.ndarray, v: np.ndarray) -> Read:
        """READ-5."""
        return read_block(self, k, v)

    def append_bidirectional(self, k: np.ndarray, v: np.ndarray, bidirectional: np.ndarray) -> Read:
        """READ-6."""
        return append_bidirectional(self, k, v, bidirectional)

    def append_encoder_window(
        self, k: np.ndarray, v: np.ndarray, bidirectional: np.ndarray
    ) -> Read:
        """READ-6."""
        return append_encoder_window(self, k, v, bidirectional)
