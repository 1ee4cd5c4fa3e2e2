"""TurboQuant caches (TQC-1 .. TQC-5, B16F-2): the stateful machines against the reference,
the convert-after path bit for bit, dense against deferred reads, growth, and bad input."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.conformance.bounds import FLOAT32_ROUNDOFF, attention_bound, deferred_attention_bound
from kvspec.conformance.cache_machine import assert_matches_model, random_kv, run_machine
from kvspec.conformance.compare import assert_same_bits
from kvspec.conformance.oracles import model_of
from kvspec.reference import caches as reference
from kvspec.reference import turboquant
from kvspec.reference.caches.turboquant import KERNELS
from kvspec.reference.dtypes import BFLOAT16

widths = st.tuples(
    st.sampled_from(turboquant.KEY_BITS),
    st.sampled_from(turboquant.VALUE_BITS),
    st.sampled_from(KERNELS),
    st.sampled_from(turboquant.HEAD_DIMS),
)
starts = st.sampled_from([0, 1, 5, 12])


def _turboquant_kind(params):
    k_bits, v_bits, kernels, head_dim = params
    return (lambda m: m.TurboQuantKVCache(k_bits, v_bits, kernels), head_dim, None)


def _bf16_first_kind(params):
    (k_bits, v_bits, kernels, head_dim), start = params
    return (lambda m: m.Bf16FirstTurboQuantKVCache(k_bits, v_bits, start, kernels), head_dim, None)


def test_turboquant_kv_cache_machine(backend) -> None:
    run_machine(backend, widths.map(_turboquant_kind))


def test_bf16_first_turboquant_machine(backend) -> None:
    run_machine(backend, st.tuples(widths, starts).map(_bf16_first_kind))


def _to_backend(backend, *arrays):
    return tuple(backend.from_numpy(a) for a in arrays)


appends = st.lists(
    st.tuples(st.integers(1, 9), st.sampled_from(["window", "decode"])), min_size=1, max_size=8
)


@given(steps=appends, start=starts, kernels=st.sampled_from(KERNELS), seed=st.integers(0, 2**32))
def test_bf16_first_equals_convert_after(backend, steps, start, kernels, seed) -> None:
    """B16F-2: stored fields and every read equal storing bf16 and converting the whole
    window once due (TurboQuantKVCache.from_kv_cache), bit for bit; trimming below start
    never converts back."""
    caches = backend.module("caches")
    cache = caches.Bf16FirstTurboQuantKVCache(4, 3, start, kernels)
    plain = caches.KVCache()
    for step, (length, read) in enumerate(steps):
        length = 1 if read == "decode" else length
        k, v = _to_backend(backend, *random_kv(seed + step, (1, 2, length, 64), 64, BFLOAT16))
        q = backend.from_numpy(random_kv(seed + step + 9, (1, 4, length, 64), 64, BFLOAT16)[0])
        method = "append_decode" if read == "decode" else "append_window"
        assert cache.max_append_tokens() == (
            start - plain.offset
            if isinstance(plain, caches.KVCache) and plain.offset < start
            else math.inf
        )
        got = getattr(cache, method)(k, v).attend(q, 0.125)
        want = getattr(plain, method)(k, v).attend(q, 0.125)
        if isinstance(plain, caches.KVCache) and caches.transition_due(plain.offset, start):
            offset = plain.offset
            plain = caches.TurboQuantKVCache.from_kv_cache(plain, 4, 3, kernels)
            if start > 0:
                plain.minimum_reusable_offset = offset
        assert_same_bits(backend.to_numpy(got), backend.to_numpy(want), f"step {step} read")
        state, expected = cache.state(), plain.state()
        assert (state.signature, state.offset) == (expected.signature, expected.offset)
        assert state.minimum_reusable_offset == expected.minimum_reusable_offset
        for slot, (a, e) in enumerate(zip(state.arrays, expected.arrays, strict=True)):
            assert_same_bits(backend.to_numpy(a), backend.to_numpy(e), f"step {step} slot {slot}")
    was_converted = cache.converted
    cache.trim(start + 9)
    assert cache.converted == was_converted


def _dense_deferred_tolerance(rotated_values: np.ndarray) -> np.ndarray:
    """TQC-4: |dense - deferred| on the reference, per query row [B, Hq, N, 1] for key
    heads repeated to query heads: (2 + 2 (log2 D + 1)(1 + 2^-24)) 2^-24 R."""
    D = rotated_values.shape[-1]
    R = np.linalg.norm(rotated_values.astype(np.float64), axis=-1).max(axis=-1)
    t = (math.log2(D) + 1) * FLOAT32_ROUNDOFF
    return (2 * FLOAT32_ROUNDOFF + 2 * t * (1 + FLOAT32_ROUNDOFF)) * R[:, :, None, None]


@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("v_bits", [2, 5])
def test_dense_and_deferred_reads_agree(backend, head_dim, v_bits) -> None:
    """TQC-4: the two kernel sets read the same storage within the stated tolerance on the
    reference; on the backend within it plus each read's bound around the reference."""
    ref = {kernels: reference.TurboQuantKVCache(8, v_bits, kernels) for kernels in KERNELS}
    caches = backend.module("caches")
    got = {kernels: caches.TurboQuantKVCache(8, v_bits, kernels) for kernels in KERNELS}
    for step, length in enumerate([13, 1, 1, 6]):
        k, v = random_kv(step, (1, 2, length, head_dim), head_dim, BFLOAT16)
        q = random_kv(step + 50, (1, 4, length, head_dim), head_dim, BFLOAT16)[0]
        scale = head_dim**-0.5
        reads = {kernels: ref[kernels].append_window(k, v) for kernels in KERNELS}
        outputs = {name: read.attend(q, scale).astype(np.float64) for name, read in reads.items()}
        deferred = reads["deferred"]
        tolerance = np.repeat(_dense_deferred_tolerance(deferred.rotated_values), 2, axis=1)
        assert np.all(np.abs(outputs["dense"] - outputs["deferred"]) <= tolerance)
        r = backend.attention_roundoff
        bound = attention_bound(q, reads["dense"].keys, reads["dense"].values, scale, r)
        bound = bound + deferred_attention_bound(
            q, deferred.keys, deferred.rotated_values, scale, r
        )
        backend_outputs = {
            kernels: backend.to_numpy(
                got[kernels]
                .append_window(*_to_backend(backend, k, v))
                .attend(backend.from_numpy(q), scale)
            ).astype(np.float64)
            for kernels in KERNELS
        }
        difference = np.abs(backend_outputs["dense"] - backend_outputs["deferred"])
        assert np.all(difference <= tolerance + bound), f"step {step}"


