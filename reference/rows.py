"""Rows of caches: one sequence's row taken out of a batch, rows kept or joined, rows of
their own lengths left padded, and copies (spec ROWS-1 .. ROWS-10).

Every cache of chapter 5 holds B rows that share one buffer offset, and every codec
encodes each row on its own, so a row's stored fields are the fields that row would have
had in a cache of its own; rows of different lengths are left padded to the longest
(ROWS-5). These functions work through states (CACHE-8): a new cache of the
same kind and parameters (PERSIST-5) restores the rows' arrays. They serve both backends:
a cache is rebuilt from the caches package its class belongs to.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvspec.reference.caches.bf16_first import Bf16FirstCache
from kvspec.reference.caches.protocol import Cache, CacheState
from kvspec.reference.caches.rotating import ring_positions
from kvspec.reference.persistence import kind_of, parameters


def _family(cache: Cache) -> Any:
    """The caches package whose class `cache` is (ROWS-1)."""
    return importlib.import_module(type(cache).__module__.rsplit(".", 1)[0])


def _restored(cache: Cache, state: CacheState) -> Cache:
    """A new cache of `cache`'s kind and parameters holding `state`."""
    family = _family(cache)
    fresh = getattr(family, kind_of(cache, family))(**parameters(cache, family))
    fresh.restore_state(state)
    return fresh


def _storage(cache: Cache) -> Cache:
    """The storage `cache` holds: itself, or a bf16-first cache's held storage."""
    return cache.storage if isinstance(cache, Bf16FirstCache) else cache


def _xp(cache: Cache) -> Any:
    """The array namespace of `cache`'s storage."""
    return _storage(cache).xp


def _row_count(cache: Cache) -> int:
    layout = cache.layout
    if layout is None:
        raise ValueError("an empty cache holds no rows")
    return layout.batch


@dataclass(frozen=True)
class _OwnRow:
    """One row as a cache of its own would hold it (ROWS-8): its stored rows [1, H, h, *]
    oldest first, its offset and its minimum reusable offset."""

    arrays: tuple[Any, ...]
    offset: int
    minimum_reusable_offset: int


def _own_row(state: CacheState, row: int, xp: Any, window: int | None) -> _OwnRow:
    """ROWS-8: row `row` of `state` without its padding: growable storage's rows from its
    first position on; a ring's window (`window` = max_size): its last min(row offset,
    max_size) positions, oldest first."""
    padding = state.left_padding[row] if state.left_padding else 0
    rows = tuple(a[row : row + 1] for a in state.arrays)
    if state.ring_index is None:
        arrays = tuple(a[:, :, padding:] for a in rows)
    else:
        positions = ring_positions(state.offset, state.ring_index, state.arrays[0].shape[2])
        oldest_first = np.argsort(positions)
        assert window is not None
        own = oldest_first[positions[oldest_first] >= padding]
        kept = own[max(0, own.size - window) :]
        arrays = tuple(xp.take(a, xp.array(kept), axis=2) for a in rows)
    reusable = max(0, state.minimum_reusable_offset - padding)
    return _OwnRow(arrays, state.offset - padding, reusable)


def _own_row_state(state: CacheState, row: int, xp: Any, window: int | None) -> CacheState:
    """ROWS-8: the state of a single-row cache holding row `row` of a padded batch: a
    ring's rows in temporal order, its ring index after them."""
    own = _own_row(state, row, xp, window)
    index = None if state.ring_index is None else own.arrays[0].shape[2]
    return CacheState(state.signature, own.arrays, own.offset, index, own.minimum_reusable_offset)


def _left_padded(rows: Any, length: int, xp: Any) -> Any:
    """ROWS-9: one row's stored rows [1, H, h, *] after length - h zero rows."""
    zeros = xp.zeros((*rows.shape[:2], length - rows.shape[2], rows.shape[3]), rows.dtype)
    return xp.concatenate([zeros, rows], axis=2)


def _aligned_state(states: Sequence[CacheState], xp: Any, window: int | None) -> CacheState:
    """ROWS-9: the rows of `states` left padded to the longest: every row's newest
    position at the last buffer row, zero fields before a row's oldest, a ring in temporal
    order with its index after its last row."""
    own = [
        _own_row(state, b, xp, window) for state in states for b in range(state.arrays[0].shape[0])
    ]
    offset = max(row.offset for row in own)
    length = max(row.arrays[0].shape[2] for row in own)
    arrays = tuple(
        xp.concatenate([_left_padded(rows, length, xp) for rows in slot], axis=0)
        for slot in zip(*(row.arrays for row in own), strict=True)
    )
    padding = tuple(offset - row.offset for row in own)
    # The shortest prefix every row can reuse, in buffer positions (ROWS-9).
    reusable = max(
        (
            row.minimum_reusable_offset + offset - row.offset
            for row in own
            if row.minimum_reusable_offset
        ),
        default=0,
    )
    index = None if states[0].ring_index is None else length
    return CacheState(
        states[0].signature, arrays, offset, index, reusable, padding if any(padding) else ()
    )


