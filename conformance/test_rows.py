"""Rows of caches (ROWS-1 .. ROWS-4): each row of a batch against a cache given that row
alone, merges and filters against each other, clones, and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.cache_machine import assert_same_state, random_kv, run_machine
from kvspec.conformance.compare import assert_same_bits
from kvspec.conformance.persistence_vectors import GOLDEN_CACHES
from kvspec.conformance.rows_machine import RowsMachine, stored_window
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
    # The parameters alone (two starts, neither converted), then the signature alone (one
    # start, one row converted).
    earlier = _filled(family, lambda m: m.Bf16FirstQuantizedKVCache(32, 4, 50), 1, [3])
    with pytest.raises(ValueError, match="one layout"):
        rows.merge([plain, earlier])
    not_yet = _filled(family, lambda m: m.Bf16FirstQuantizedKVCache(32, 4, 3), 1, [2])
    with pytest.raises(ValueError, match="one layout"):
        rows.merge([not_yet, converted])
    rows.extend(plain, _filled(family, lambda m: m.Bf16FirstQuantizedKVCache(32, 4, 100), 1, [3]))
    assert (plain.layout.batch, plain.converted) == (2, False)


def test_a_merge_takes_the_shortest_prefix_every_row_can_reuse(backend) -> None:
    """ROWS-3, ROWS-5 over B16F-4: rows converted at different offsets. At one offset the
    merge takes the largest minimum reusable offset; of different offsets the largest
    r_b + M - o_b, in buffer positions."""
    family, rows = backend.module("caches"), backend.module("rows")

    def converted(lengths: list[int]):
        return _filled(family, lambda m: m.Bf16FirstQuantizedKVCache(32, 4, 3), 1, lengths)

    late, early, longer = converted([2, 2]), converted([3, 1]), converted([3, 1, 1])
    offsets = [(c.state().offset, c.state().minimum_reusable_offset) for c in (late, early, longer)]
    assert offsets == [(4, 4), (4, 3), (5, 3)]
    assert rows.merge([early, late]).state().minimum_reusable_offset == 4
    # late: 4 + 5 - 4 = 5; longer: 3 + 5 - 5 = 3.
    assert rows.merge([longer, late]).state().minimum_reusable_offset == 5


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
    run_machine(backend, padded_kinds(), RowsMachine, max_length=7)


def _rows_of(family, factory, lengths, head_dim: int = 64, seed: int = 0):
    """Single-row caches of `lengths` positions each, float16 input."""
    caches = []
    for b, n in enumerate(lengths):
        k, v = random_kv(seed + b, (1, 2, n, head_dim), head_dim, FLOAT_DTYPES["float16"])
        cache = factory(family)
        cache.update_and_fetch(family_array(family, k), family_array(family, v))
        caches.append(cache)
    return caches


@given(kind=padded_kinds(), lengths=st.lists(st.integers(1, 9), min_size=2, max_size=4))
def test_merge_then_extract_is_the_identity(backend, kind, lengths) -> None:
    """ROWS-8, ROWS-9: rows of different lengths merged, then extracted: each row's own
    fields bit for bit (a ring: its window, oldest first); padding zero fields."""
    factory, head_dim = kind
    family, rows = backend.module("caches"), backend.module("rows")
    singles = _rows_of(family, factory, lengths, head_dim)
    singles = [c for c in singles if c.signature() == singles[0].signature()]
    merged = rows.merge(singles)
    merged.check_invariants()
    offsets = tuple(c.offset for c in singles)
    assert merged.row_offsets == offsets
    assert merged.offset == max(offsets)
    window = merged.sliding_window
    for b, single in enumerate(singles):
        row = rows.extract_row(merged, b)
        assert row.left_padding == (0,) and row.signature() == single.signature()
        if window is None:
            assert_same_state(_numpy_state_cache(single, backend), row, backend)
            padding = merged.left_padding[b]
            for array in merged.state().arrays:
                assert not backend.to_numpy(array)[b, :, :padding].view(np.uint8).any()
        else:
            pairs = zip(
                stored_window(_numpy_state_cache(row, backend).state(), window),
                stored_window(_numpy_state_cache(single, backend).state(), window),
                strict=True,
            )
            for got, want in pairs:
                assert_same_bits(got, want, "ring window")


def test_padded_batch_edges(backend) -> None:
    """ROWS-5 .. ROWS-7 by hand: per-row offsets, padding hidden from a decode, trims by
    the shortest row, filters that drop padding no row needs, a compiled step refused."""
    family, rows = backend.module("caches"), backend.module("rows")
    short, long, middle = _rows_of(family, lambda m: m.QuantizedKVCache(32, 4), [1, 4, 2])
    batch = rows.merge([short, long, middle])
    assert (batch.offset, batch.left_padding, batch.row_offsets) == (4, (3, 0, 2), (1, 4, 2))
    k = family_array(family, np.full((3, 2, 1, 64), 0.5, np.float16))
    queries = family_array(family, np.ones((3, 2, 1, 64), np.float16))
    together = backend.to_numpy(batch.append_decode(k, k).attend(queries, 0.125))
    alone = backend.to_numpy(short.append_decode(k[:1], k[:1]).attend(queries[:1], 0.125))
    np.testing.assert_allclose(together[:1], alone, rtol=1e-3, atol=1e-3)
    assert batch.trim(5) == 2 and batch.row_offsets == (0, 3, 1)
    kept = rows.filter_rows(batch, [2, 1])
    assert (kept.offset, kept.left_padding, kept.row_offsets) == (3, (2, 0), (1, 3))
    assert rows.filter_rows(batch, [2]).left_padding == (0,)
    with pytest.raises(ValueError, match="rows of one length"):
        batch.prepare_decode_step()
    with pytest.raises(ValueError, match="hold no position"):
        family.capture_donor_rows(batch)


def test_padded_restore_refusals(backend) -> None:
    """ROWS-5, ROWS-10: inconsistent padding is refused by restore_state, nothing changed."""
    from dataclasses import replace

    family, rows = backend.module("caches"), backend.module("rows")
    batch = rows.merge(_rows_of(family, lambda m: m.KVCache(), [1, 3]))
    state = batch.state()
    for padding, match in [
        ((2,), "one count per row"),
        ((4, 0), "lie in"),
        ((1, 1), "leave a row"),
    ]:
        with pytest.raises(ValueError, match=match):
            batch.restore_state(replace(state, left_padding=padding))
        assert batch.left_padding == (2, 0)
    ring = family.RotatingKVCache(4, keep=1)
    ring.update_and_fetch(*(family_array(family, np.ones((2, 1, 3, 32), np.float16)),) * 2)
    with pytest.raises(ValueError, match="keep 0"):
        ring.restore_state(replace(ring.state(), left_padding=(1, 0)))
    assert ring.left_padding == (0, 0)


def test_bf16_first_batch_switches_as_one(backend) -> None:
    """ROWS-7: a bf16-first batch converts when its longest row is due; the shorter row
    converts with it, its minimum reusable offset in its own positions."""
    family, rows = backend.module("caches"), backend.module("rows")
    factory = lambda m: m.Bf16FirstQuantizedKVCache(32, 4, 5)  # noqa: E731
    batch = rows.merge(_rows_of(family, factory, [1, 4]))
    assert not batch.converted
    k = family_array(family, np.ones((2, 2, 1, 64), np.float16))
    batch.update_and_fetch(k, k)
    assert batch.converted and batch.minimum_reusable_offset == 5
    short = rows.extract_row(batch, 0)
    assert (short.converted, short.offset, short.minimum_reusable_offset) == (True, 2, 2)


def test_padded_batch_files_and_donor_rows(backend, tmp_path) -> None:
    """ROWS-10: a padded batch saved as format version 2 loads back bit for bit on either
    backend; donor rows carry per-row offsets and starts, padding first."""
    import json

    from kvspec.reference import persistence as reference_persistence

    family, rows = backend.module("caches"), backend.module("rows")
    persistence = backend.module("persistence")
    batch = rows.merge(_rows_of(family, lambda m: m.RotatingKVCache(3), [2, 5]))
    assert batch.left_padding == (3, 0)
    path = tmp_path / "padded.safetensors"
    persistence.save_caches(path, [batch])
    header = reference_persistence.read_header(str(path))
    document = json.loads(header.metadata["kvspec"])
    assert document["version"] == 2 and document["caches"][0]["left_padding"] == [3, 0]
    for loader in (persistence, reference_persistence):
        loaded = loader.load_caches(path).caches[0]
        assert loaded.left_padding == (3, 0)
        assert_same_state(_numpy_state_cache(batch, backend), loaded, backend)
    donor = family.capture_donor_rows(batch)
    assert (donor.offsets, donor.starts, donor.ends) == ((2, 5), (0, 2), (2, 5))
    assert donor.keys.shape[2] == 3
    # DONOR-2: each drafter row attends over its own donor positions only.
    singles = _rows_of(family, lambda m: m.RotatingKVCache(3), [2, 5])
    queries = np.random.default_rng(7).standard_normal((2, 4, 3, 64)).astype(np.float16)
    together = backend.to_numpy(
        family.capture_donor_attention(batch).attend(family_array(family, queries), 0.125)
    )
    for b, single in enumerate(singles):
        read = family.capture_donor_attention(single)
        alone = backend.to_numpy(read.attend(family_array(family, queries[b : b + 1]), 0.125))
        np.testing.assert_allclose(together[b : b + 1], alone, rtol=2e-3, atol=2e-3)
    (first,) = rows.clone_single_row_state([batch])
    assert (first.offset, first.left_padding) == (2, (0,))


def test_prepared_padding(backend) -> None:
    """ROWS-11 by hand: a left-padded first append; what cannot be honoured raises
    ValueError and changes nothing."""
    family, rows = backend.module("caches"), backend.module("rows")
    prompt = np.random.default_rng(3).standard_normal((2, 2, 4, 64)).astype(np.float16)
    k = family_array(family, prompt)
    cache = family.QuantizedKVCache(32, 4)
    for bad in ([], [1, 2], [-1, 0]):
        with pytest.raises(ValueError, match="one count"):
            cache.prepare(left_padding=bad)
    with pytest.raises(ValueError, match="keep 0"):
        family.RotatingKVCache(4, keep=1).prepare(left_padding=[2, 0])
    cache.prepare(left_padding=[3, 0])
    for wrong in (k[:1], k[:, :, :2]):
        with pytest.raises(ValueError, match="prepared left padding"):
            cache.update_and_fetch(wrong, wrong)
        assert cache.layout is None and cache.offset == 0
    queries = family_array(family, np.ones((2, 2, 4, 64), np.float16))
    out = backend.to_numpy(cache.append_window(k, k).attend(queries, 0.125))
    assert np.isfinite(out).all()
    assert (cache.left_padding, cache.row_offsets) == ((3, 0), (1, 4))
    alone = family.QuantizedKVCache(32, 4)
    alone.update_and_fetch(k[:1, :, 3:], k[:1, :, 3:])
    assert_same_state(_numpy_state_cache(alone, backend), rows.extract_row(cache, 0), backend)
    with pytest.raises(ValueError, match="holding nothing"):
        cache.prepare(left_padding=[0, 0])


def test_restore_drops_prepared_padding(backend) -> None:
    """ROWS-11: a state restored over a prepared cache replaces the prepared counts too."""
    family = backend.module("caches")
    k = family_array(family, np.ones((2, 1, 3, 32), np.float16))
    for make in (family.KVCache, lambda: family.RotatingKVCache(4)):
        source, cache = make(), make()
        source.update_and_fetch(k, k)
        cache.prepare(left_padding=[2, 0])
        cache.restore_state(source.state())
        cache.update_and_fetch(k, k)
        assert cache.left_padding == (0, 0)


@pytest.mark.parametrize(
    "appends", [[1] * 3, [1] * 4, [1] * 5, [1] * 11, [3, 1, 1], [6, 1, 1, 1], [2, 5, 1]]
)
def test_ring_positions_names_the_position_each_row_holds(appends: list[int]) -> None:
    """ROWS-6's `ring_positions`: a ring of 4 (keep 0) whose every key holds its own
    position holds, at each live row, the position `ring_positions` gives, before and after
    it wraps and after a span's append (RING-3) leaves more rows than max_size."""
    ring = reference.RotatingKVCache(4)
    offset = 0
    for length in appends:
        positions = np.arange(offset, offset + length, dtype=np.float32)
        keys = np.broadcast_to(positions[None, None, :, None], (1, 1, length, 32)).copy()
        if length > 1:
            ring.append_window(keys, keys)
        else:
            ring.append_decode(keys, keys)
        offset += length
        held = ring.state().arrays[0][0, 0, :, 0]
        named = reference.rotating.ring_positions(ring.offset, ring.ring_index, ring.length)
        assert np.array_equal(held[: len(named)], named.astype(np.float32)), (held, named)


