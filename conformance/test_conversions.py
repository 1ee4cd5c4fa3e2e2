"""Conversions (CACHE-9, QRING-2, TQC-3), case by case against the list model: a ring
converted at every ring index, and growable sources converted with room to spare, where
random machines reach those states too rarely to rely on."""

from __future__ import annotations

import pytest

from kvspec.conformance.cache_machine import assert_matches_model, fetch_is_exact, random_kv
from kvspec.conformance.oracles import AffineCodec, TurboQuantCodec, model_of
from kvspec.reference import caches as reference
from kvspec.reference.dtypes import BFLOAT16


def _append(backend, cache, model, seed: int, length: int, head_dim: int = 64) -> None:
    k, v = random_kv(seed, (1, 2, length, head_dim), head_dim, BFLOAT16)
    cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    model.append(k, v)


def _assert_matches(backend, model, cache) -> None:
    exact = fetch_is_exact(cache.signature(), backend)
    assert_matches_model(model, cache, backend.to_numpy, exact)


@pytest.mark.parametrize("max_size, keep", [(2, 0), (3, 1), (4, 0), (4, 2), (5, 1)])
def test_ring_to_quantized_at_every_ring_index(backend, max_size, keep) -> None:
    """CACHE-9, QRING-2: a ring converted after any number of decodes (wrapped or not,
    after a multi-position append or not) keeps its positions, offset and ring index; the
    next decode lands where the model says."""
    caches = backend.module("caches")
    for decodes in range(2 * max_size + 1):
        for first in (1, 3):
            ring = caches.RotatingKVCache(max_size, keep)
            model = model_of(reference.RotatingKVCache(max_size, keep))
            _append(backend, ring, model, 0, first)
            for step in range(decodes):
                _append(backend, ring, model, step + 1, 1)
            index = ring.ring_index
            converted = ring.to_quantized(32, 4)
            model = model.converted(AffineCodec(32, 4), "affine")
            assert converted.ring_index == index
            _assert_matches(backend, model, converted)
            _append(backend, converted, model, 99, 1)
            _assert_matches(backend, model, converted)


@pytest.mark.parametrize("length", [1, 5, 256, 300])
def test_growable_conversions_hold_exactly_the_window(backend, length) -> None:
    """CACHE-9, TQC-3: a conversion encodes rows 0 .. offset - 1 only (capacity = offset),
    whatever room the source had; a trimmed source included."""
    caches = backend.module("caches")
    targets = [
        (lambda c: c.to_quantized(64, 4), AffineCodec(64, 4), "affine"),
        (
            lambda c: caches.TurboQuantKVCache.from_kv_cache(c, 4, 3),
            TurboQuantCodec(4, 3, False),
            "turboquant",
        ),
    ]
    for convert, codec, kind in targets:
        source = caches.KVCache()
        model = model_of(reference.KVCache())
        _append(backend, source, model, length, length)
        assert source.trim(1) == model.trim(1)
        converted = convert(source)
        model = model.converted(codec, kind)
        assert converted.capacity == length - 1
        _assert_matches(backend, model, converted)
