"""Rows of caches (ROWS-1 .. ROWS-4): each row of a batch against a cache given that row
alone, merges and filters against each other, clones, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.cache_machine import assert_same_state, random_kv
from kvspec.conformance.persistence_vectors import GOLDEN_CACHES
from kvspec.conformance.rows_machine import run_rows_machine
from kvspec.reference import caches as reference
from kvspec.reference.dtypes import FLOAT_DTYPES


@given(
    kind=st.sampled_from(sorted(GOLDEN_CACHES)),
    batch=st.integers(2, 3),
    lengths=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    dtype=st.sampled_from(sorted(FLOAT_DTYPES)),
    seed=st.integers(0, 2**16),
)
def test_rows_are_the_caches_of_their_own(backend, kind, batch, lengths, dtype, seed) -> None:
    """ROWS-1 .. ROWS-3: row b of a batch is, bit for bit, the cache given row b alone,
    before and after one more append; merging the rows gives the batch back; a filter is
    the merge of its rows."""
    factory, head_dim = GOLDEN_CACHES[kind]
    rows = backend.module("rows")
    dtype = FLOAT_DTYPES[dtype]
    batched = factory(backend.module("caches"))
    alone = [factory(reference) for _ in range(batch)]
    inputs = [
        random_kv(seed + s, (batch, 2, n, head_dim), head_dim, dtype) for s, n in enumerate(lengths)
    ]
    for k, v in inputs:
        batched.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
        for b, cache in enumerate(alone):
            cache.update_and_fetch(k[b : b + 1], v[b : b + 1])
    extracted = [rows.extract_row(batched, b) for b in range(batch)]
    for b in range(batch):
        assert_same_state(alone[b], extracted[b], backend)
    merged = rows.merge(extracted)
    assert_same_state(_numpy_state_cache(batched, backend), merged, backend)
    picked = [batch - 1, 0, batch - 1]
    assert_same_state(
        _numpy_state_cache(rows.merge([extracted[b] for b in picked]), backend),
        rows.filter_rows(batched, picked),
        backend,
    )
    k, v = random_kv(seed + 99, (1, 2, 1, head_dim), head_dim, dtype)
    alone[0].update_and_fetch(k, v)
    extracted[0].update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    assert_same_state(alone[0], extracted[0], backend)


class _Snapshot:
    """A state taken once, in NumPy arrays: the expected side of `assert_same_state`."""

    def __init__(self, state, backend) -> None:
        arrays = tuple(backend.to_numpy(a) for a in state.arrays)
        self._state = type(state)(
            state.signature, arrays, state.offset, state.ring_index, state.minimum_reusable_offset
        )

    def state(self):
        return self._state


def _numpy_state_cache(cache, backend) -> _Snapshot:
    return _Snapshot(cache.state(), backend)


def _filled(family, factory, batch: int, lengths, head_dim: int = 64):
    cache = factory(family)
    for step, n in enumerate(lengths):
        k, v = random_kv(step, (batch, 2, n, head_dim), head_dim, FLOAT_DTYPES["float16"])
        cache.update_and_fetch(family_array(family, k), family_array(family, v))
    return cache


def family_array(family, a: np.ndarray):
    """`a` as an array of `family`'s backend."""
    return family.KVCache.xp.array(a)


