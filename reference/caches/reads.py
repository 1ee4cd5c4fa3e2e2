"""Reads: an append (or none) and what attention sees of it (spec READ-1 .. READ-6).

Each read returns an object whose `attend(queries, scale)` is the attention of the
queries over the keys and values the read saw, under the read's mask. Queries may have
more heads than keys (READ-1).

`ReadMethods`, the base of every storage cache, also names what the storages compute
with: the array namespace `xp`, the masks, the read classes and two small hooks. The MLX
backend binds its own there and inherits every step (kvspec.accelerated.caches).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from kvspec.reference import dtypes
from kvspec.reference.caches import masks
from kvspec.reference.caches.attention import attention
from kvspec.reference.caches.protocol import Cache, Mask, Read


@dataclass(frozen=True)
class DenseRead:
    """Keys and values [B, Hk, T, D] as one read saw them, and its mask (READ-1)."""

    keys: np.ndarray
    values: np.ndarray
    mask: Mask

    #: The attention that computes the read (READ-1); each backend binds its own.
    attention = staticmethod(attention)

    def attend(self, queries: np.ndarray, scale: float) -> np.ndarray:
        """READ-1 attention of `queries` [B, Hq, N, D]."""
        return self.attention(queries, self.keys, self.values, scale, self.mask)


@dataclass(frozen=True)
class PositionwiseRead:
    """One decode read per position of a span (READ-4): query i attends with read i."""

    reads: tuple[DenseRead, ...]

    #: The array namespace that joins the outputs.
    xp = np

    def attend(self, queries: np.ndarray, scale: float) -> np.ndarray:
        """Query position i of `queries` [B, Hq, N, D] through read i; N = len(reads)."""
        if queries.shape[2] != len(self.reads):
            raise ValueError(f"expected {len(self.reads)} query positions, got {queries.shape[2]}")
        outputs = [
            read.attend(queries[:, :, i : i + 1], scale) for i, read in enumerate(self.reads)
        ]
        return self.xp.concatenate(outputs, axis=2)


def _positions(k: np.ndarray) -> int:
    """L of keys [B, H, L, D] (CACHE-2)."""
    if k.ndim != 4:
        raise ValueError(f"keys must be [B, H, L, D], got shape {tuple(k.shape)}")
    return k.shape[2]


class ReadMethods(Cache[np.ndarray]):
    """The reads of a storage cache as methods (READ-2 .. READ-6), and what every storage
    computes with. Arrays are made and joined through `xp` (`np.zeros(shape, dtype)` and
    `np.concatenate(arrays, axis=)` have MLX twins of the same signature); `xp.array(a)`
    is an array of its own (a copy)."""

    #: The array namespace.
    xp: ModuleType = np
    #: The masks of MASK-1 .. MASK-3.
    masks: ModuleType = masks
    #: The read an append returns (READ-1).
    dense_read: type[DenseRead] = DenseRead
    #: The spec's name of an array's float format (CONV-1).
    dtype_name = staticmethod(dtypes.dtype_name)

    @staticmethod
    def _detached(rows: np.ndarray) -> np.ndarray:
        """Rows sliced from a stored field, as an array that later writes into the field do
        not reach (fetches, CACHE-3; states, CACHE-8). A NumPy slice is a view: copy it."""
        return rows.copy()

    def append_and_read(self, k: np.ndarray, v: np.ndarray, mask: Mask) -> Read:
        """Append, then what attention sees of the fetched window under `mask` (READ-1).
        TurboQuant's deferred kernels read rotated values instead (TQC-4)."""
        keys, values = self.update_and_fetch(k, v)
        return self.dense_read(keys, values, self._rows_mask(mask, k.shape[2], keys.shape[2]))

    def _rows_mask(self, mask: Mask, n: int, t: int, appended: bool = True) -> Mask:
        """`mask` for `n` queries over `t` keys with each row's left padding hidden (ROWS-6);
        storage with padded rows says how. `appended`: the queries are the append's."""
        return mask

    def append_decode(self, k: np.ndarray, v: np.ndarray) -> Read:
        """Append one position; its query sees the whole fetched window, no mask (READ-2).
        The append itself checks the input (CACHE-2) before it changes anything, so the
        positions are encoded once."""
        if _positions(k) != 1:
            raise ValueError(f"a decode appends one position, got {k.shape[2]}")
        return self.append_and_read(k, v, None)

    def append_window(self, k: np.ndarray, v: np.ndarray) -> Read:
        """Append L positions; causal, and windowed on a ring (READ-3). The mask is the cache's
        `make_mask(L, None)` taken before the append (MASK-2, MASK-3), which itself checks
        the input (CACHE-2) before it changes anything."""
        mask = self.make_mask(_positions(k), None)
        return self.append_and_read(k, v, mask)

    def append_committed(self, k: np.ndarray, v: np.ndarray) -> Read:
        """READ-4: on storage caches, the window read."""
        return self.append_window(k, v)

    def read_block(self, k: np.ndarray, v: np.ndarray) -> Read:
        """The stored window followed by a block that is not appended, no mask (READ-5)."""
        self.check_append(k, v)
        stored = self.keys_and_values()
        if stored is None:
            return self.dense_read(k, v, None)
        keys = self.xp.concatenate([stored[0], k], axis=2)
        values = self.xp.concatenate([stored[1], v], axis=2)
        # One mask row for any number of queries: only padding is hidden (ROWS-6).
        return self.dense_read(keys, values, self._rows_mask(None, 1, keys.shape[2], False))

    def _check_first_window(
        self, k: np.ndarray, v: np.ndarray, bidirectional: np.ndarray, read: str
    ) -> None:
        """Reject a first-window read on a cache that holds positions, or a malformed
        bidirectional mask, before anything is appended (READ-6)."""
        self.check_append(k, v)
        if self.offset != 0:
            raise ValueError(
                f"{read} reads a sequence's first window (offset 0); this cache holds "
                f"{self.offset} positions"
            )
        L = k.shape[2]
        if tuple(bidirectional.shape) != (L, L) or bidirectional.dtype != self.xp.bool_:
            raise ValueError(
                f"bidirectional must be bool [{L}, {L}], got {bidirectional.dtype} "
                f"{tuple(bidirectional.shape)}"
            )

    def append_bidirectional(self, k: np.ndarray, v: np.ndarray, bidirectional: np.ndarray) -> Read:
        """The first window, causal (windowed on a ring) or marked in `bidirectional` [L, L]
        (READ-6)."""
        self._check_first_window(k, v, bidirectional, "append_bidirectional")
        causal = self.masks.create_causal_mask(k.shape[2], 0, self.sliding_window)
        mask = causal | bidirectional
        return self.append_and_read(k, v, mask)

    def append_encoder_window(
        self, k: np.ndarray, v: np.ndarray, bidirectional: np.ndarray
    ) -> Read:
        """The first window, each query seeing exactly the keys `bidirectional` [L, L] marks
        (READ-6); every query must see at least one key."""
        self._check_first_window(k, v, bidirectional, "append_encoder_window")
        if not self.xp.all(self.xp.any(bidirectional, axis=-1)):
            raise ValueError("an encoder window's query sees no key under `bidirectional`")
        return self.append_and_read(k, v, bidirectional)
