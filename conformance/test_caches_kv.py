"""KVCache and QuantizedKVCache (CACHE-1 .. CACHE-9, QKV-1, QKV-2): the stateful machine
against the reference, and mlx-lm's caches as the oracle of the reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.bounds import affine_read_bound
from kvspec.conformance.cache_machine import random_kv, run_machine
from kvspec.conformance.compare import assert_same_bits
from kvspec.reference import caches as reference
from kvspec.reference.dtypes import BFLOAT16

kv_kinds = st.sampled_from([32, 64]).map(lambda d: (lambda m: m.KVCache(), d, None))


@st.composite
def quantized_kinds(draw: st.DrawFn):
    bits = draw(st.sampled_from([2, 3, 4, 5, 6, 8]))
    group_size = draw(st.sampled_from([32, 64]))
    head_dim = group_size * draw(st.sampled_from([1, 2]))
    return (lambda m: m.QuantizedKVCache(group_size, bits), head_dim, group_size)


def test_kv_cache_machine(backend) -> None:
    run_machine(backend, kv_kinds)


def test_quantized_kv_cache_machine(backend) -> None:
    run_machine(backend, quantized_kinds())


mx = pytest.importorskip("mlx.core")
mlx_lm_cache = pytest.importorskip("mlx_lm.models.cache")


def _to_numpy(x):
    from kvspec.accelerated.dtypes import to_numpy

    return to_numpy(x)


operations = st.lists(
    st.tuples(st.sampled_from(["append", "append", "trim"]), st.integers(1, 300)),
    min_size=1,
    max_size=8,
)


@given(ops=operations, seed=st.integers(0, 2**32 - 1))
def test_kv_cache_equals_mlx_lm(ops, seed) -> None:
    """CACHE-3, CACHE-5: offsets, capacity (growth by 256) and fetches equal mlx-lm's."""
    ours, theirs = reference.KVCache(), mlx_lm_cache.KVCache()
    for step, (op, n) in enumerate(ops):
        if op == "trim":
            assert ours.trim(n) == theirs.trim(n)
            continue
        k, v = random_kv(seed + step, (1, 2, n, 32), 32, BFLOAT16)
        keys, values = ours.update_and_fetch(k, v)
        their_keys, their_values = theirs.update_and_fetch(mx.array(k), mx.array(v))
        assert_same_bits(keys, _to_numpy(their_keys), f"step {step} keys")
        assert_same_bits(values, _to_numpy(their_values), f"step {step} values")
        assert ours.capacity == theirs.keys.shape[2]
        assert ours.offset == theirs.offset


def _mlx_lm_handles(head_dim: int, bits: int) -> bool:
    """mlx-lm sizes a row as head_dim // (32 // bits) words (FACTS 5)."""
    return head_dim // (32 // bits) == head_dim * bits // 32


@given(
    ops=operations,
    seed=st.integers(0, 2**32 - 1),
    bits=st.sampled_from([2, 3, 4, 5, 6, 8]),
    group_size=st.sampled_from([32, 64]),
    head_dim=st.sampled_from([64, 128]),
)
def test_quantized_kv_cache_equals_mlx_lm(ops, seed, bits, group_size, head_dim) -> None:
    """QKV-1: stored fields equal mlx-lm's (on MLX's CPU kernel) wherever mlx-lm runs."""
    ours = reference.QuantizedKVCache(group_size, bits)
    theirs = mlx_lm_cache.QuantizedKVCache(group_size, bits)
    for step, (op, n) in enumerate(ops):
        if op == "trim":
            assert ours.trim(n) == theirs.trim(n)
            continue
        k, v = random_kv(seed + step, (1, 2, n, head_dim), head_dim, BFLOAT16)
        ours.update_and_fetch(k, v)
        if not _mlx_lm_handles(head_dim, bits):
            with pytest.raises(ValueError):
                theirs.update_and_fetch(mx.array(k), mx.array(v))
            return
        with mx.stream(mx.cpu):
            their_keys, their_values = theirs.update_and_fetch(mx.array(k), mx.array(v))
        fields = ours.state().arrays
        for slot, theirs_field in enumerate((*their_keys, *their_values)):
            assert_same_bits(
                fields[slot], _to_numpy(theirs_field[:, :, : ours.offset]), f"slot {slot}"
            )
        assert ours.offset == theirs.offset


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


@given(
    n=st.integers(1, 6),
    offset=st.integers(0, 12),
    window=st.one_of(st.none(), st.integers(1, 10)),
)
def test_full_attention_masks_equal_mlx_lm(backend, n, offset, window) -> None:
    """MASK-2: as boolean matrices, the backend's masks equal mlx-lm's
    `create_attention_mask` (which returns an array whenever a window is given)."""
    from kvspec.reference.caches.masks import mask_matrix

    def as_matrix(mask):
        if isinstance(mask, mx.array):
            mask = _to_numpy(mask)
        elif mask is not None and not isinstance(mask, str):
            mask = backend.to_numpy(mask)
        return mask_matrix(mask, n, offset + n)

    ours = backend.module("caches.masks").make_mask(n, offset, window)
    theirs = mlx_lm_cache.create_attention_mask(n, offset, False, window)
    assert_same_bits(as_matrix(ours), as_matrix(theirs), "mask")
