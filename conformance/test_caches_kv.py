"""KVCache and QuantizedKVCache (CACHE-1 .. CACHE-9, QKV-1, QKV-2): the stateful machine
against the reference, and mlx-lm's caches as the oracle of the reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st

from kvspec.conformance.bounds import affine_read_bound
from kvspec.conformance.cache_machine import random_kv, run_machine
from kvspec.reference.dtypes import BFLOAT16

kv_kinds = st.sampled_from([32, 64]).map(lambda d: (lambda m: m.KVCache(), d, None))


@st.composite
def quantized_kinds(draw: st.DrawFn):
    bits = draw(st.sampled_from([2, 3, 4, 5, 6, 8]))
    group_size = draw(st.sampled_from([32, 64, 128]))
    head_dim = group_size * draw(st.sampled_from([1, 2]))
    return (lambda m: m.QuantizedKVCache(group_size, bits), head_dim, group_size)


def test_kv_cache_machine(backend) -> None:
    run_machine(backend, kv_kinds)


def test_quantized_kv_cache_machine(backend) -> None:
    run_machine(backend, quantized_kinds())


@pytest.mark.parametrize("bits", [5, 6])
def test_widths_mlx_lm_cannot_store_at_head_dim_128(backend, bits) -> None:
    """QKV-1: bits 5 and 6 at head_dim 128 store 20 and 24 words per row and read back."""
    k, v = random_kv(bits, (1, 2, 3, 128), 128, BFLOAT16)
    cache = backend.module("caches").QuantizedKVCache(64, bits)
    keys, _ = cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    words, scales = (backend.to_numpy(a) for a in cache.state().arrays[:2])
    assert words.shape == (1, 2, 3, 128 * bits // 32)
    error = np.abs(backend.to_numpy(keys).astype(np.float64) - k.astype(np.float64))
    assert np.all(error <= affine_read_bound(k, scales, bits, 64))


@pytest.mark.parametrize("side", ["keys", "values"])
def test_an_append_of_another_rank_is_refused(backend, side: str) -> None:
    """CACHE-2: keys and values are each [B, H, L, D]; one of them [B, H, L] (its first
    three axes still the other's) is refused, and the cache holds nothing."""
    for cache in (backend.module("caches").KVCache(), backend.module("caches").QuantizedKVCache()):
        k, v = random_kv(1, (1, 2, 3, 64), 64, BFLOAT16)
        if side == "keys":
            k = k[..., 0]
        else:
            v = v[..., 0]
        with pytest.raises(ValueError, match=r"must be \[B, H, L, D\]"):
            cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
        assert cache.offset == 0