@pytest.mark.parametrize("kind", ["KVCache", "RotatingKVCache"])
def test_a_prepared_padding_takes_a_first_append_as_long_as_its_largest_count(
    backend, kind: str
) -> None:
    """ROWS-11: the first append after `prepare` has at least max(counts) positions: one
    fewer is refused and changes nothing; as many is taken, a row all padding."""
    cache = getattr(backend.module("caches"), kind)(*([8] if kind == "RotatingKVCache" else []))
    cache.prepare(left_padding=[0, 3])
    k, v = random_kv(0, (2, 1, 3, 32), 32, FLOAT_DTYPES["bfloat16"])
    with pytest.raises(ValueError, match="the prepared left padding"):
        cache.append_window(backend.from_numpy(k[:, :, :2]), backend.from_numpy(v[:, :, :2]))
    assert cache.offset == 0 and cache.state().arrays == ()
    cache.append_window(backend.from_numpy(k), backend.from_numpy(v))
    assert cache.offset == 3 and cache.left_padding == (0, 3)


@pytest.mark.parametrize("kind", ["KVCache", "RotatingKVCache"])
def test_a_padding_query_sees_its_own_key_alone(backend, kind: str) -> None:
    """ROWS-11: in the first append after `prepare`, a query at a padding position sees
    only its own key, so it reads that key's value; the row's own queries see
    their causal keys from the row's first position on, none of its padding."""
    cache = getattr(backend.module("caches"), kind)(*([8] if kind == "RotatingKVCache" else []))
    cache.prepare(left_padding=[0, 2])
    k, v = random_kv(5, (2, 1, 4, 32), 32, FLOAT_DTYPES["float32"])
    queries = random_kv(6, (2, 1, 4, 32), 32, FLOAT_DTYPES["float32"])[0]
    read = cache.append_window(backend.from_numpy(k), backend.from_numpy(v))
    out = backend.to_numpy(read.attend(backend.from_numpy(queries), 32**-0.5))
    for position in (0, 1):
        np.testing.assert_allclose(out[1, 0, position], v[1, 0, position], rtol=1e-6)
    alone = reference.KVCache()
    own = alone.append_window(k[1:, :, 2:], v[1:, :, 2:]).attend(queries[1:, :, 2:], 32**-0.5)
    np.testing.assert_allclose(out[1:, :, 2:], own, rtol=1e-5, atol=1e-6)
