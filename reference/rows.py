"""Rows of caches: one sequence's row taken out of a batch, rows kept or joined, and
copies (spec ROWS-1 .. ROWS-4).

Every cache of chapter 5 holds B rows that share one offset, and every codec encodes
each row on its own, so a row's stored fields are the fields that row would have had in
a cache of its own. These functions work through states (CACHE-8): a new cache of the
same kind and parameters (PERSIST-5) restores the rows' arrays. They serve both backends:
a cache is rebuilt from the caches package its class belongs to.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvspec.reference.caches.bf16_first import Bf16FirstCache
from kvspec.reference.caches.protocol import Cache, CacheState
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


def _xp(cache: Cache) -> Any:
    """The array namespace of `cache`'s storage (a bf16-first cache holds one)."""
    return (cache.storage if isinstance(cache, Bf16FirstCache) else cache).xp


def _row_count(cache: Cache) -> int:
    layout = cache.layout
    if layout is None:
        raise ValueError("an empty cache holds no rows")
    return layout.batch


def filter_rows(cache: Cache, indices: Sequence[int]) -> Cache:
    """ROWS-2: a new cache of `cache`'s kind holding its rows `indices`, in that order;
    ValueError for no index or one out of range. `cache` is unchanged."""
    rows = _row_count(cache)
    picked = [int(i) for i in indices]
    if not picked:
        raise ValueError("filter_rows keeps at least one row")
    beyond = [i for i in picked if not 0 <= i < rows]
    if beyond:
        raise ValueError(f"rows {beyond} out of range for a cache of {rows} rows")
    state = cache.state()
    xp = _xp(cache)
    arrays = tuple(xp.take(a, xp.array(picked), axis=0) for a in state.arrays)
    return _restored(cache, replace(state, arrays=arrays))


def extract_row(cache: Cache, row: int) -> Cache:
    """ROWS-2: a new single-row cache holding row `row` of `cache`: bit for bit the cache
    that row would have been on its own."""
    return filter_rows(cache, [row])


def merge(caches: Sequence[Cache]) -> Cache:
    """ROWS-3: a new cache whose rows are the rows of `caches`, in order. The caches must
    be of one kind, parameters and signature and share offset, ring index, minimum
    reusable offset and layout but the batch; ValueError names the first difference."""
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
        if replace(cache.layout, batch=0) != replace(first.layout, batch=0):
            raise ValueError(f"merge joins caches of one layout: {first.layout} and {cache.layout}")
    states = [cache.state() for cache in caches]
    positions = {(s.offset, s.ring_index, s.minimum_reusable_offset) for s in states}
    if len(positions) > 1:
        raise ValueError(
            "merge joins rows of one offset, ring index and minimum reusable offset (rows of "
            f"their own lengths are not supported); got {sorted(positions, key=str)}"
        )
    lengths = {s.arrays[0].shape[2] for s in states}
    if len(lengths) > 1:
        raise ValueError(f"merge joins rings of one buffer length, got {sorted(lengths)}")
    arrays = tuple(
        _xp(first).concatenate(list(slot), axis=0)
        for slot in zip(*(s.arrays for s in states), strict=True)
    )
    return _restored(first, replace(states[0], arrays=arrays))


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
