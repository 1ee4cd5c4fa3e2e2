"""Invariants stated across operations (CACHE-4, CACHE-5, RING-4, RING-5, TQC-1), on the
backend: a span appended at once equals the span in pieces where the spec says so, and
trimming then appending equals never having appended the trimmed positions."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.cache_machine import assert_matches_model, fetch_is_exact, random_kv
from kvspec.conformance.compare import assert_same_bits
from kvspec.conformance.oracles import model_of
from kvspec.reference import caches as reference
from kvspec.reference.dtypes import BFLOAT16

# (factory, head_dim): TurboQuant takes no head_dim below 64 (TQ-1).
growing = st.sampled_from(
    [
        (lambda m: m.KVCache(), 32),
        (lambda m: m.QuantizedKVCache(32, 4), 32),
        (lambda m: m.QuantizedKVCache(32, 6), 32),
        (lambda m: m.TurboQuantKVCache(4, 3), 64),
        (lambda m: m.TurboQuantKVCache(8, 2, "deferred"), 64),
    ]
)
rings = st.sampled_from(
    [(lambda m: m.RotatingKVCache(32), 32), (lambda m: m.RotatingQuantizedKVCache(32, 32, 3), 32)]
)
pieces = st.lists(st.integers(1, 5), min_size=1, max_size=5)


def _span(seed: int, length: int, head_dim: int = 32):
    return random_kv(seed, (1, 2, length, head_dim), head_dim, BFLOAT16)


def _fetch_equal(backend, a, b, what: str) -> None:
    for name, x, y in zip(
        ("keys", "values"), a.keys_and_values(), b.keys_and_values(), strict=True
    ):
        assert_same_bits(backend.to_numpy(x), backend.to_numpy(y), f"{what} {name}")


def _state_equal(backend, a, b, what: str) -> None:
    sa, sb = a.state(), b.state()
    assert (sa.offset, sa.ring_index) == (sb.offset, sb.ring_index)
    for slot, (x, y) in enumerate(zip(sa.arrays, sb.arrays, strict=True)):
        assert_same_bits(backend.to_numpy(x), backend.to_numpy(y), f"{what} slot {slot}")


def _assert_matches(backend, model, cache) -> None:
    """The cache against the independent model of its kind (oracles.py): the comparisons
    above hold the backend against itself, which cannot see a fault both sides share."""
    exact = fetch_is_exact(cache.signature(), backend)
    assert_matches_model(model, cache, backend.to_numpy, exact)


def _append_in_pieces(backend, cache, k: np.ndarray, v: np.ndarray, lengths) -> None:
    start = 0
    for length in lengths:
        piece = slice(start, start + length)
        cache.update_and_fetch(
            backend.from_numpy(k[:, :, piece]), backend.from_numpy(v[:, :, piece])
        )
        start += length


@given(make=growing, lengths=pieces, seed=st.integers(0, 2**32 - 1))
def test_growing_span_at_once_equals_pieces(backend, make, lengths, seed) -> None:
    """CACHE-4: positions are encoded one by one, so the split does not matter."""
    make, head_dim = make
    k, v = _span(seed, sum(lengths), head_dim)
    caches = backend.module("caches")
    once, split = make(caches), make(caches)
    once.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    _append_in_pieces(backend, split, k, v, lengths)
    _state_equal(backend, once, split, "state")
    model = model_of(make(reference))
    model.append(k, v)
    _assert_matches(backend, model, split)


@given(make=rings, lengths=pieces, seed=st.integers(0, 2**32 - 1))
def test_ring_span_at_once_equals_pieces_before_eviction(backend, make, lengths, seed) -> None:
    """RING-4: until max_size positions are held (here at most 25 of 32), the fetch does
    not depend on the split (the buffers may differ in unused length)."""
    make, _ = make
    k, v = _span(seed, sum(lengths))
    caches = backend.module("caches")
    once, split = make(caches), make(caches)
    once.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    _append_in_pieces(backend, split, k, v, lengths)
    assert once.offset == split.offset == once.ring_index == split.ring_index
    _fetch_equal(backend, once, split, "fetch")


@given(
    make=st.one_of(growing, rings),
    first=st.integers(1, 6),
    dropped=st.integers(1, 6),
    then=st.integers(1, 6),
    seed=st.integers(0, 2**32 - 1),
)
def test_trim_then_append_equals_never_appended(backend, make, first, dropped, then, seed) -> None:
    """CACHE-5, RING-5: trimming what was appended last, then appending, reads as if the
    trimmed positions had never been appended."""
    caches = backend.module("caches")
    make, head_dim = make
    a, b = _span(seed, first, head_dim), _span(seed + 1, dropped, head_dim)
    c = _span(seed + 2, then, head_dim)
    trimmed, direct = make(caches), make(caches)
    for cache, spans in ((trimmed, (a, b)), (direct, (a,))):
        for k, v in spans:
            cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    assert trimmed.trim(dropped) == dropped
    for cache in (trimmed, direct):
        cache.update_and_fetch(backend.from_numpy(c[0]), backend.from_numpy(c[1]))
    assert trimmed.offset == direct.offset
    _fetch_equal(backend, trimmed, direct, "fetch")
    model = model_of(make(reference))
    for k, v in (a, b):
        model.append(k, v)
    model.trim(dropped)
    model.append(*c)
    _assert_matches(backend, model, trimmed)


@pytest.mark.parametrize("read", ["append_decode", "append_window", "update_and_fetch"])
def test_an_append_encodes_its_positions_once(backend, read) -> None:
    """READ-2, READ-3: the append checks its input while it encodes it, so each append
    runs the codec once (an encode costs a pass and, on MLX, a host sync)."""
    caches = backend.module("caches")
    for cache in (caches.QuantizedKVCache(32, 4), caches.TurboQuantKVCache(4, 3)):
        calls = []
        encode = cache._encode
        cache._encode = lambda k, v, encode=encode, calls=calls: calls.append(1) or encode(k, v)
        k, v = random_kv(0, (1, 2, 1, 64), 64, BFLOAT16)
        getattr(cache, read)(backend.from_numpy(k), backend.from_numpy(v))
        assert len(calls) == 1, f"{type(cache).__name__}.{read} encoded {len(calls)} times"


def _ring_after(backend, appends: int, keep: int):
    """A RotatingKVCache(4, keep) after `appends` one-position appends."""
    ring = backend.module("caches").RotatingKVCache(4, keep)
    k, v = _span(0, 1)
    for _ in range(appends):
        ring.append_decode(backend.from_numpy(k), backend.from_numpy(v))
    return ring


#: A ring's state with one RING-1 invariant broken: (appends, keep, attribute, value, message).
BROKEN_RINGS = {
    "empty with an offset": (0, 0, "offset", 1, "empty ring holds positions"),
    "empty with a ring index": (0, 0, "_index", 1, "empty ring holds positions"),
    "ring index past the buffer": (6, 1, "_index", 5, "ring index 5 > length 4"),
    "ring index off the offset before max_size": (2, 0, "_index", 1, "ring index 1 != offset 2"),
    "ring index below keep once full": (6, 2, "_index", 1, "ring index 1 < keep 2"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_RINGS))
def test_a_ring_with_an_invariant_broken_fails_its_check(backend, broken: str) -> None:
    """RING-1: `check_invariants`, which every cache machine step runs, rejects each
    invariant broken alone; a check that let one through would pass a wrong ring."""
    appends, keep, attribute, value, message = BROKEN_RINGS[broken]
    ring = _ring_after(backend, appends, keep)
    ring.check_invariants()
    setattr(ring, attribute, value)
    with pytest.raises(AssertionError, match=message):
        ring.check_invariants()


def test_a_ring_at_the_edges_of_its_invariants_passes_its_check(backend) -> None:
    """RING-1's bounds are inclusive where it says so: once offset reaches max_size the ring
    index may be keep itself (the next append wraps there), and need not equal the offset."""
    ring = _ring_after(backend, 4, 2)
    ring._index = 2
    ring.check_invariants()


@pytest.mark.parametrize(
    ("attribute", "message"),
    [("offset", "empty storage holds positions"), ("_layout", "empty storage holds positions")],
)
def test_an_empty_growable_storage_holding_anything_fails_its_check(
    backend, attribute: str, message: str
) -> None:
    """CACHE-3: storage with no fields holds no offset and no layout."""
    donor = backend.module("caches").KVCache()
    k, v = _span(0, 1)
    donor.append_decode(backend.from_numpy(k), backend.from_numpy(v))
    cache = backend.module("caches").KVCache()
    setattr(cache, attribute, getattr(donor, attribute))
    with pytest.raises(AssertionError, match=message):
        cache.check_invariants()


#: A padded batch's left padding with one ROWS-5 invariant broken, and the check's message.
BROKEN_PADDING = {
    "a count too many": ((0, 3, 1), "is not one per row"),
    "no row unpadded": ((1, 2), "leaves no row unpadded"),
    "past the offset": ((0, 4), "exceeds the offset"),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_PADDING))
def test_a_padded_batch_with_a_broken_padding_fails_its_check(backend, broken: str) -> None:
    """ROWS-5: one count per row, at most the offset, one row unpadded; a prepared padding
    whose largest count is the first append's whole length is a batch (ROWS-11)."""
    padding, message = BROKEN_PADDING[broken]
    cache = backend.module("caches").KVCache()
    cache.prepare(left_padding=[0, 3])
    k, v = random_kv(0, (2, 1, 3, 32), 32, BFLOAT16)
    cache.append_window(backend.from_numpy(k), backend.from_numpy(v))
    assert cache.left_padding == (0, 3)
    cache.check_invariants()
    cache._left_padding = padding
    with pytest.raises(AssertionError, match=message):
        cache.check_invariants()
