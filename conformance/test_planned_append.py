"""The MLX storages' planned appends (accelerated/caches/planned.py): an append of the
shapes and layout the last checked append had runs that append's encode without its
checks. Held against twins that never plan, which check every append: the same stored
bits (on the CPU plain storage, the one whose encoder plans there; on CUDA every kind), the
same launches on the CUDA path with its kernels stood in, and every append the plan does
not take checked as before."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.backend import Backend

#: Storages, growable and rings, by name: a factory over the caches module.
KINDS = {
    "KVCache": lambda c: c.KVCache(),
    "RotatingKVCache": lambda c: c.RotatingKVCache(64, keep=4),
    "RotatingQuantizedKVCache 4-bit g64": lambda c: c.RotatingQuantizedKVCache(
        64, 64, 4, checks="deferred"
    ),
    "QuantizedKVCache 4-bit g64": lambda c: c.QuantizedKVCache(64, 4, checks="deferred"),
    "QuantizedKVCache 8-bit g32": lambda c: c.QuantizedKVCache(32, 8, checks="deferred"),
    "TurboQuantKVCache k8v4": lambda c: c.TurboQuantKVCache(8, 4, "dense", checks="deferred"),
    "TurboQuantKVCache k4v2 deferred": lambda c: c.TurboQuantKVCache(
        4, 2, "deferred", checks="deferred"
    ),
}


def mlx_only(backend: Backend) -> None:
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's planned appends")


def unplanned(cls: type) -> type:
    """A twin of cache class `cls` that never plans an append: every append is checked."""
    return type(f"Unplanned{cls.__name__}", (cls,), {"_append_encoder": lambda *_: None})


class Unplanned:
    """A caches module whose cache classes are their `unplanned` twins."""

    def __init__(self, caches: object) -> None:
        self.caches = caches

    def __getattr__(self, name: str) -> type:
        return unplanned(getattr(self.caches, name))


operations = st.lists(
    st.one_of(
        st.tuples(st.just("decode"), st.integers(1, 1)),
        st.tuples(st.just("window"), st.integers(1, 6)),
        st.tuples(st.just("trim"), st.integers(0, 8)),
        st.tuples(st.just("restore"), st.just(0)),
    ),
    min_size=1,
    max_size=40,
)


@pytest.mark.parametrize("kind", sorted(KINDS))
@given(prefill=st.integers(1, 300), ops=operations, decodes=st.integers(0, 24))
def test_planned_appends_store_what_checked_appends_store(
    backend: Backend, kind: str, prefill: int, ops: list, decodes: int
) -> None:
    """CACHE-3 on MLX: a cache that plans its appends and its twin that checks each one hold
    the same bits and offset after any sequence of appends, trims and restores, decode runs
    crossing the buffers' 256-row steps and the rings' wraps among them. Coded storages plan
    only where their encoders run on CUDA (fused_kernels_enabled): elsewhere the plain
    ones are held."""
    import mlx.core as mx

    from kvspec.accelerated.device import fused_kernels_enabled

    mlx_only(backend)
    if ("Quantized" in kind or "Turbo" in kind) and not fused_kernels_enabled():
        pytest.skip("coded storages plan where their encoders run on CUDA")
    caches = backend.module("caches")
    make = KINDS[kind]
    planned, checked = make(caches), make(Unplanned(caches))
    rng = np.random.default_rng(prefill)

    def kv(length: int) -> tuple[mx.array, mx.array]:
        k, v = rng.standard_normal((2, 1, 2, length, 128)).astype(np.float32)
        return mx.array(k).astype(mx.bfloat16), mx.array(v).astype(mx.bfloat16)

    steps = [("window", prefill), *ops, *[("decode", 1)] * decodes]
    for op, n in steps:
        if op == "decode":
            k, v = kv(1)
            for cache in (planned, checked):
                cache.append_decode(k, v)
        elif op == "window":
            k, v = kv(n)
            for cache in (planned, checked):
                cache.append_window(k, v)
        elif op == "trim":
            # A ring that has evicted positions cannot be trimmed (RING-5).
            assert planned.is_trimmable() == checked.is_trimmable()
            if planned.is_trimmable():
                assert planned.trim(n) == checked.trim(n)
        else:
            for cache in (planned, checked):
                cache.restore_state(cache.state())
        ours, theirs = planned.state(), checked.state()
        assert ours.offset == theirs.offset
        for a, b in zip(ours.arrays, theirs.arrays, strict=True):
            assert backend.to_numpy(a).tobytes() == backend.to_numpy(b).tobytes(), op
    planned.check()
    checked.check()
    assert planned._planned_append is not None


def test_an_append_the_plan_does_not_take_is_checked(backend: Backend) -> None:
    """CACHE-2 after planned appends: another dtype, another head dim, or the planned shapes
    into a storage restored with another layout (and room), raise as the checked path
    does, and change nothing."""
    import mlx.core as mx

    mlx_only(backend)
    caches = backend.module("caches")
    cache = caches.KVCache()
    row = mx.zeros((1, 2, 1, 64), mx.bfloat16)
    for _ in range(3):
        cache.append_decode(row, row)
    assert cache._planned_append is not None
    for k in (row.astype(mx.float16), mx.zeros((1, 2, 1, 32), mx.bfloat16)):
        with pytest.raises(ValueError, match="layout"):
            cache.append_decode(k, k)
        assert cache.offset == 3
    other = caches.KVCache()
    narrow = mx.zeros((1, 2, 5, 32), mx.bfloat16)
    other.append_window(narrow, narrow)
    cache.restore_state(other.state())
    # Room for the planned shapes' row (a restored storage holds its rows exactly).
    cache.trim(2)
    with pytest.raises(ValueError, match="layout"):
        cache.append_decode(row, row)
    assert cache.offset == 3


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_planned_append_launches_what_a_checked_append_launches(
    backend: Backend, kind: str
) -> None:
    """On the CUDA path (kernels stood in): a cache's planned decode appends hand MLX the
    launches its checked twin's do, with the same options and the same inputs (the
    appended keys and values themselves, then the running rank), skip the checked path
    from the second append on, and carry the running rank the encode returns (DEFER-3)."""
    import mlx.core as mx

    from kvspec.accelerated.caches.reads import running
    from kvspec.conformance.stand_ins import cuda_path

    mlx_only(backend)
    caches = backend.module("caches")
    rng = np.random.default_rng(0)

    def normal(shape: tuple[int, ...]) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    from kvspec.reference.caches.storage import FieldStorage

    checked_path = FieldStorage._checked
    went_checked: list[object] = []

    def counted(storage: FieldStorage, k: mx.array, v: mx.array) -> tuple:
        went_checked.append(storage)
        return checked_path(storage, k, v)

    with cuda_path() as launches, mock.patch.object(FieldStorage, "_checked", counted):
        make = KINDS[kind]
        planned, checked = make(caches), make(Unplanned(caches))
        prefill = normal((1, 2, 254, 128))
        for cache in (planned, checked):
            cache.append_window(prefill, prefill)
        # The third decode append grows the buffers (CACHE-3): the checked path's.
        for _ in range(5):
            k, v = normal((1, 2, 1, 128)), normal((1, 2, 1, 128))
            made = []
            for cache in (planned, checked):
                launches.calls.clear()
                launches.inputs.clear()
                launches.outputs.clear()
                cache.append_decode(k, v)
                given = [a is k or a is v or tuple(a.shape) for a in launches.inputs]
                made.append((list(launches.calls), given))
                # The encode's last output is the running rank (none without an encode).
                rank = launches.outputs[-1] if launches.outputs else None
                assert running(cache) is rank
            assert made[0] == made[1]
            shapes = [[tuple(a.shape) for a in c.state().arrays] for c in (planned, checked)]
            assert planned.offset == checked.offset and shapes[0] == shapes[1]
    # The window and the first decode append went the checked path; the twin's, all six.
    assert [went_checked.count(cache) for cache in (planned, checked)] == [2, 6]


@pytest.mark.parametrize("kind", ["QuantizedKVCache 4-bit g64", "TurboQuantKVCache k8v4"])
def test_a_planned_append_launches_kernels_made_after_the_caches_are_cleared(
    backend: Backend, kind: str
) -> None:
    """On the CUDA path (kernels stood in): once the kernels' caches are cleared (another
    set of stand-ins, tools' other sources), a storage's next append launches an encode
    made after, not the one its plan kept, and stores what it returns."""
    import mlx.core as mx

    from kvspec.conformance.stand_ins import cuda_path

    mlx_only(backend)
    row = mx.ones((1, 2, 1, 128), mx.bfloat16)
    with cuda_path() as first:
        cache = KINDS[kind](backend.module("caches"))
        for _ in range(3):
            cache.append_decode(row, row)
        assert cache._planned_append is not None
        with cuda_path() as second:
            first.calls.clear()
            cache.append_decode(row, row)
            assert first.calls == []
            assert second.calls, "the append's encode is made anew and launched"
