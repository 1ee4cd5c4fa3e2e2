"""Donor reads: a target cache's keys and values lent to a drafter model (spec DONOR-1,
DONOR-2). Reads only: they append nothing and change no cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvspec.reference.caches.bf16_first import Bf16FirstCache
from kvspec.reference.caches.protocol import Cache, Read
from kvspec.reference.caches.rotating import RingStorage


@dataclass(frozen=True)
class DonorRows:
    """Decoded keys [B, H, T, Dk] and values [B, H, T, Dv] of the positions a next query of
    the cache would see, oldest first, and per row b: `offsets[b]` positions appended,
    and the positions held, [starts[b], ends[b]) (DONOR-1)."""

    keys: Any
    values: Any
    offsets: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]


def capture_donor_rows(cache: Cache) -> DonorRows:
    """DONOR-1: the decoded window of `cache` with its positions; ValueError for an empty
    cache, or a ring whose window is not one span (keep > 0 after an eviction)."""
    storage = cache.storage if isinstance(cache, Bf16FirstCache) else cache
    if storage.offset == 0:
        raise ValueError("donor rows of an empty cache: nothing was appended (or all trimmed)")
    window = storage.keys_and_values()
    assert window is not None
    keys, values = window
    offset = storage.offset
    if isinstance(storage, RingStorage):
        # The live buffer in temporal order (RING-3), then the last max_size positions:
        # the window a next query sees (RING-1).
        keys, values = storage._temporal_order((keys, values))
        held = min(offset, storage.max_size)
        if storage.keep > 0 and offset > storage.max_size:
            raise ValueError(
                f"a ring keeping {storage.keep} positions holds two spans once it evicted "
                f"(offset {offset} > max_size {storage.max_size}); donor rows are one span"
            )
        keys, values = keys[:, :, -held:], values[:, :, -held:]
    # Rows of their own lengths (ROWS-10): row b's positions are the last of the T held.
    T = keys.shape[2]
    offsets = storage.row_offsets
    empty = [b for b, row_offset in enumerate(offsets) if row_offset == 0]
    if empty:
        raise ValueError(f"donor rows of rows {empty}, which hold no position (all trimmed)")
    starts = tuple(row_offset - min(T, row_offset) for row_offset in offsets)
    return DonorRows(keys, values, offsets, starts, offsets)


def capture_donor_attention(cache: Cache) -> Read:
    """DONOR-2: the read a drafter attends with: its queries see every donor position of
    their row, no other mask (READ-1); a row's padding is hidden (ROWS-10)."""
    rows = capture_donor_rows(cache)
    storage = cache.storage if isinstance(cache, Bf16FirstCache) else cache
    if not any(storage.left_padding):
        return storage.dense_read(rows.keys, rows.values, None)
    T = rows.keys.shape[2]
    positions = np.arange(storage.offset - T, storage.offset)
    mask = storage.masks.padded_mask(None, 1, positions, np.array(storage.left_padding))
    return storage.dense_read(rows.keys, rows.values, mask)
