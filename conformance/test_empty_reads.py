"""A cache trimmed to offset 0 fetches zero rows, as the reference does (CACHE-3, CACHE-5)."""

from __future__ import annotations

import numpy as np
import pytest

from kvspec.conformance.backend import Backend
from kvspec.reference import caches

KINDS = {
    "kv": lambda c: c.KVCache(),
    "affine": lambda c: c.QuantizedKVCache(64, 4),
    "affine-deferred": lambda c: c.QuantizedKVCache(32, 3, checks="deferred"),
    "turbo": lambda c: c.TurboQuantKVCache(8, 4),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_cache_trimmed_to_zero_fetches_zero_rows(backend: Backend, kind: str) -> None:
    k = np.random.default_rng(0).standard_normal((1, 2, 3, 128)).astype(np.float32)
    ref = KINDS[kind](caches)
    acc = KINDS[kind](backend.module("caches"))
    ref.append_window(k, k)
    acc.append_window(backend.from_numpy(k), backend.from_numpy(k))
    assert ref.trim(3) == acc.trim(3) == 3
    want, got = ref.keys_and_values(), acc.keys_and_values()
    assert want is not None and got is not None
    for expected, actual in zip(want, got, strict=True):
        actual = backend.to_numpy(actual)
        assert actual.shape == expected.shape == (1, 2, 0, 128)
        assert actual.dtype == expected.dtype