@settings(max_examples=20)
@given(lengths=st.lists(st.integers(1, 300), min_size=1, max_size=4), trim=st.integers(0, 300))
def test_growth_and_trim_follow_kv_cache(backend, lengths, trim) -> None:
    """TQC-1, CACHE-3: capacity grows in steps of 256 exactly as KVCache's; trim is always
    allowed."""
    caches = backend.module("caches")
    ours, plain = caches.TurboQuantKVCache(2, 2), caches.KVCache()
    model = model_of(reference.TurboQuantKVCache(2, 2))
    for step, length in enumerate(lengths):
        kv = random_kv(step, (1, 1, length, 64), 64, BFLOAT16)
        keys, values = ours.update_and_fetch(*_to_backend(backend, *kv))
        plain.update_and_fetch(*_to_backend(backend, *kv))
        model.append(*kv)
        assert (ours.offset, ours.capacity) == (plain.offset, plain.capacity)
        assert tuple(keys.shape) == tuple(values.shape) == (1, 1, plain.offset, 64)
        assert ours.is_trimmable()
        assert ours.trim(trim) == plain.trim(trim) == model.trim(trim)
        ours.check_invariants()
        # KVCache shares the growth code; the model states CACHE-3's rule on its own.
        assert_matches_model(model, ours, backend.to_numpy, fetch=True)