def test_refusals(backend) -> None:
    """ROWS-2, ROWS-3: what cannot be honoured raises ValueError and changes nothing."""
    family, rows = backend.module("caches"), backend.module("rows")
    affine = _filled(family, lambda m: m.QuantizedKVCache(32, 4), 2, [3])
    with pytest.raises(ValueError, match="out of range"):
        rows.extract_row(affine, 2)
    with pytest.raises(ValueError, match="at least one row"):
        rows.filter_rows(affine, [])
    with pytest.raises(ValueError, match="no rows"):
        rows.extract_row(family.KVCache(), 0)
    with pytest.raises(ValueError, match="at least one cache"):
        rows.merge([])
    cases = {
        "one kind": _filled(family, lambda m: m.KVCache(), 1, [3]),
        "one layout": _filled(family, lambda m: m.QuantizedKVCache(32, 8), 1, [3]),
    }
    for match, other in cases.items():
        with pytest.raises(ValueError, match=match):
            rows.merge([affine, other])
        before = affine.state()
        with pytest.raises(ValueError, match=match):
            rows.extend(affine, other)
        assert_same_state(_Snapshot(before, backend), affine, backend)
    kept = _filled(family, lambda m: m.RotatingKVCache(4, keep=1), 1, [3])
    with pytest.raises(ValueError, match="keep 0"):
        rows.merge([kept, _filled(family, lambda m: m.RotatingKVCache(4, keep=1), 1, [2])])
    head_dims = _filled(family, lambda m: m.QuantizedKVCache(32, 4), 1, [3], head_dim=128)
    with pytest.raises(ValueError, match="one layout"):
        rows.merge([affine, head_dims])
    plain = _filled(family, lambda m: m.Bf16FirstQuantizedKVCache(32, 4, 100), 1, [3])
    converted = _filled(family, lambda m: m.Bf16FirstQuantizedKVCache(32, 4, 3), 1, [3])
    with pytest.raises(ValueError, match="one layout"):
        rows.merge([plain, converted])
    rows.extend(plain, _filled(family, lambda m: m.Bf16FirstQuantizedKVCache(32, 4, 100), 1, [3]))
    assert (plain.layout.batch, plain.converted) == (2, False)


def test_clones_and_minimum_reusable_offset(backend) -> None:
    """ROWS-4: clones are independent; row 0 of each cache; the largest minimum offset."""
    family, rows = backend.module("caches"), backend.module("rows")
    caches = [
        _filled(family, lambda m: m.Bf16FirstQuantizedKVCache(32, 4, 3), 2, [2, 2]),
        _filled(family, lambda m: m.RotatingKVCache(3), 2, [2, 2]),
        family.KVCache(),
    ]
    assert rows.minimum_reusable_offset(caches) == 4
    assert rows.minimum_reusable_offset([]) == 0
    clones = rows.clone_caches(caches)
    single = rows.clone_single_row_state(caches)
    assert [c.layout.batch if c.layout else None for c in single] == [1, 1, None]
    k = family_array(family, np.ones((2, 2, 1, 64), np.float16))
    clones[1].update_and_fetch(k, k)
    assert (caches[1].offset, clones[1].offset) == (4, 5)
    assert_same_state(
        _numpy_state_cache(rows.extract_row(caches[0], 0), backend), single[0], backend
    )


@st.composite
def padded_kinds(draw: st.DrawFn):
    """Every storage kind that holds rows of their own lengths (rings with keep 0,
    ROWS-5), with its head_dim."""
    bits = draw(st.sampled_from([2, 3, 4, 8]))
    max_size = draw(st.integers(1, 6))
    start = draw(st.sampled_from([0, 3, 6]))
    kernels = draw(st.sampled_from(["dense", "deferred"]))
    kinds = {
        "kv": lambda m: m.KVCache(),
        "affine": lambda m: m.QuantizedKVCache(32, bits),
        "rotating": lambda m: m.RotatingKVCache(max_size),
        "rotating-affine": lambda m: m.RotatingQuantizedKVCache(max_size, 32, bits),
        "turboquant": lambda m: m.TurboQuantKVCache(8, 4, kernels),
        "bf16-first-affine": lambda m: m.Bf16FirstQuantizedKVCache(32, bits, start),
        "bf16-first-rotating-affine": lambda m: m.Bf16FirstRotatingQuantizedKVCache(
            max_size, 32, bits, start
        ),
        "bf16-first-turboquant": lambda m: m.Bf16FirstTurboQuantKVCache(4, 2, start, kernels),
    }
    return kinds[draw(st.sampled_from(sorted(kinds)))], 64


def test_rows_of_their_own_lengths_machine(backend) -> None:
    """ROWS-5 .. ROWS-10: merge, appends and reads, trims, filters, extends, files and
    donor rows of a padded batch, row by row against the models and single caches."""
    run_rows_machine(backend, padded_kinds())
