"""Masks, case by case (MASK-1 .. MASK-3): small matrices written out by hand, every
one-query window of small rings against the list model, where random machines reach the
wrapped cases too rarely to rely on, and ring masks with keep against the positions
written."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.cache_machine import random_kv
from kvspec.conformance.oracles import model_of, temporal, visible_matrix
from kvspec.reference import caches as reference
from kvspec.reference.dtypes import BFLOAT16


def _matrix(backend, mask, n: int, t: int) -> np.ndarray:
    return visible_matrix(mask, n, t, backend.to_numpy)


def test_causal_mask_by_hand(backend) -> None:
    """MASK-1: query i sees key j iff offset + i >= j and offset + i < j + window."""
    masks = backend.module("caches.masks")
    expected = np.array(
        [
            [0, 1, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 0, 1, 1],
        ],
        bool,
    )
    got = backend.to_numpy(masks.create_causal_mask(3, 2, 2))
    np.testing.assert_array_equal(got, expected)
    no_window = backend.to_numpy(masks.create_causal_mask(2, 1))
    np.testing.assert_array_equal(no_window, [[1, 1, 0], [1, 1, 1]])


@pytest.mark.parametrize("window", [None, 1, 2, 3, 8])
@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("offset", [0, 1, 2, 5])
def test_full_attention_masks(backend, offset, n, window) -> None:
    """MASK-2: as a matrix, the causal mask of positions offset .. offset + n - 1 within
    `window`; None only when it hides nothing, one query included (the seeds' rule drops
    the window there)."""
    cache = backend.module("caches").KVCache()
    if offset:
        k, v = random_kv(offset, (1, 1, offset, 32), 32, BFLOAT16)
        cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    query = offset + np.arange(n)[:, None]
    key = np.arange(offset + n)[None, :]
    expected = (key <= query) & ((query - key < window) if window else True)
    mask = cache.make_mask(n, window)
    np.testing.assert_array_equal(_matrix(backend, mask, n, offset + n), expected)
    # The form MASK-2 names: "causal" lets attention take its causal path.
    if n == 1 and (window is None or offset < window):
        assert mask is None
    elif window is None or offset + n <= window:
        assert isinstance(mask, str) and mask == "causal"
    else:
        assert not isinstance(mask, str) and mask is not None


@pytest.mark.parametrize("max_size", [2, 3, 4, 5])
@pytest.mark.parametrize("lengths", [(1,) * 11, (3, 1, 1, 1, 1, 1, 1), (2, 1, 4, 1, 1, 1, 1, 1)])
def test_ring_one_query_windows(backend, max_size, lengths) -> None:
    """MASK-3: before each one-position append to a ring (keep 0), `make_mask(1, window)`
    shows, in ring order, exactly the last `window` positions the ring holds after it."""
    caches = backend.module("caches")
    ring = caches.RotatingKVCache(max_size)
    model = model_of(reference.RotatingKVCache(max_size))
    for step, length in enumerate(lengths):
        k, v = random_kv(step, (1, 1, length, 32), 32, BFLOAT16)
        masks = [ring.make_mask(1, window) for window in range(1, max_size)]
        ring.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
        model.append(k, v)
        if length > 1:
            continue
        held = len(model.held)
        for window, mask in enumerate(masks, start=1):
            by_slot = _matrix(backend, mask, 1, held).T[None, None]
            in_order = temporal(by_slot, ring.ring_index, 0)[0, 0, :, 0]
            expected = np.arange(held) >= held - window
            np.testing.assert_array_equal(in_order, expected, err_msg=f"step {step} w {window}")


def _fetched_positions(backend, ring, start: int, length: int) -> np.ndarray:
    """Append positions start .. start + length - 1, each key and value holding its own
    position, and return the position of every row of the fetch, in ring order."""
    column = np.arange(start, start + length, dtype=np.float32)[None, None, :, None]
    k = np.broadcast_to(column, (1, 1, length, 32)).copy()
    keys, _ = ring.update_and_fetch(backend.from_numpy(k), backend.from_numpy(k))
    return backend.to_numpy(keys)[0, 0, :, 0].astype(int)


@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=10),
    max_size=st.integers(1, 9),
    keep=st.integers(0, 8),
)
def test_ring_masks_against_positions_written(backend, lengths, max_size, keep) -> None:
    """MASK-3 on rings with any keep, before every append and for every window up to one
    past max_size: keys carry their positions, so the fetch names the position of every
    mask column. The ring holds the first `keep` positions written and the most recent
    ones (a plain list); query p sees the held positions j <= p that are within the
    window of it, or without a window, exactly those a ring that received every position
    by one-position appends holds right after p (RING-2)."""
    keep = min(keep, max_size - 1)
    caches = backend.module("caches")
    ring, decoded = caches.RotatingKVCache(max_size, keep), caches.RotatingKVCache(max_size, keep)
    windows = [None, *range(1, max_size + 2)]
    written: list[int] = []
    held_after: list[set[int]] = []
    for length in lengths:
        offset = len(held_after)
        for position in range(offset, offset + length):
            held_after.append(set(_fetched_positions(backend, decoded, position, 1).tolist()))
        masks = [ring.make_mask(length, window) for window in windows]
        rows = _fetched_positions(backend, ring, offset, length).tolist()
        if len(written) >= max_size:
            written = written[:keep] + written[len(written) - (max_size - 1 - keep) :]
        written += range(offset, offset + length)
        assert sorted(rows) == written
        for window, mask in zip(windows, masks, strict=True):
            expected = np.zeros((length, len(rows)), bool)
            for i, query in enumerate(range(offset, offset + length)):
                for column, key in enumerate(rows):
                    if window is None:
                        expected[i, column] = key in held_after[query]
                    else:
                        expected[i, column] = query - window < key <= query
            got = _matrix(backend, mask, length, len(rows))
            np.testing.assert_array_equal(got, expected, err_msg=f"rows {rows} window {window}")
            # MASK-3's forms: None for one query seeing every row, "causal" for more
            # queries exactly when query i sees rows 0 .. T - n + i.
            lower_right = np.tril(np.ones_like(expected), len(rows) - length)
            if length == 1:
                assert (mask is None) == bool(expected.all())
            else:
                is_causal = isinstance(mask, str) and mask == "causal"
                assert is_causal == np.array_equal(expected, lower_right), (rows, window)