def filter_rows(cache: Cache, indices: Sequence[int]) -> Cache:
    """ROWS-2, ROWS-8: a new cache of `cache`'s kind holding its rows `indices`, in that
    order; padding no kept row needs is dropped. ValueError for no index or one out of
    range. `cache` is unchanged."""
    rows = _row_count(cache)
    picked = [int(i) for i in indices]
    if not picked:
        raise ValueError("filter_rows keeps at least one row")
    beyond = [i for i in picked if not 0 <= i < rows]
    if beyond:
        raise ValueError(f"rows {beyond} out of range for a cache of {rows} rows")
    state = cache.state()
    xp = _xp(cache)
    if state.left_padding:
        window = cache.sliding_window
        return merge([_restored(cache, _own_row_state(state, i, xp, window)) for i in picked])
    arrays = tuple(xp.take(a, xp.array(picked), axis=0) for a in state.arrays)
    return _restored(cache, replace(state, arrays=arrays))


def extract_row(cache: Cache, row: int) -> Cache:
    """ROWS-2, ROWS-8: a new single-row cache holding row `row` of `cache`: bit for bit the
    cache that row would have been on its own (a row of a padded ring: its window in
    temporal order)."""
    return filter_rows(cache, [row])


def merge(caches: Sequence[Cache]) -> Cache:
    """ROWS-3, ROWS-9: a new cache whose rows are the rows of `caches`, in order. The caches
    must be of one kind, parameters and signature and share the layout but the batch;
    rows of one offset, ring index and buffer length are joined as they lie, others left
    padded to the longest (rings with keep 0 only). ValueError names the first difference."""
    caches = list(caches)
    if not caches:
        raise ValueError("merge takes at least one cache")
    first = caches[0]
    family = _family(first)
    kind, params = kind_of(first, family), parameters(first, family)
    for cache in caches:
        _row_count(cache)
        if kind_of(cache, _family(cache)) != kind or _family(cache) is not family:
            raise ValueError(f"merge joins caches of one kind: {kind} and {type(cache).__name__}")
        if parameters(cache, family) != params or cache.signature() != first.signature():
            raise ValueError(
                f"merge joins caches of one layout: {first.signature()} {params} and "
                f"{cache.signature()} {parameters(cache, family)}"
            )
        if cache.layout._replace(batch=0) != first.layout._replace(batch=0):
            raise ValueError(f"merge joins caches of one layout: {first.layout} and {cache.layout}")
    states = [cache.state() for cache in caches]
    xp = _xp(first)
    lying = {(s.offset, s.ring_index, s.arrays[0].shape[2], s.left_padding) for s in states}
    if len(lying) == 1 and not states[0].left_padding:
        arrays = tuple(
            xp.concatenate(list(slot), axis=0)
            for slot in zip(*(s.arrays for s in states), strict=True)
        )
        reusable = max(s.minimum_reusable_offset for s in states)
        return _restored(first, replace(states[0], arrays=arrays, minimum_reusable_offset=reusable))
    keep = getattr(_storage(first), "keep", 0)
    if keep:
        raise ValueError(
            f"merge joins rings keeping {keep} positions only at one offset, ring index and "
            f"buffer length (rows of their own lengths need keep 0); got {sorted(lying, key=str)}"
        )
    return _restored(first, _aligned_state(states, xp, first.sliding_window))


def extend(cache: Cache, other: Cache) -> None:
    """ROWS-3: append the rows of `other` after `cache`'s, in place; as `merge`, and
    nothing changes when it raises."""
    merged = merge([cache, other])
    cache.restore_state(merged.state())


def clone_caches(caches: Sequence[Cache]) -> list[Cache]:
    """ROWS-4: new caches holding what `caches` hold (states, CACHE-8); later appends to
    either do not reach the other."""
    return [_restored(cache, cache.state()) for cache in caches]


def clone_single_row_state(caches: Sequence[Cache]) -> list[Cache]:
    """ROWS-4 (the seeds' `cloneSingleRowState`): row 0 of every cache, each as a new
    single-row cache; empty caches are cloned empty."""
    return [
        extract_row(cache, 0) if cache.layout is not None else _restored(cache, cache.state())
        for cache in caches
    ]


def minimum_reusable_offset(caches: Sequence[Cache]) -> int:
    """ROWS-4: the shortest prefix every cache can reuse: the largest minimum reusable
    offset (B16F-4), 0 for no caches."""
    return max((cache.minimum_reusable_offset for cache in caches), default=0)
