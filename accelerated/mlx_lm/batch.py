"""mlx-lm's batch cache protocol (`BatchKVCache`, `BatchRotatingKVCache`: merge, extend,
filter, extract, prepare, finalize) on kvspec's rows of their own lengths (ROWS-5 ..
ROWS-11).

A batch of one layer is one kvspec cache whose rows are left padded (ROWS-9), or, until
its next append, rows held apart: mlx-lm merges caches that hold no positions yet
(fresh prompts) and may merge them with caches that do, and kvspec merges only caches
that hold positions (ROWS-3). mlx-lm pads a prompt chunk of rows of different lengths on
the right and rolls the padding to the left in `finalize`; kvspec has no right padding
(ROWS-5), so such an append goes to each row alone, without its padding, and the rows are
merged after it (left padded, ROWS-9): each row stores and reads what it would alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import mlx.core as mx

from kvspec.accelerated import caches, rows
from kvspec.accelerated.caches.protocol import Mask, Read


def rows_apart(cache: caches.Cache, compose: Callable[[], caches.Cache]) -> list[caches.Cache]:
    """The rows of `cache`, each a single-row cache of its own (ROWS-8); a cache holding
    nothing is one row holding nothing."""
    if cache.layout is None:
        return [compose()]
    return [rows.extract_row(cache, row) for row in range(cache.layout.batch)]


def switched_as_one(
    parts: Sequence[caches.Cache], compose: Callable[[int | None], caches.Cache]
) -> list[caches.Cache]:
    """`parts` of one bf16-first batch holding one storage (ROWS-7): when some switched
    (B16F-2) and others did not yet (a start they reach at other lengths), those switch
    now, earlier than they would alone, as a batch's shorter rows do. `compose(start)`
    is an empty cache of the batch's recipe, with another start if given."""
    switched = [isinstance(part, caches.Bf16FirstCache) and part.converted for part in parts]
    if not any(switched) or all(switched):
        return list(parts)
    return [
        part if done else _switched_now(part, compose)
        for part, done in zip(parts, switched, strict=True)
    ]


def _switched_now(
    part: caches.Cache, compose: Callable[[int | None], caches.Cache]
) -> caches.Cache:
    # A start of the offset held makes the restore switch (B16F-6) and record that offset
    # as the minimum reusable offset (B16F-4); the batch's own start then adopts it.
    early = compose(part.offset)
    early.restore_state(part.state())
    converted = compose(None)
    converted.restore_state(early.state())
    return converted


def joined(
    row_caches: Sequence[caches.Cache], compose: Callable[[int | None], caches.Cache]
) -> caches.Cache:
    """Caches that all hold positions as one batch (ROWS-3, ROWS-9), switched as one."""
    parts = switched_as_one(row_caches, compose)
    if len(parts) == 1:
        return parts[0]
    return rows.merge(parts)


@dataclass(frozen=True)
class RowsAttention:
    """The reads of an append given to each row alone (`lengths[b]` positions of row b,
    the rest of the `positions` right padding): row b's queries attend through row b's
    read; the padding queries' outputs are zeros (mlx-lm discards them)."""

    reads: tuple[Read, ...]
    lengths: tuple[int, ...]
    positions: int

    def attend(self, queries: mx.array, scale: float, mask: Mask) -> mx.array:
        """Each row's attention of its own queries, in the queries' dtype; the reads apply
        their own masks (MASK-2, MASK-3)."""
        n_heads = queries.shape[1]
        outputs = []
        for row, (read, length) in enumerate(zip(self.reads, self.lengths, strict=True)):
            own = read.attend(queries[row : row + 1, :, :length], scale).astype(queries.dtype)
            padding = mx.zeros((1, n_heads, self.positions - length, own.shape[3]), own.dtype)
            outputs.append(mx.concatenate([own, padding], axis=2))
        return mx.concatenate(outputs, axis=0)


def append_rows(
    row_caches: Sequence[caches.Cache], keys: mx.array, values: mx.array, lengths: Sequence[int]
) -> RowsAttention:
    """Row b's first `lengths[b]` positions of keys and values [B, H, L, D] appended to
    `row_caches[b]` alone: a decode read for one position (READ-2), a window read for more
    (READ-3)."""
    L = keys.shape[2]
    reads = []
    for row, (cache, length) in enumerate(zip(row_caches, lengths, strict=True)):
        k, v = keys[row : row + 1, :, :length], values[row : row + 1, :, :length]
        reads.append(cache.append_decode(k, v) if length == 1 else cache.append_window(k, v))
    return RowsAttention(tuple(reads), tuple(lengths), L)
