"""Masks, case by case (MASK-1 .. MASK-3): small matrices written out by hand, and every
one-query window of small rings against the list model, where random machines reach the
wrapped cases too rarely to rely on."""

from __future__ import annotations

import numpy as np
import pytest

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
    if mask is None:
        assert expected.all()


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
