"""bf16-first caches (B16F-1 .. B16F-6): the stateful machine against the reference, the
convert-after path bit for bit, and mlx-lm's generate-loop conversion as the oracle."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.cache_machine import appends, random_kv, ring_sizes, run_machine, starts
from kvspec.conformance.compare import assert_same_bits
from kvspec.reference import caches as reference
from kvspec.reference.dtypes import BFLOAT16


@st.composite
def bf16_first_kinds(draw: st.DrawFn):
    bits = draw(st.sampled_from([2, 3, 4, 5, 6, 8]))
    group_size = draw(st.sampled_from([32, 64, 128]))
    start = draw(starts)

    def factory(m):
        return m.Bf16FirstQuantizedKVCache(group_size, bits, start)

    return (factory, group_size, group_size)


@st.composite
def bf16_first_rotating_kinds(draw: st.DrawFn):
    bits = draw(st.sampled_from([2, 4, 8]))
    max_size = draw(ring_sizes)
    start = draw(starts)

    def factory(m):
        return m.Bf16FirstRotatingQuantizedKVCache(max_size, 32, bits, start)

    return (factory, 32, 32)


kv4_kinds = starts.map(lambda start: (lambda m: m.Bf16FirstKv4Head256Cache(start), 256, 64))


def test_bf16_first_quantized_machine(backend) -> None:
    run_machine(backend, bf16_first_kinds())


def test_bf16_first_rotating_quantized_machine(backend) -> None:
    run_machine(backend, bf16_first_rotating_kinds(), max_length=11)


def test_bf16_first_kv4_head256_machine(backend) -> None:
    run_machine(backend, kv4_kinds)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda m: m.Bf16FirstQuantizedKVCache(64, 4, -1), "start must be >= 0, got -1"),
        (lambda m: m.Bf16FirstQuantizedKVCache(64, 7, 8), "bits must be one of"),
        (lambda m: m.Bf16FirstQuantizedKVCache(48, 4, 8), "group_size must be one of"),
        (lambda m: m.Bf16FirstRotatingQuantizedKVCache(0, 64, 4, 8), "max_size must be at least 1"),
        (lambda m: m.Bf16FirstRotatingQuantizedKVCache(16, 64, 9, 8), "bits must be one of"),
        (lambda m: m.Bf16FirstRotatingQuantizedKVCache(16, 64, 4, -2), "start must be >= 0"),
        (lambda m: m.Bf16FirstKv4Head256Cache(-1), "start must be >= 0"),
        (lambda m: m.Bf16FirstTurboQuantKVCache(9, 4, 8), "k_bits must be one of"),
        (lambda m: m.Bf16FirstTurboQuantKVCache(8, 4, -1), "start must be >= 0"),
        (lambda m: m.Bf16FirstQuantizedKVCache(64, 4, 8, checks="lazy"), "checks must be one of"),
    ],
    ids=lambda value: value if isinstance(value, str) else "",
)
def test_a_kind_checks_both_storages_parameters_when_made(backend, make, message: str) -> None:
    """B16F-2: a bf16-first kind rejects its parameters when made, those of the storage it
    converts to with them, not at the append that would first make that storage."""
    with pytest.raises(ValueError, match=message):
        make(backend.module("caches"))


def test_transition_due() -> None:
    """B16F-1: due at offset >= start, never while empty."""
    assert not reference.transition_due(0, 0)
    assert reference.transition_due(1, 0)
    assert not reference.transition_due(4, 5)
    assert reference.transition_due(5, 5)


@given(lengths=appends, start=starts, seed=st.integers(0, 2**32 - 1), trim=st.integers(0, 9))
def test_equals_convert_after(lengths, start, seed, trim) -> None:
    """B16F-2: stored fields equal storing bf16 and converting the whole window once due,
    bit for bit, and so does every fetch; trimming below start never converts back."""
    cache = reference.Bf16FirstQuantizedKVCache(32, 4, start)
    plain: reference.KVCache | reference.QuantizedKVCache = reference.KVCache()
    for step, length in enumerate(lengths):
        k, v = random_kv(seed + step, (1, 2, length, 32), 32, BFLOAT16)
        assert cache.max_append_tokens() == (
            start - plain.offset
            if isinstance(plain, reference.KVCache) and plain.offset < start
            else math.inf
        )
        fetched = cache.update_and_fetch(k, v)
        expected = plain.update_and_fetch(k, v)
        if isinstance(plain, reference.KVCache) and reference.transition_due(plain.offset, start):
            offset = plain.offset
            plain = plain.to_quantized(32, 4)
            if start > 0:
                plain.minimum_reusable_offset = offset
        for name, a, e in zip(("keys", "values"), fetched, expected, strict=True):
            assert_same_bits(a, e, f"step {step} {name}")
        state, want = cache.state(), plain.state()
        assert (state.signature, state.offset) == (want.signature, want.offset)
        assert state.minimum_reusable_offset == want.minimum_reusable_offset
        for slot, (a, e) in enumerate(zip(state.arrays, want.arrays, strict=True)):
            assert_same_bits(a, e, f"step {step} slot {slot}")
    was_converted = cache.converted
    cache.trim(trim)
    assert cache.converted == was_converted


@given(lengths=appends, start=starts, seed=st.integers(0, 2**32 - 1))
def test_rotating_committed_is_one_decode_per_position(lengths, start, seed) -> None:
    """READ-4: the rotating bf16-first committed read equals decoding each position."""
    spans = reference.Bf16FirstRotatingQuantizedKVCache(4, 32, 4, start)
    decodes = reference.Bf16FirstRotatingQuantizedKVCache(4, 32, 4, start)
    for step, length in enumerate(lengths):
        k, v = random_kv(seed + step, (1, 1, length, 32), 32, BFLOAT16)
        q = random_kv(seed + step + 7, (1, 2, length, 32), 32, BFLOAT16)[0]
        together = spans.append_committed(k, v).attend(q, 0.25)
        apart = [
            decodes.append_decode(k[:, :, i : i + 1], v[:, :, i : i + 1]).attend(
                q[:, :, i : i + 1], 0.25
            )
            for i in range(length)
        ]
        assert_same_bits(together, np.concatenate(apart, axis=2), f"step {step}")
        for a, e in zip(spans.state().arrays, decodes.state().arrays, strict=True):
            assert_same_bits(a, e, f"step {step} state")


def test_kv4_rejects_other_head_dims(backend) -> None:
    """B16F-3: a head_dim the converted storage does not take is rejected up front."""
    cache = backend.module("caches").Bf16FirstKv4Head256Cache(8)
    k, v = random_kv(0, (1, 1, 2, 128), 128, BFLOAT16)
    with pytest.raises(ValueError, match="head_dim 256"):
        cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    assert cache.offset == 0 and cache.state().arrays == ()


@pytest.mark.parametrize(("k_dim", "v_dim"), [(128, 128), (256, 128), (128, 256)])
def test_kv4_refuses_other_head_dims_in_an_append_or_a_state(backend, k_dim, v_dim) -> None:
    """B16F-3, B16F-6: keys or values of another head_dim than 256, either alone, are
    refused by an append and by a restored state, and leave the cache as it was; 256 for
    both is taken."""
    caches = backend.module("caches")
    k = random_kv(0, (1, 1, 2, k_dim), k_dim, BFLOAT16)[0]
    v = random_kv(1, (1, 1, 2, v_dim), v_dim, BFLOAT16)[0]
    plain = caches.KVCache()
    plain.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    cache = caches.Bf16FirstKv4Head256Cache(8)
    with pytest.raises(ValueError, match="takes head_dim 256"):
        cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    with pytest.raises(ValueError, match="takes head_dim 256"):
        cache.restore_state(plain.state())
    assert cache.offset == 0 and cache.state().arrays == ()
    k, v = (random_kv(2, (1, 1, 2, 256), 256, BFLOAT16)[0] for _ in range(2))
    plain = caches.KVCache()
    plain.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    cache.restore_state(plain.state())
    assert cache.offset == 2


def test_first_window_reads_refuse_after_the_switch(backend) -> None:
    """READ-6: bidirectional and encoder reads need the first window."""
    cache = backend.module("caches").Bf16FirstQuantizedKVCache(32, 4, 0)
    k, v = random_kv(1, (1, 1, 3, 32), 32, BFLOAT16)
    mask = backend.from_numpy(np.eye(3, dtype=bool))
    cache.append_bidirectional(backend.from_numpy(k), backend.from_numpy(v), mask)
    assert cache.converted
    cache.trim(3)
    for read in (cache.append_bidirectional, cache.append_encoder_window):
        with pytest.raises(ValueError, match="first window"):
            read(backend.from_numpy(k), backend.from_numpy(v), mask)


def test_a_bidirectional_mask_is_bool_of_the_windows_length(backend) -> None:
    """READ-6: the mask is bool [L, L]; another dtype alone, or another shape alone, is
    refused before anything is appended."""
    cache = backend.module("caches").Bf16FirstQuantizedKVCache(32, 4, 0)
    k, v = random_kv(1, (1, 1, 3, 32), 32, BFLOAT16)
    for bad in (np.eye(3, dtype=np.int32), np.eye(3, 4, dtype=bool)):
        with pytest.raises(ValueError, match="bidirectional must be bool"):
            cache.append_bidirectional(
                backend.from_numpy(k), backend.from_numpy(v), backend.from_numpy(bad)
            )
        assert cache.offset == 0 and not cache.converted
