"""mlx-lm's caches as the oracle of the reference (FACTS 5): KVCache, QuantizedKVCache,
RotatingKVCache, the masks, and the generate loop's bf16-to-quantized conversion. Skipped
where mlx-lm is not installed; the rest of the cache suite does not need it."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from kvspec.conformance.cache_machine import appends, random_kv, ring_operations, starts
from kvspec.conformance.compare import assert_same_bits
from kvspec.reference import caches as reference
from kvspec.reference.dtypes import BFLOAT16

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
# CACHE-3's edges: appends of a step less one, a whole step and a step and one, from offsets
# on a step boundary and off it.
@example(
    ops=[("append", 255), ("append", 1), ("append", 256), ("trim", 3), ("append", 257)], seed=0
)
@example(ops=[("append", 256), ("append", 255), ("append", 2)], seed=1)
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


@given(
    ops=ring_operations,
    seed=st.integers(0, 2**32 - 1),
    max_size=st.integers(1, 9),
    keep=st.integers(0, 3),
    window=st.one_of(st.none(), st.integers(1, 9)),
)
def test_rotating_kv_cache_equals_mlx_lm(ops, seed, max_size, keep, window) -> None:
    """RING-2 .. RING-5, MASK-3: offsets, ring index and fetches equal mlx-lm's, and masks
    too wherever mlx-lm's are right: with keep 0, or before the ring holds max_size
    positions (MASK-3 departs from mlx-lm's with keep > 0 after that)."""
    from kvspec.accelerated.dtypes import to_numpy

    keep = min(keep, max_size - 1)
    ours = reference.RotatingKVCache(max_size, keep)
    theirs = mlx_lm_cache.RotatingKVCache(max_size, keep)
    for step, (op, n) in enumerate(ops):
        if op == "trim":
            if not theirs.is_trimmable():
                assert not ours.is_trimmable()
                continue
            assert ours.trim(n) == theirs.trim(n)
            continue
        length = n if op == "append" else 1
        ours_mask = ours.make_mask(length, window)
        their_mask = theirs.make_mask(length, window_size=window)
        if keep == 0 or ours.offset + length <= max_size:
            if isinstance(their_mask, mx.array):
                assert_same_bits(ours_mask, to_numpy(their_mask), f"step {step} mask")
            else:
                assert ours_mask == their_mask
        k, v = random_kv(seed + step, (1, 1, length, 32), 32, BFLOAT16)
        keys, values = ours.update_and_fetch(k, v)
        their_keys, their_values = theirs.update_and_fetch(mx.array(k), mx.array(v))
        assert_same_bits(keys, to_numpy(their_keys), f"step {step} keys")
        assert_same_bits(values, to_numpy(their_values), f"step {step} values")
        assert (ours.offset, ours.ring_index) == (theirs.offset, theirs._idx)


@given(lengths=appends, start=starts, seed=st.integers(0, 2**32 - 1))
def test_equals_mlx_lm_generate_conversion(lengths, start, seed) -> None:
    """B16F-2: mlx-lm's generate loop (KVCache, to_quantized once offset >= start after a
    forward, QuantizedKVCache after) stores the same fields (on MLX's CPU kernel)."""
    from kvspec.accelerated.dtypes import to_numpy

    ours = reference.Bf16FirstQuantizedKVCache(64, 4, start)
    theirs = mlx_lm_cache.KVCache()
    for step, length in enumerate(lengths):
        k, v = random_kv(seed + step, (1, 2, length, 64), 64, BFLOAT16)
        ours.update_and_fetch(k, v)
        with mx.stream(mx.cpu):
            theirs.update_and_fetch(mx.array(k), mx.array(v))
            if isinstance(theirs, mlx_lm_cache.KVCache) and theirs.offset >= start:
                theirs = theirs.to_quantized(group_size=64, bits=4)
        assert ours.converted == isinstance(theirs, mlx_lm_cache.QuantizedKVCache)
        if ours.converted:
            fields = ours.state().arrays
            for slot, field in enumerate((*theirs.keys, *theirs.values)):
                assert_same_bits(fields[slot], to_numpy(field[:, :, : ours.offset]), f"slot {slot}")
