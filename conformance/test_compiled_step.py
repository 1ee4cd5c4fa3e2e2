"""The compiled decode step (COMPILE-1 .. COMPILE-6) against the reference's eager decode.

The model is the reference cache driven by `append_decode` (READ-2), which shares no code
with the step's plan, trace and commit. For every cache kind and scheme, N compiled steps
store the model's bits (and the backend's own eager steps' bits) and read within READ-1's
bound (TQC-4's for deferred TurboQuant reads), and where READ-7's kernels answer, as the
backend's own eager reads, bit for bit (a ring's oldest first); a state machine mixes
compiled steps with eager appends, trims, state round trips and bad input. Explicit cases:
recompiles only when a slot key changes, the bf16-first switch in the commit, deferred and
eager checks, misuse of the four calls, a ring's compiled reads around its wrap.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from kvspec.conformance.backend import Backend, backend_of_side, reference_backend
from kvspec.conformance.bounds import read_bound, read_error
from kvspec.conformance.cache_machine import (
    CacheMachine,
    assert_read_matches_model,
    assert_same_state,
    random_kv,
    run_machine,
)
from kvspec.conformance.compare import assert_same_bits
from kvspec.conformance.test_decode_step import RING_KINDS
from kvspec.reference import caches as reference
from kvspec.reference.caches.compiled import DecodePlan
from kvspec.reference.caches.reads import DenseRead
from kvspec.reference.caches.turboquant import KERNELS, DeferredRead
from kvspec.reference.deferred import failure_message
from kvspec.reference.dtypes import FLOAT_DTYPES
from kvspec.reference.turboquant import DEFERRED_CHECKS

#: Every storage kind and scheme: (id, factory of a cache from a `caches` module and a
#: checks mode, head_dim). Small rings wrap within a test's steps; bf16-first starts fall
#: inside them.
KINDS: list[tuple[str, Callable[[ModuleType, str], Any], int]] = [
    ("kv", lambda m, checks: m.KVCache(), 64),
    ("ring", lambda m, checks: m.RotatingKVCache(5), 64),
    ("ring keep 2", lambda m, checks: m.RotatingKVCache(6, 2), 32),
    ("affine 4/64", lambda m, checks: m.QuantizedKVCache(64, 4, checks), 64),
    ("affine 3/32", lambda m, checks: m.QuantizedKVCache(32, 3, checks), 64),
    ("affine 8/32", lambda m, checks: m.QuantizedKVCache(32, 8, checks), 32),
    ("affine ring 4/32", lambda m, checks: m.RotatingQuantizedKVCache(5, 32, 4, 0, checks), 32),
    (
        "affine ring 6/32 keep 1",
        lambda m, checks: m.RotatingQuantizedKVCache(6, 32, 6, 1, checks),
        64,
    ),
    ("turbo k8v4 dense", lambda m, checks: m.TurboQuantKVCache(8, 4, "dense", checks), 64),
    ("turbo k8v4 deferred", lambda m, checks: m.TurboQuantKVCache(8, 4, "deferred", checks), 64),
    ("turbo k4v3 dense", lambda m, checks: m.TurboQuantKVCache(4, 3, "dense", checks), 128),
    ("turbo k3v2 deferred", lambda m, checks: m.TurboQuantKVCache(3, 2, "deferred", checks), 64),
    ("bf16-first affine 4/32", lambda m, checks: m.Bf16FirstQuantizedKVCache(32, 4, 6, checks), 64),
    (
        "bf16-first affine ring 8/32",
        lambda m, checks: m.Bf16FirstRotatingQuantizedKVCache(5, 32, 8, 4, checks),
        32,
    ),
    ("bf16-first kv4 head 256", lambda m, checks: m.Bf16FirstKv4Head256Cache(5, checks), 256),
    (
        "scheme turbo:k8v4",
        lambda m, checks: m.composed_full_attention_cache(
            reference.parse_scheme("turbo:k8v4"), 0, checks
        ),
        64,
    ),
    (
        "scheme turbo:k4v4:deferred:start=6",
        lambda m, checks: m.composed_full_attention_cache(
            reference.parse_scheme("turbo:k4v4:deferred:start=6"), 0, checks
        ),
        64,
    ),
    (
        "scheme affine:2:32 start 0",
        lambda m, checks: m.composed_full_attention_cache(
            reference.parse_scheme("affine:2:32"), 0, checks
        ),
        32,
    ),
]

KV_HEADS = 2
QUERY_HEADS = 4


def _examples() -> int:
    """A compile per example: a tenth of the loaded profile's examples, at least 4."""
    return max(4, settings.default.max_examples // 10)


def attend_each(traces: list[Any], k: Any, v: Any, queries: Any) -> list[Any]:
    """The decode step a model runs per layer: one position appended, one query read."""
    scale = float(queries.shape[-1]) ** -0.5
    return [trace.append_decode(k, v).attend(queries, scale) for trace in traces]


def _queries(seed: int, head_dim: int, dtype: np.dtype) -> np.ndarray:
    rng = np.random.default_rng(seed + 1)
    return rng.standard_normal((1, QUERY_HEADS, 1, head_dim)).astype(dtype)


def _assert_within_bound(expected_read: Any, got: Any, queries: np.ndarray, backend) -> None:
    scale = float(queries.shape[-1]) ** -0.5
    want = expected_read.attend(queries, scale).astype(np.float64)
    actual = backend.to_numpy(got).astype(np.float64)
    assert actual.shape == want.shape
    bound = read_bound(queries, expected_read, scale, backend.attention_roundoff)
    error = read_error(actual, want, expected_read)
    assert np.all(error <= bound), f"compiled read error {error.max()} > bound {bound.min()}"


class Session:
    """A reference cache under eager decodes (the model), and two backend caches of the same
    kind: one under the compiled step, one under eager decodes."""

    def __init__(self, backend: Backend, factory, checks: str, head_dim: int, dtype) -> None:
        self.backend = backend
        self.head_dim, self.dtype = head_dim, dtype
        caches = backend.module("caches")
        self.model = factory(reference, checks)
        self.compiled_cache = factory(caches, checks)
        self.eager_cache = factory(caches, checks)
        self.step = backend.module("caches.compiled").compile_decode(
            attend_each, [self.compiled_cache]
        )

    def kv(self, seed: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        return random_kv(seed, (1, KV_HEADS, length, self.head_dim), self.head_dim, self.dtype)

    def prefill(self, seed: int, length: int) -> None:
        self.append_window(*self.kv(seed, length))

    def append_window(self, k: np.ndarray, v: np.ndarray) -> None:
        self.model.append_window(k, v)
        for cache in self.compiled_cache, self.eager_cache:
            cache.append_window(self.backend.from_numpy(k), self.backend.from_numpy(v))

    def trim(self, n: int) -> None:
        for cache in self.model, self.compiled_cache, self.eager_cache:
            cache.trim(n)

    def decode(self, seed: int) -> Any:
        """One step on all three; the compiled read within the bound of the model's, every
        stored bit the model's. Returns the compiled read's output."""
        k, v = self.kv(seed, 1)
        queries = _queries(seed, self.head_dim, self.dtype)
        expected = self.model.append_decode(k, v)
        on_backend = [self.backend.from_numpy(a) for a in (k, v, queries)]
        eager_read = self.eager_cache.append_decode(*on_backend[:2])
        (got,) = self.step(*on_backend)
        _assert_within_bound(expected, got, queries, self.backend)
        if _whole_buffers(self.backend):
            # READ-7, COMPILE-4: the kernels read the same rows in the same order.
            scale = float(self.head_dim) ** -0.5
            eager = eager_read.attend(on_backend[2], scale)
            assert_same_bits(self.backend.to_numpy(got), self.backend.to_numpy(eager), "read")
        assert_same_state(self.model, self.compiled_cache, self.backend)
        assert_same_state(self.model, self.eager_cache, self.backend)
        self.compiled_cache.check_invariants()
        return got


#: The offsets at which the compiled reads of RING_KINDS' rings are checked: one before the
#: ring fills, the oldest row at buffer row 0, and turns that cut the splits' chunks apart
#: in several places.
RING_CHECKED = (148, 149, 150, 157, 171, 194, 199)


@pytest.mark.parametrize("kind", RING_KINDS)
def test_a_compiled_ring_reads_as_the_eager_ring(backend, kind: str) -> None:
    """READ-7, COMPILE-4 on the kernels: the compiled step reads a ring oldest first, as the
    eager read does. Rings of 150 (test_decode_step's) take 137 positions, then 63 more one
    by one (compiled steps at the checked offsets, which come one before the ring fills and
    then wrap it; eager decodes between them); each compiled read equals, bit for bit, the
    eager read of a twin under the same appends, on each of the kernels' bodies."""
    if not _whole_buffers(backend):
        pytest.skip("the kernels' slot read reads a ring oldest first")
    rng = np.random.default_rng(150)
    caches = backend.module("caches")

    def rows(length: int, heads: int = 2):
        values = rng.standard_normal((1, heads, length, 128)).astype(FLOAT_DTYPES["bfloat16"])
        return backend.from_numpy(values)

    k, v = rows(200), rows(200)
    bodies = (None, False)
    compiled = [RING_KINDS[kind](caches) for _ in bodies]
    eager = RING_KINDS[kind](caches)
    for cache in (*compiled, eager):
        cache.append_window(k[:, :, :137], v[:, :, :137])
    steps = [
        backend.module("caches.compiled").compile_decode(
            lambda traces, k, v, q, body=body: [
                trace.append_decode(k, v).attend(q, 128**-0.5, body) for trace in traces
            ],
            [cache],
        )
        for cache, body in zip(compiled, bodies, strict=True)
    ]
    for offset in range(137, 200):
        new = (k[:, :, offset : offset + 1], v[:, :, offset : offset + 1])
        read = eager.append_decode(*new)
        if offset not in RING_CHECKED:
            for cache in compiled:
                cache.append_decode(*new)
            continue
        queries = rows(1, 8)
        for step, body in zip(steps, bodies, strict=True):
            (got,) = step(*new, queries)
            assert_same_bits(
                backend.to_numpy(got),
                backend.to_numpy(read.attend(queries, 128**-0.5, body)),
                f"offset {offset} tensor cores {body}",
            )


@pytest.mark.parametrize("checks", ["eager", "deferred"])
@pytest.mark.parametrize(("factory", "head_dim"), [k[1:] for k in KINDS], ids=[k[0] for k in KINDS])
def test_compiled_steps_store_the_eager_bits(backend, factory, head_dim, checks) -> None:
    """COMPILE-1: N compiled steps store what N eager decodes store, reads within bound."""

    @settings(max_examples=_examples())
    @given(
        seed=st.integers(0, 2**32 - 1),
        prefill=st.integers(1, 9),
        steps=st.integers(1, 9),
        dtype=st.sampled_from(sorted(FLOAT_DTYPES)),
    )
    def run(seed, prefill, steps, dtype) -> None:
        session = Session(backend, factory, checks, head_dim, FLOAT_DTYPES[dtype])
        session.prefill(seed, prefill)
        for i in range(steps):
            session.decode(seed + 1 + i)

    run()


class CompiledStepMachine(CacheMachine):
    """The cache machine with compiled steps among its operations: the backend cache steps
    through `compile_decode`, the reference through `append_decode`."""

    def _compiled(self):
        """The compiled step over the backend cache held now (rules may replace it)."""
        if getattr(self, "_step_cache", None) is not self.got:
            compiled = self.backend.module("caches.compiled")
            self._step = compiled.compile_decode(attend_each, [self.got])
            self._step_cache = self.got
        return self._step

    def _fill(self, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k, v = self._kv(seed, 1)
        return k, v, self._queries(seed, 1)

    @precondition(lambda self: self.ref.layout is not None)
    @rule(seed=st.integers(0, 2**32 - 1), steps=st.integers(1, 3))
    def compiled_decode(self, seed, steps) -> None:
        for i in range(steps):
            k, v, queries = self._fill(seed + i)
            expected = self.ref.append_decode(k, v)
            (got,) = self._compiled()(*(self.backend.from_numpy(a) for a in (k, v, queries)))
            assert_read_matches_model(self.model.append(k, v), expected, queries)
            _assert_within_bound(expected, got, queries, self.backend)

    @precondition(lambda self: self.ref.layout is not None)
    @rule(seed=st.integers(0, 2**32 - 1), bad=st.sampled_from(["nan", "head_dim", "length"]))
    def bad_compiled_decode(self, seed, bad) -> None:
        """CACHE-2, COMPILE-5: what an eager decode rejects, the compiled step rejects, and
        neither cache changes."""
        k, v, queries = self._fill(seed)
        if bad == "nan":
            if not self._rejects_nan():
                return
            v[0, 0, 0, 0] = np.nan
        elif bad == "head_dim":
            k = np.concatenate([k, k], axis=-1)
        else:
            k, v = np.concatenate([k, k], axis=2), np.concatenate([v, v], axis=2)

        def decode(cache, convert):
            if cache is self.got:
                return self._compiled()(convert(k), convert(v), convert(queries))
            return cache.append_decode(convert(k), convert(v))

        self._expect_rejected(decode)


@st.composite
def machine_kinds(draw: st.DrawFn):
    """(factory, head_dim, group_size) of CacheMachine over every kind (eager checks)."""
    _, factory, head_dim = draw(st.sampled_from(KINDS))
    return (lambda m: factory(m, "eager"), head_dim, None)


def test_compiled_step_machine(backend) -> None:
    run_machine(backend, machine_kinds(), CompiledStepMachine)


# -- explicit cases ------------------------------------------------------------------------


#: The reference as `_prefilled` takes a backend.
REFERENCE = reference_backend()


def _prefilled(backend, factory, length: int, head_dim: int = 64, seed: int = 0):
    cache = factory(backend.module("caches"))
    k, v = random_kv(seed, (1, KV_HEADS, length, head_dim), head_dim, FLOAT_DTYPES["bfloat16"])
    cache.append_window(backend.from_numpy(k), backend.from_numpy(v))
    return cache


def _decode_args(backend, seed: int, head_dim: int = 64, dtype: str = "bfloat16"):
    k, v = random_kv(seed, (1, KV_HEADS, 1, head_dim), head_dim, FLOAT_DTYPES[dtype])
    return [backend.from_numpy(a) for a in (k, v, _queries(seed, head_dim, FLOAT_DTYPES[dtype]))]


def _counting_step(backend, caches: list[Any]):
    """A compiled step that counts how often its Python step function runs."""
    calls = []

    def step_fn(traces, k, v, queries):
        calls.append(1)
        return attend_each(traces, k, v, queries)

    return backend.module("caches.compiled").compile_decode(step_fn, caches), calls


def test_one_graph_per_slot_key(backend, emulated_cuda: bool) -> None:
    """COMPILE-3, COMPILE-6: a growable cache recompiles when its read window moves a step
    (WINDOW_STEP positions) or its buffers grow (every 256), a full ring never, a
    bf16-first cache at its switch; in between the graph is replayed (with mx.compile the
    step function runs once per graph)."""
    caches = [
        _prefilled(backend, lambda m: m.QuantizedKVCache(64, 4), 253),
        _prefilled(backend, lambda m: m.RotatingKVCache(8), 12),
        _prefilled(backend, lambda m: m.Bf16FirstTurboQuantKVCache(8, 4, 253), 250),
    ]
    step, calls = _counting_step(backend, caches)
    for seed in range(8):
        step(*_decode_args(backend, seed))
    assert caches[0].offset == 261 and caches[2].converted and caches[2].offset == 258
    # Whole buffers: the growable cache grows at offset 256 and the bf16-first one switches
    # at 253 and grows its converted storage (capacity 253) on the same step: steps 0..2,
    # 3..7. Windows of WINDOW_STEP = 32 rows: the growable cache reads 256 rows, then 288
    # from step 3 (active length 257); the bf16-first one switches at step 3 and its window
    # moves from 256 to 288 rows at step 6: steps 0..2, 3..5, 6..7.
    graphs = 2 if _whole_buffers(backend) else 3
    assert len(step.graphs) == graphs
    # MLX compiles each graph once; NumPy, and MLX with its kernels emulated
    # (conformance/emulated_cuda.py), run the traced step at every step.
    compiles = backend.package == "kvspec.accelerated" and not emulated_cuda
    assert len(calls) == (graphs if compiles else 8)


def test_the_device_starts_before_the_commits(backend, monkeypatch) -> None:
    """COMPILE-6 on MLX: each step hands its outputs and the new positions' fields to the
    device (`mx.async_eval`) before any cache commits, so the host's commits overlap the
    graph's run; the commits' writes are not handed over (the next step evaluates them)."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("NumPy computes the step's outputs as it traces them")
    import mlx.core as mx

    caches = [_prefilled(backend, lambda m: m.TurboQuantKVCache(8, 4), 9) for _ in range(2)]
    handed = []

    def async_eval(*arrays: Any) -> None:
        handed.append(([cache.offset for cache in caches], arrays))

    monkeypatch.setattr(mx, "async_eval", async_eval)
    step = backend.module("caches.compiled").compile_decode(attend_each, caches)
    outputs = [step(*_decode_args(backend, seed)) for seed in range(2)]
    assert [offsets for offsets, _ in handed] == [[9, 9], [10, 10]]
    for (_, (handed_outputs, step_outputs)), output in zip(handed, outputs, strict=True):
        assert handed_outputs is output
        assert len(step_outputs) == len(caches)


def _whole_buffers(backend) -> bool:
    """Whether the backend's compiled step reads whole buffers (COMPILE-3): the MLX backend
    on CUDA, whose kernels take the live row count as data."""
    if backend.package != "kvspec.accelerated":
        return False
    from kvspec.accelerated.device import fused_kernels_enabled

    return fused_kernels_enabled()


def test_only_the_newest_graphs_are_kept(backend) -> None:
    """COMPILE-6: a key tuple per restored capacity (and read window); the oldest graphs are
    dropped."""
    compiled = backend.module("caches.compiled")
    cache = _prefilled(backend, lambda m: m.KVCache(), 7 * compiled.WINDOW_STEP)
    state = cache.state()
    step = compiled.compile_decode(attend_each, [cache])
    for rows in range(compiled.WINDOW_STEP, 8 * compiled.WINDOW_STEP, compiled.WINDOW_STEP):
        arrays = tuple(backend.from_numpy(backend.to_numpy(a)[:, :, :rows]) for a in state.arrays)
        cache.restore_state(replace(state, arrays=arrays, offset=rows))
        step(*_decode_args(backend, rows))
        assert cache.offset == rows + 1
    assert len(step.graphs) == compiled.KEPT_GRAPHS == 4


def test_switch_step_reads_plain_then_converted(backend) -> None:
    """B16F-2 under COMPILE-5: the due step runs the plain graph (it reads as the eager due
    decode reads: bf16 on MLX), the commit switches, the next step reads the converted
    storage (float32)."""
    factory = lambda m: m.Bf16FirstTurboQuantKVCache(8, 4, 4)  # noqa: E731
    cache, eager = _prefilled(backend, factory, 3), _prefilled(backend, factory, 3)
    step = backend.module("caches.compiled").compile_decode(attend_each, [cache])
    for seed, converted_fields in (1, 5), (2, 5):
        k, v, queries = _decode_args(backend, seed)
        (got,) = step(k, v, queries)
        want = eager.append_decode(k, v).attend(queries, 64**-0.5)
        assert cache.converted and eager.converted and cache.offset == eager.offset
        assert backend.to_numpy(got).dtype == backend.to_numpy(want).dtype
        assert len(cache.storage.stored_fields()) == converted_fields
        assert_same_state_bits(backend, cache, eager)
    assert len(step.graphs) == 2


def test_deferred_checks_record_the_rank(backend) -> None:
    """DEFER-3 under COMPILE-5: a deferred cache stores NaN groups and reads NaN as the eager
    decode does; the rank runs on through later steps and `check()` raises the eager
    message once; a NaN row trimmed away reaches no later read (COMPILE-4)."""
    factory = lambda m: m.TurboQuantKVCache(8, 4, checks="deferred")  # noqa: E731
    compiled, eager = _prefilled(backend, factory, 3), _prefilled(backend, factory, 3)
    model = _prefilled(REFERENCE, factory, 3)
    step = backend.module("caches.compiled").compile_decode(attend_each, [compiled])
    k, v = random_kv(7, (1, KV_HEADS, 1, 64), 64, np.float32)
    k[0, 1, 0, 3] = np.inf
    v[0, 0, 0, 9] = np.inf  # every value group of the row NaN (TQ-6)
    queries = _queries(7, 64, np.float32)
    args = [backend.from_numpy(a) for a in (k, v, queries)]
    (got,) = step(*args)
    want = eager.append_decode(*args[:2]).attend(args[2], 64**-0.5)
    model.append_decode(k, v)
    got, want = backend.to_numpy(got), backend.to_numpy(want)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(got).any()
    clean = _decode_args(backend, 8, dtype="float32")
    step(*clean)
    eager.append_decode(*clean[:2])
    model.append_decode(*(backend.to_numpy(a) for a in clean[:2]))
    message = failure_message(DEFERRED_CHECKS, len(DEFERRED_CHECKS))
    for cache in compiled, eager, model:
        with pytest.raises(ValueError, match=re.escape(message)):
            cache.check()
        cache.check()
    assert_same_state_bits(backend, compiled, eager)
    # Back to offset 2: the step writes row 2, and rows 3 (NaN) and 4 stay in the buffers
    # beyond it. No read may see them: the read is within READ-1's bound of the model's,
    # which never held them.
    for cache in compiled, eager, model:
        cache.trim(3)
    args = _decode_args(backend, 9, dtype="float32")
    (got,) = step(*args)
    eager.append_decode(*args[:2])
    k, v, queries = (backend.to_numpy(a) for a in args)
    assert np.isfinite(backend.to_numpy(got)).all()
    _assert_within_bound(model.append_decode(k, v), got, queries, backend)
    assert_same_state_bits(backend, compiled, eager)


#: Caches that hold a NaN row where the next compiled step must not read it (COMPILE-4):
#: (id, factory, prefill length, NaN position, trim). Growable: the NaN row is trimmed back
#: to the write row (stale: the new position replaces it), with rows beyond it; a full
#: ring: the NaN row is the oldest, the row the step evicts.
STALE_ROWS: list[tuple[str, Callable[[ModuleType], Any], int, int, int]] = [
    ("kv write row", lambda m: m.KVCache(), 6, 3, 3),
    ("turbo write row", lambda m: m.TurboQuantKVCache(8, 4, checks="deferred"), 6, 3, 3),
    (
        "turbo deferred write row",
        lambda m: m.TurboQuantKVCache(8, 4, "deferred", checks="deferred"),
        5,
        4,
        1,
    ),
    ("affine write row", lambda m: m.QuantizedKVCache(32, 4, checks="deferred"), 4, 2, 2),
    ("full ring evicted row", lambda m: m.RotatingKVCache(4), 4, 0, 0),
    ("full ring keep 1 evicted row", lambda m: m.RotatingKVCache(4, 1), 4, 1, 0),
    (
        "full affine ring evicted row",
        lambda m: m.RotatingQuantizedKVCache(4, 32, 4, 0, checks="deferred"),
        4,
        0,
        0,
    ),
]


@pytest.mark.parametrize(
    ("factory", "length", "nan_at", "trim"),
    [c[1:] for c in STALE_ROWS],
    ids=[c[0] for c in STALE_ROWS],
)
def test_stale_rows_reach_no_output(backend, factory, length, nan_at, trim) -> None:
    """COMPILE-4: the step reads the new position apart from the write row's old content
    and sees no row at or beyond the active length: a NaN there reaches no output, and the
    read is within the bound of the eager read of the model, which never held it."""
    session = Session(backend, lambda m, checks: factory(m), "eager", 64, np.float32)
    k, v = session.kv(11, length)
    v[0, 1, nan_at, 5] = np.nan
    session.append_window(k, v)
    if trim:
        session.trim(trim)
    for cache in session.model, session.compiled_cache, session.eager_cache:
        if cache.checks == "deferred":
            with pytest.raises(ValueError, match="NaN or inf"):
                cache.check()
        assert cache.prepare_decode_step().write_position == nan_at, "the write row is NaN"
    got = backend.to_numpy(session.decode(12))
    assert np.isfinite(got).all()
    got = backend.to_numpy(session.decode(13))
    assert np.isfinite(got).all()


@pytest.mark.parametrize(
    ("factory", "length"),
    [
        (lambda m: m.KVCache(), 5),
        (lambda m: m.RotatingKVCache(4), 6),
        (lambda m: m.QuantizedKVCache(32, 4, checks="deferred"), 5),
        (lambda m: m.TurboQuantKVCache(8, 4, "deferred"), 5),
    ],
    ids=["kv", "full ring", "affine", "turbo"],
)
def test_write_slot_holds_what_the_commit_stores(backend, factory, length) -> None:
    """COMPILE-4 on CUDA, checked on any device: the decode-attention kernels read the write
    row from the slot's fields and every other live row from the buffers given to the graph,
    so the commit must store exactly the slot's fields at that row and leave the others."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's kernel read")
    cache = _prefilled(backend, factory, length)
    plan = cache.prepare_decode_step()
    slot = cache.decode_slot(plan)
    inputs = cache.decode_inputs(plan)
    trace = slot.trace(inputs)
    trace.append_decode(*_decode_args(backend, 1)[:2])
    # The arrays a step takes and gives for the fields (a record's storage: the record).
    count = slot.outputs - (1 if cache.deferred_checks else 0)
    buffers = [backend.to_numpy(field) for field in cache._step_fields(tuple(inputs[:count]))]
    new = [backend.to_numpy(field) for field in cache._step_fields(tuple(trace.outputs[:count]))]
    cache.commit_decode_step(slot, trace.outputs)
    stored = cache.stored_fields()
    position, rows = plan.write_position, plan.active_length
    for i, field in enumerate(stored):
        field = backend.to_numpy(field)
        assert_same_bits(field[:, :, position], new[i][:, :, 0], f"field {i}, the write row")
        kept = [row for row in range(rows) if row != position]
        assert_same_bits(field[:, :, kept], buffers[i][:, :, kept], f"field {i}, other rows")


@pytest.mark.parametrize("side", ["reference", "backend"])
@pytest.mark.parametrize(("length", "rows"), [(30, 32), (31, 32), (32, 64), (40, 64)])
def test_a_step_takes_windows_of_its_buffers(backend, side, length, rows) -> None:
    """COMPILE-3: the graph takes the buffers' first rows, the active length rounded up to
    a multiple of WINDOW_STEP (32), as its slot key names them, not the whole buffers; a
    backend whose read takes the live count as data (the MLX backend on CUDA) takes the
    whole buffers (W = T)."""
    checker = backend_of_side(backend, side)
    cache = _prefilled(checker, lambda m: m.KVCache(), length)
    plan = cache.prepare_decode_step()
    assert plan.active_length == length + 1
    buffer_rows = cache.stored_fields()[0].shape[2]
    assert buffer_rows > rows  # CACHE-3 grew it by 256 rows
    if _whole_buffers(checker):
        rows = buffer_rows
    slot = cache.decode_slot(plan)
    windows = cache.decode_inputs(plan)[:2]
    assert [window.shape[2] for window in windows] == [rows] * 2
    assert [shape[2] for shape, _ in slot.key[2]] == [rows] * 2


def test_bf16_first_commit_checks_convertible(backend) -> None:
    """B16F-3 under COMPILE-5: before the switch, a position the converted storage could not
    hold is refused by the commit, and the cache is as it was."""
    cache = _prefilled(backend, lambda m: m.Bf16FirstQuantizedKVCache(64, 4, 8), 3)
    step = backend.module("caches.compiled").compile_decode(attend_each, [cache])
    k, v, queries = _decode_args(backend, 2)
    bad = backend.to_numpy(v).copy()
    bad[0, 1, 0, 5] = np.inf
    with pytest.raises(ValueError, match="NaN or inf"):
        step(k, backend.from_numpy(bad), queries)
    assert cache.offset == 3 and not cache.converted
    step(k, v, queries)
    assert cache.offset == 4


def test_trace_reads_with_the_cache_kernels(backend) -> None:
    """COMPILE-3, COMPILE-4: the kernels are part of the key, and the trace reads as the
    cache's kernels read (TQC-4): rotated values and an unrotated output for deferred."""
    keys = set()
    for kernels in KERNELS:
        cache = _prefilled(
            backend, lambda m, kernels=kernels: m.TurboQuantKVCache(8, 4, kernels), 5
        )
        plan = cache.prepare_decode_step()
        slot = cache.decode_slot(plan)
        keys.add(slot.key)
        trace = slot.trace(cache.decode_inputs(plan))
        k, v, _ = _decode_args(backend, 4)
        read = trace.append_decode(k, v)
        # A backend may wrap it in a read of the stored fields (READ-7) that decodes on
        # demand; the decoded read is the one the kernels name.
        decoded = getattr(read, "decoded", None)
        read = decoded() if callable(decoded) else read
        if backend.package == "kvspec.accelerated":
            # MLX's write-slot read: values left rotated iff it unrotates its output.
            assert (read.unrotate is not None) == (kernels == "deferred")
        else:
            assert isinstance(read, DeferredRead) == (kernels == "deferred")
            assert isinstance(read, DenseRead) == (kernels == "dense")
        # The five fields and the rank; the MLX backend's record of them and the rank.
        fields = 1 if backend.package == "kvspec.accelerated" else 5
        assert len(trace.outputs) == slot.outputs == fields + 1
        assert cache.offset == 5, "a trace changes nothing"
    assert len(keys) == len(KERNELS)


def assert_same_state_bits(backend, a, b) -> None:
    """Two caches of one backend hold the same stored bits, offset and ring index."""
    sa, sb = a.state(), b.state()
    assert (sa.offset, sa.ring_index) == (sb.offset, sb.ring_index)
    for slot, (x, y) in enumerate(zip(sa.arrays, sb.arrays, strict=True)):
        assert_same_bits(backend.to_numpy(x), backend.to_numpy(y), f"slot {slot}")


@pytest.mark.parametrize("kernels", KERNELS)
def test_eager_checks_reject_before_anything_changes(backend, kernels) -> None:
    """COMPILE-5: an eager cache's commit raises the eager message and the cache is as it
    was, the ring's buffer length included (the room was made on a copy)."""
    caches = [
        _prefilled(backend, lambda m: m.TurboQuantKVCache(8, 4, kernels), 256),
        _prefilled(backend, lambda m: m.RotatingQuantizedKVCache(8, 32, 4), 3),
    ]
    before = [cache.state() for cache in caches]
    step = backend.module("caches.compiled").compile_decode(attend_each, caches)
    k, v, queries = _decode_args(backend, 3)
    bad = backend.to_numpy(k).copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="keys hold NaN or inf"):
        step(backend.from_numpy(bad), v, queries)
    assert caches[0].capacity == 256
    assert caches[1].length == 3
    for cache, state in zip(caches, before, strict=True):
        after = cache.state()
        assert (after.offset, after.ring_index) == (state.offset, state.ring_index)
        for x, y in zip(after.arrays, state.arrays, strict=True):
            assert_same_bits(backend.to_numpy(x), backend.to_numpy(y), "unchanged")
    step(k, v, queries)
    assert [cache.offset for cache in caches] == [257, 4]


def test_misuse_is_rejected(backend) -> None:
    """COMPILE-2, COMPILE-5: no step on an empty cache; no slot, inputs or commit without
    the prepare for their plan, or after the cache changed."""
    caches = backend.module("caches")
    with pytest.raises(ValueError, match="prefill first"):
        caches.QuantizedKVCache(64, 4).prepare_decode_step()
    cache = _prefilled(backend, lambda m: m.QuantizedKVCache(64, 4), 5)
    with pytest.raises(ValueError, match="no prepare_decode_step"):
        cache.decode_inputs(DecodePlan(5, 6))
    plan = cache.prepare_decode_step()
    slot = cache.decode_slot(plan)
    assert (plan.write_position, plan.active_length) == (5, 6)
    # Six fields (the MLX backend: their record), the position, the length and the rank.
    fields = 1 if backend.package == "kvspec.accelerated" else 6
    assert (slot.inputs, slot.outputs) == (fields + 3, fields + 1)
    cache.trim(1)
    with pytest.raises(ValueError, match="changed after prepare_decode_step"):
        cache.commit_decode_step(slot, [None] * slot.outputs)
    assert cache.offset == 4
    plan = cache.prepare_decode_step()
    with pytest.raises(ValueError, match="outputs"):
        cache.commit_decode_step(cache.decode_slot(plan), [])

    def twice(traces, k, v, queries):
        traces[0].append_decode(k, v)
        return attend_each(traces, k, v, queries)

    step = backend.module("caches.compiled").compile_decode(twice, [cache])
    with pytest.raises(ValueError, match="one position per cache"):
        step(*_decode_args(backend, 5))
    assert cache.offset == 4
