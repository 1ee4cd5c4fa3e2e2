"""RotatingKVCache and RotatingQuantizedKVCache (RING-1 .. RING-6, QRING-1, QRING-2): the
stateful machine against the reference, mlx-lm's ring as the oracle of the reference,
and the quantized ring equal to quantizing the bf16 ring."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.cache_machine import (
    random_kv,
    ring_operations,
    ring_sizes,
    run_machine,
)
from kvspec.conformance.compare import assert_same_bits
from kvspec.reference import affine
from kvspec.reference import caches as reference
from kvspec.reference.dtypes import BFLOAT16


@st.composite
def rotating_kinds(draw: st.DrawFn):
    max_size = draw(ring_sizes)
    keep = draw(st.integers(0, max_size - 1))
    return (lambda m: m.RotatingKVCache(max_size, keep), draw(st.sampled_from([32, 64])), None)


@st.composite
def rotating_quantized_kinds(draw: st.DrawFn):
    max_size = draw(ring_sizes)
    keep = draw(st.integers(0, max_size - 1))
    bits = draw(st.sampled_from(affine.SUPPORTED_BITS))
    group_size = draw(st.sampled_from([32, 64, 128]))

    def factory(m):
        return m.RotatingQuantizedKVCache(max_size, group_size, bits, keep)

    return (factory, group_size * draw(st.sampled_from([1, 2])), group_size)


def test_rotating_kv_cache_machine(backend) -> None:
    run_machine(backend, rotating_kinds(), max_length=11)


def test_rotating_quantized_kv_cache_machine(backend) -> None:
    run_machine(backend, rotating_quantized_kinds(), max_length=11)


@given(
    ops=ring_operations,
    seed=st.integers(0, 2**32 - 1),
    max_size=st.integers(1, 9),
    keep=st.integers(0, 3),
    bits=st.sampled_from(affine.SUPPORTED_BITS),
)
def test_quantized_ring_equals_quantized_bf16_ring(ops, seed, max_size, keep, bits) -> None:
    """QRING-1: every live ring position of the affine ring equals quantizing the bf16
    ring's position, after every operation."""
    keep = min(keep, max_size - 1)
    plain = reference.RotatingKVCache(max_size, keep)
    ring = reference.RotatingQuantizedKVCache(max_size, 32, bits, keep)
    for step, (op, n) in enumerate(ops):
        if op == "trim":
            if not plain.is_trimmable():
                continue
            assert ring.trim(n) == plain.trim(n)
        else:
            k, v = random_kv(seed + step, (1, 2, n if op == "append" else 1, 32), 32, BFLOAT16)
            plain.update_and_fetch(k, v)
            ring.update_and_fetch(k, v)
        assert (ring.offset, ring.ring_index, ring.length) == (
            plain.offset,
            plain.ring_index,
            plain.length,
        )
        if plain.length == 0:
            assert ring.state().arrays == ()
            continue
        keys, values = plain.state().arrays
        live = min(plain.offset, plain.length)
        expected = (
            *affine.quantize(keys[:, :, :live], 32, bits),
            *affine.quantize(values[:, :, :live], 32, bits),
        )
        for slot, field in enumerate(ring.state().arrays):
            assert_same_bits(field[:, :, :live], expected[slot], f"step {step} slot {slot}")


@pytest.mark.xfail(
    strict=True,
    reason="MASK-3 (mlx-lm's rule) rolls the one-query window as if the write landed at "
    "slot 0 and through the keep slots; with keep > 0 it shows the kept position instead "
    "of the one just written",
)
def test_one_query_window_with_keep(backend) -> None:
    """MASK-3: a one-query read under a window of 1 sees the position it appends."""
    caches = backend.module("caches")
    ring = caches.RotatingKVCache(2, keep=1)
    for step, length in enumerate([3, 1]):
        k, v = random_kv(step, (1, 1, length, 32), 32, BFLOAT16)
        mask = ring.make_mask(length, 1)
        keys, _ = ring.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    visible = backend.to_numpy(mask) if mask is not None else np.ones(2, bool)
    newest = backend.to_numpy(keys)[:, :, visible]
    assert_same_bits(newest, k, "the key a one-query window of 1 sees")


@pytest.mark.parametrize(
    ("keep", "ring_index", "slots"), [(0, 4, [4, 5, 6, 7]), (1, 2, [0, 7, 5, 6])]
)
def test_a_full_ring_wraps_at_max_size(backend, keep: int, ring_index: int, slots) -> None:
    """RING-2 by hand: eight one-position appends to a ring of 4 fill slots 0 .. 3, then
    wrap to `keep` only when the index reaches max_size (keep 0: positions 4 .. 7 overwrite
    slots 0 .. 3; keep 1: slots 1 .. 3 cycle, position 7 lands in slot 1)."""
    cache = backend.module("caches").RotatingKVCache(4, keep)
    for position in range(8):
        k = np.full((1, 1, 1, 64), float(position), np.float32)
        cache.append_decode(backend.from_numpy(k), backend.from_numpy(k))
    keys = backend.to_numpy(cache.state().arrays[0])[0, 0, :, 0]
    assert cache.ring_index == ring_index
    assert keys.tolist() == [float(p) for p in slots]
