"""The order in which READ-7's kernels read an MLX storage's live rows (`_row_order`: the
ordered variant's inputs, keep and each batch row's padding, the turn and the oldest
position), held against the
positions the buffer rows hold, written into the keys themselves: mapped as
decode_attention.cuh's RowOrder maps them (`kernel_rows`), the rows a batch row reads hold
its own positions (ROWS-6), each once, oldest first, after any sequence of window appends,
decodes and trims of a ring of any keep, padded or not, or of growable storage. The kernels
themselves are held to the same order by test_decode_step.py (emulated in every run)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.backend import Backend


def kernel_rows(order: object, rows: int, b: int) -> list[int]:
    """The buffer rows the kernels read for batch row b of `rows` live rows, in the order
    they read them: with an order (`attention_kernels.RowsOrder`), hidden = min(rows,
    max(0, padding - oldest)) and live row t is temporal row u = hidden + t, at buffer
    row u below keep and at keep + (u - keep + turn) mod (rows - keep) from there on;
    without one, buffer rows 0 .. rows - 1."""
    if order is None:
        return list(range(rows))
    keep, padding = int(order.order[0].item()), int(order.order[1 + b].item())
    turn, oldest = int(order.turn.item()), int(order.oldest.item())
    hidden = min(rows, max(0, padding - oldest))
    read = []
    for t in range(rows - hidden):
        u = hidden + t
        read.append(u if u < keep else keep + (u - keep + turn) % (rows - keep))
    return read


@st.composite
def storages(draw: st.DrawFn) -> tuple[int | None, int, list[int]]:
    """A ring's max_size and keep (None: growable storage) and each batch row's padding."""
    if draw(st.booleans()):
        return None, 0, [0, draw(st.integers(0, 40))]
    max_size = draw(st.integers(1, 24))
    keep = draw(st.integers(0, max_size - 1))
    padding = [0, draw(st.integers(0, 12))] if keep == 0 and draw(st.booleans()) else [0]
    return max_size, keep, padding


operations = st.lists(
    st.tuples(st.sampled_from(["window", "decode", "decode", "trim"]), st.integers(1, 30)),
    max_size=12,
)


@given(storage=storages(), prefill=st.integers(1, 50), ops=operations)
def test_the_kernels_read_each_rows_positions_oldest_first(
    backend: Backend, storage: tuple[int | None, int, list[int]], prefill: int, ops: list
) -> None:
    import mlx.core as mx

    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's reads on its kernels")
    max_size, keep, padding = storage
    caches = backend.module("caches")
    ring = max_size is not None
    cache = caches.RotatingKVCache(max_size, keep=keep) if ring else caches.KVCache()
    if any(padding):
        cache.prepare(left_padding=padding)

    def append(n: int) -> None:
        """n positions whose keys hold their position (float32: exact)."""
        positions = mx.arange(cache.offset, cache.offset + n, dtype=mx.float32)
        keys = mx.broadcast_to(positions[None, None, :, None], (len(padding), 1, n, 8))
        if n == 1:
            cache.append_decode(keys, keys)
        else:
            cache.append_window(keys, keys)

    append(max(padding) + prefill + 1)
    for op, n in [*ops, ("decode", 1)]:
        if op == "window":
            append(n + 1)
        elif op == "trim":
            if cache.is_trimmable():
                cache.trim(n)
        else:
            append(1)
            live = cache._live_rows()
            held = np.array(cache._fields[0][0, 0, :live, 0]).astype(int)
            order = cache._row_order(live)
            for b, pad in enumerate(padding):
                read = kernel_rows(order, live, b)
                own = np.sort(held[held >= pad])
                assert held[read].tolist() == own.tolist(), (held.tolist(), b)