def _assert_rejected_unchanged(backend, cache, operation, match: str) -> None:
    before = cache.state()
    with pytest.raises(ValueError, match=match):
        operation()
    after = cache.state()
    assert (after.signature, after.offset) == (before.signature, before.offset)
    for a, b in zip(after.arrays, before.arrays, strict=True):
        assert_same_bits(backend.to_numpy(a), backend.to_numpy(b), "unchanged")
    cache.check_invariants()


@pytest.mark.parametrize("make", ["TurboQuantKVCache", "Bf16FirstTurboQuantKVCache"])
def test_bad_input_raises_and_changes_nothing(backend, make) -> None:
    """TQC-1, B16F-3, CACHE-2: an unsupported head_dim (the message names the supported
    set), keys and values of different head dims, and a head_dim change mid-stream."""
    caches = backend.module("caches")
    cache = (
        getattr(caches, make)(8, 4, 3) if make.startswith("Bf16") else caches.TurboQuantKVCache()
    )

    def append(k_dim: int, v_dim: int, length: int = 2) -> None:
        k, v = random_kv(k_dim + v_dim, (1, 2, length, k_dim), v_dim, BFLOAT16)
        cache.append_window(*_to_backend(backend, k, v))

    for k_dim, v_dim, match in [
        (96, 96, r"one of \(64, 128, 256, 512\)"),
        (64, 128, "share one"),
    ]:
        _assert_rejected_unchanged(
            backend, cache, lambda k_dim=k_dim, v_dim=v_dim: append(k_dim, v_dim), match
        )
    append(64, 64, 4)
    assert cache.offset == 4
    _assert_rejected_unchanged(backend, cache, lambda: append(128, 128), "differs")
    _assert_rejected_unchanged(backend, cache, lambda: append(64, 128), "share one|differs")


def test_from_kv_cache_consumes_only_what_it_can_encode(backend) -> None:
    """TQC-3, CACHE-9: a window the format cannot hold raises before the source is
    consumed; a ring is no source; a converted cache keeps offset and reuse floor."""
    caches = backend.module("caches")
    source = caches.KVCache()
    k, v = random_kv(0, (1, 1, 5, 96), 96, BFLOAT16)
    source.update_and_fetch(*_to_backend(backend, k, v))
    with pytest.raises(ValueError, match="head_dim 96"):
        caches.TurboQuantKVCache.from_kv_cache(source, 8, 4)
    assert source.offset == 5 and len(source.state().arrays) == 2
    with pytest.raises(ValueError, match="takes a KVCache"):
        caches.TurboQuantKVCache.from_kv_cache(caches.RotatingKVCache(8), 8, 4)
    if backend.name != "reference":  # a cache of another backend is no source either
        with pytest.raises(ValueError, match="takes a KVCache of this backend"):
            caches.TurboQuantKVCache.from_kv_cache(reference.KVCache(), 8, 4)
    source = caches.KVCache()
    k, v = random_kv(1, (1, 1, 5, 64), 64, BFLOAT16)
    source.update_and_fetch(*_to_backend(backend, k, v))
    source.minimum_reusable_offset = 3
    converted = caches.TurboQuantKVCache.from_kv_cache(source, 8, 4, "deferred")
    assert (converted.offset, converted.minimum_reusable_offset, converted.kernels) == (
        5,
        3,
        "deferred",
    )
    assert source.offset == 0 and source.state().arrays == ()
    expected = turboquant.encode(k, v, 8, 4)
    for slot, name in enumerate(("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales")):
        array = backend.to_numpy(converted.state().arrays[slot])
        assert_same_bits(array, getattr(expected, name), name)


def test_restore_rejects_other_widths(backend) -> None:
    """TQC-5: a state's fields must be this cache's widths."""
    caches = backend.module("caches")
    cache = caches.TurboQuantKVCache(8, 4)
    k, v = random_kv(2, (1, 1, 3, 64), 64, BFLOAT16)
    cache.update_and_fetch(*_to_backend(backend, k, v))
    state = cache.state()
    other = caches.TurboQuantKVCache(4, 4)
    with pytest.raises(ValueError, match="not k4v4"):
        other.restore_state(replace(state, signature=other.signature()))
    assert other.offset == 0 and other.state().arrays == ()
