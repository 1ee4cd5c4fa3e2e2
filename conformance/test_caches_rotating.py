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
from kvspec.conformance.oracles import visible_matrix
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


def _positions_as_keys(positions: range) -> np.ndarray:
    """Keys [1, 1, L, 64] whose every element is the position they are appended at, so a
    fetch names the position each row holds."""
    column = np.array(positions, np.float32)[None, None, :, None]
    return np.broadcast_to(column, (1, 1, len(positions), 64)).copy()


def _visible_positions(backend, cache, lengths: list[int], window: int | None) -> np.ndarray:
    """Append spans of `lengths` positions; for the last, which positions each query sees
    under `make_mask(L, window)` taken before it: bool [L, T] over the fetch's rows, and
    the rows' positions."""
    offset = 0
    for length in lengths:
        mask = cache.make_mask(length, window)
        k = _positions_as_keys(range(offset, offset + length))
        keys, _ = cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(k))
        offset += length
    rows = backend.to_numpy(keys)[0, 0, :, 0].astype(int)
    return visible_matrix(mask, length, rows.size, backend.to_numpy), rows


@pytest.mark.parametrize(
    ("max_size", "lengths", "window", "rows", "expected"),
    [
        # mlx-lm shows the kept position 0 instead of 3.
        (2, [3, 1], 1, [0, 3], [False, True]),
        # Position 4 lands in slot 1 (RING-2 wraps to keep); mlx-lm rolls as if it landed
        # in slot 0 and shows the kept position 0 and position 3.
        (4, [4, 1], 2, [0, 4, 2, 3], [False, True, False, True]),
    ],
)
def test_one_query_window_with_keep(backend, max_size, lengths, window, rows, expected) -> None:
    """MASK-3: a one-query read on a ring keeping 1 sees the last `window` positions,
    the one it appends among them, and the kept position only if it is one of them."""
    ring = backend.module("caches").RotatingKVCache(max_size, keep=1)
    visible, held = _visible_positions(backend, ring, lengths, window)
    assert held.tolist() == rows
    assert visible.tolist() == [expected]


@pytest.mark.parametrize(
    ("window", "expected"),
    [
        # The ring's own window: the kept position 0 and the last max_size - keep = 3.
        (None, [[1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 0], [1, 0, 0, 1, 1, 1]]),
        # A window of 2: the last two positions; the kept one only while among them.
        (2, [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]),
    ],
)
def test_span_window_with_keep(backend, window, expected) -> None:
    """MASK-3 by hand for several queries on a ring of 4 keeping 1: positions 3, 4, 5
    appended after 0, 1, 2. Without a window each query sees what a decode at its
    position would hold (mlx-lm's causal window of 4 over the rows hides the kept
    position 0 from queries 4 and 5 and shows position 1 to query 4 instead)."""
    ring = backend.module("caches").RotatingKVCache(4, keep=1)
    visible, rows = _visible_positions(backend, ring, [3, 3], window)
    assert rows.tolist() == [0, 1, 2, 3, 4, 5]
    assert visible.astype(int).tolist() == expected


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


@pytest.mark.parametrize(
    ("max_size", "keep", "message"),
    [
        (0, 0, "max_size must be at least 1, got 0"),
        (-2, 0, "max_size must be at least 1, got -2"),
        (4, -1, r"keep must be in \[0, max_size\), got -1"),
        (4, 4, r"keep must be in \[0, max_size\), got 4"),
        (1, 1, r"keep must be in \[0, max_size\), got 1"),
    ],
)
@pytest.mark.parametrize("kind", ["RotatingKVCache", "RotatingQuantizedKVCache"])
def test_a_ring_is_not_made_with_a_size_or_keep_it_cannot_hold(
    backend, kind: str, max_size: int, keep: int, message: str
) -> None:
    """RING-1: 1 <= max_size and 0 <= keep < max_size, checked when the ring is made."""
    with pytest.raises(ValueError, match=message):
        getattr(backend.module("caches"), kind)(max_size, keep=keep)


#: A ring kind by name, and the growable kind holding the same positions' fields.
RING_AND_GROWABLE = {
    "RotatingKVCache": (lambda m, n, keep: m.RotatingKVCache(n, keep), lambda m: m.KVCache()),
    "RotatingQuantizedKVCache": (
        lambda m, n, keep: m.RotatingQuantizedKVCache(n, 64, 4, keep),
        lambda m: m.QuantizedKVCache(64, 4),
    ),
}


@pytest.mark.parametrize(("max_size", "keep"), [(1, 0), (4, 3)])
@pytest.mark.parametrize("kind", sorted(RING_AND_GROWABLE))
def test_a_ring_takes_the_edges_of_its_size_and_keep(
    backend, kind: str, max_size: int, keep: int
) -> None:
    """RING-1's edges are rings: one position held, or every position but one kept. After
    seven one-position appends the buffer holds the kept positions and the newest one, in
    that order (RING-2), stored as the growable kind stores those positions."""
    make_ring, make_growable = RING_AND_GROWABLE[kind]
    ring = make_ring(backend.module("caches"), max_size, keep)
    k, v = random_kv(0, (1, 1, 7, 64), 64, BFLOAT16)
    for t in range(7):
        ring.append_decode(
            backend.from_numpy(k[:, :, t : t + 1]), backend.from_numpy(v[:, :, t : t + 1])
        )
    held = [*range(keep), 6]
    growable = make_growable(reference)
    growable.append_window(k[:, :, held], v[:, :, held])
    assert ring.offset == 7
    for got, want in zip(ring.state().arrays, growable.state().arrays, strict=True):
        assert_same_bits(backend.to_numpy(got), want, kind)
