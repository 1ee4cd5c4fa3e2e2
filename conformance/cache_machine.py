"""A hypothesis state machine that drives a reference cache and a backend cache with the
same operations and compares them after every step (spec CACHE-1 .. B16F-6).

Beside them runs an independent model of the kind (`oracles.py`): positions as a plain
list, sharing no code with the state machines both backends run. After each step: the
backend's signature, offset and ring index equal the reference's, stored fields bit for
bit (CACHE-8), each cache's `check_invariants()`; and the reference's signature, offset,
trimmability, fetch and live stored fields equal the model's. Each read attends with the
same random queries: the reference's output equals the model's attention over the
model's positions and mask, the backend's is within READ-1's bound of the reference's.
Bad input must raise ValueError on both sides and leave both exactly as they were
(CACHE-2). A failure prints the operations as a runnable program.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvspec.conformance.backend import Backend
from kvspec.conformance.bounds import read_bound, read_error, rounded_attention_interval
from kvspec.conformance.compare import assert_same_bits
from kvspec.conformance.oracles import (
    AffineCodec,
    Bf16FirstModel,
    ExpectedRead,
    Model,
    TurboQuantCodec,
    model_of,
    temporal,
    visible_matrix,
)
from kvspec.conformance.strategies import GROUP_KINDS, edge_group
from kvspec.reference import caches as reference
from kvspec.reference import turboquant
from kvspec.reference.caches.masks import mask_matrix
from kvspec.reference.caches.reads import DenseRead, PositionwiseRead
from kvspec.reference.caches.turboquant import KERNELS, DeferredRead
from kvspec.reference.dtypes import FLOAT_DTYPES

#: Builds one cache kind from a backend's `caches` module.
Factory = Callable[[ModuleType], Any]

READS = ("fetch", "window", "committed")


def random_kv(
    seed: int, shape: tuple[int, int, int, int], v_dim: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """k, v of normal values at a random magnitude, in `dtype`."""
    rng = np.random.default_rng(seed)
    magnitude = 10.0 ** rng.uniform(-2, 1)
    B, H, L, D = shape
    k = (rng.standard_normal((B, H, L, D)) * magnitude).astype(dtype)
    v = (rng.standard_normal((B, H, L, v_dim)) * magnitude).astype(dtype)
    return k, v


#: Contents of an append other than Gaussian: one kind per group of 32 (strategies.py);
#: "large" is left out (its scales are beyond what float16 layouts and TurboQuant hold).
EDGE_CONTENTS = tuple(kind for kind in GROUP_KINDS if kind not in ("normal", "large"))


def cache_contents(
    seed: int, shape: tuple[int, int, int, int], v_dim: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    """k, v for a cache: mostly `random_kv`; one append in four made of edge groups
    (constants, zeros, -0 beside nonzero values, subnormals, exact ties, ...)."""
    rng = np.random.default_rng(seed)
    if rng.random() < 0.75:
        return random_kv(seed, shape, v_dim, dtype)
    B, H, L, D = shape

    def edges(width: int) -> np.ndarray:
        groups = [
            edge_group(str(rng.choice(EDGE_CONTENTS)), 32, dtype, rng)
            for _ in range(B * H * L * width // 32)
        ]
        return np.concatenate(groups).reshape(B, H, L, width).astype(dtype)

    return edges(D), edges(v_dim)


def assert_same_state(expected: Any, actual: Any, backend: Backend) -> None:
    """Signature, offset, ring index and stored fields bit for bit (CACHE-8)."""
    want, got = expected.state(), actual.state()
    assert got.signature == want.signature
    assert (got.offset, got.ring_index) == (want.offset, want.ring_index)
    assert got.minimum_reusable_offset == want.minimum_reusable_offset
    assert len(got.arrays) == len(want.arrays)
    for slot, (a, e) in enumerate(zip(got.arrays, want.arrays, strict=True)):
        assert_same_bits(backend.to_numpy(a), e, f"{want.signature} slot {slot}")


#: Per read: the READ-1 bound, the rounded-attention interval's width (NaN where the
#: backend declares no rounding) and the largest output magnitude, each the read's largest.
ReadLog = list[tuple[float, float, float]]


def assert_read_within_bound(
    expected: DenseRead | DeferredRead | PositionwiseRead,
    actual: Any,
    queries: np.ndarray,
    backend: Backend,
    log: ReadLog | None = None,
) -> None:
    """READ-1, TQC-4: the backend's attention within the bound of the reference's; where
    the backend rounds as MLX's CPU attention, also inside `rounded_attention_interval` of
    each dense read (a bound of about 1/100 of the output rather than READ-1's worst case)."""
    scale = float(queries.shape[-1]) ** -0.5
    want = expected.attend(queries, scale).astype(np.float64)
    got = backend.to_numpy(actual.attend(backend.from_numpy(queries), scale)).astype(np.float64)
    assert got.shape == want.shape
    reads = expected.reads if isinstance(expected, PositionwiseRead) else (expected,)
    bounds = [
        read_bound(
            queries[:, :, i : i + 1] if len(reads) > 1 else queries,
            r,
            scale,
            backend.attention_roundoff,
        )
        for i, r in enumerate(reads)
    ]
    bound = np.concatenate(bounds, axis=2)
    if len(reads) > 1:
        parts = [
            read_error(got[:, :, i : i + 1], want[:, :, i : i + 1], r) for i, r in enumerate(reads)
        ]
        error = np.concatenate(parts, axis=2)
    else:
        error = read_error(got, want, reads[0])
    excess = error - np.broadcast_to(bound, error.shape)
    worst = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[worst] <= 0, (
        f"attention error {error[worst]} > bound {error[worst] - excess[worst]} at {worst}"
    )
    width = np.nan
    if backend.rounded_attention and isinstance(reads[0], DenseRead):
        lo, hi = zip(
            *(
                rounded_attention_interval(
                    queries[:, :, i : i + 1] if len(reads) > 1 else queries,
                    r.keys,
                    r.values,
                    scale,
                    mask_matrix(r.mask, 1 if len(reads) > 1 else queries.shape[2], r.keys.shape[2]),
                    backend.attention_roundoff,
                )
                for i, r in enumerate(reads)
            ),
            strict=True,
        )
        low, high = np.concatenate(lo, axis=2), np.concatenate(hi, axis=2)
        outside = (got < low) | (got > high)
        assert not outside.any(), (
            f"attention output outside the rounded-attention interval at "
            f"{np.argwhere(outside)[0]}: {got[outside][0]} not in "
            f"[{low[outside][0]}, {high[outside][0]}]"
        )
        width = float((high - low).max())
    if log is not None:
        log.append((float(bound.max()), width, float(np.abs(want).max())))


def fetch_is_exact(signature: str, backend: Backend) -> bool:
    """Storage whose fetch is bit-exact: positions as given (CACHE-3), TurboQuant's
    float32 decode (TQC-2), and affine decode where the backend says so (QKV-2)."""
    return "affine" not in signature or backend.exact_affine_decode


def assert_matches_model(model: Model, cache: Any, to_numpy: Callable, fetch: bool) -> None:
    """The cache's signature, offset, trimmability, live stored fields and (with `fetch`)
    its fetch equal the model's (CACHE-3 .. B16F-6); a ring's rows are compared in
    temporal order (RING-4)."""
    assert cache.signature() == model.signature()
    assert cache.offset == model.offset
    assert cache.minimum_reusable_offset == model.minimum_reusable_offset
    assert cache.is_trimmable() == model.is_trimmable()
    if model.max_size is None:
        storage = getattr(cache, "storage", cache)  # a bf16-first cache's held storage
        assert storage.capacity == model.capacity, "capacity (CACHE-3)"
    arrays = cache.state().arrays
    window = cache.keys_and_values() if fetch else None
    if model.is_empty():
        assert window is None and arrays == ()
        return
    live = len(model.held)
    assert arrays and (window is not None or not fetch)
    if live == 0:
        assert window is None or to_numpy(window[0]).shape[2] == 0, "a fetch holds trimmed rows"
        return

    def ordered(rows: Any) -> np.ndarray:
        rows = to_numpy(rows)
        assert rows.shape[2] >= live, f"{rows.shape[2]} rows hold {live} positions"
        rows = rows[:, :, :live]
        if model.max_size is None:
            return rows
        return temporal(rows, cache.ring_index, model.keep)

    for name, rows, want in zip(("keys", "values"), window or (), model.window(), strict=False):
        assert to_numpy(rows).shape[2] == live, f"fetch holds {to_numpy(rows).shape[2]}"
        assert_same_bits(ordered(rows), want, f"{model.signature()} fetched {name}")
    fields = model.fields()
    assert len(arrays) == len(fields)
    for slot, (rows, want) in enumerate(zip(arrays, fields, strict=True)):
        assert_same_bits(ordered(rows), want, f"{model.signature()} slot {slot}")


def assert_read_matches_model(
    expected: ExpectedRead | list[ExpectedRead], read: Any, queries: np.ndarray
) -> None:
    """The reference's read equals the model's attention (READ-1 .. READ-6, MASK-1 ..
    MASK-3) within its float32 rounding (and TQC-4's dense-deferred tolerance)."""
    scale = float(queries.shape[-1]) ** -0.5
    reads = expected if isinstance(expected, list) else [expected]
    per_query = len(reads) > 1
    for i, model_read in enumerate(reads):
        q = queries[:, :, i : i + 1] if per_query else queries
        want = model_read.attend(q, scale)
        got = read.attend(queries, scale).astype(np.float64)
        got = got[:, :, i : i + 1] if per_query else got
        error = np.abs(got - want).max()
        assert error <= model_read.tolerance(), (
            f"read {i}: the reference is {error} from the model, tolerance {model_read.tolerance()}"
        )


class RecordedInputs:
    """Converts arrays for one cache, keeping a copy of each original beside what the
    cache received."""

    def __init__(self, convert: Callable[[np.ndarray], Any]) -> None:
        self.convert = convert
        self.originals: list[np.ndarray] = []
        self.received: list[Any] = []

    def __call__(self, array: np.ndarray) -> Any:
        self.originals.append(np.array(array))
        self.received.append(self.convert(array))
        return self.received[-1]


class CacheMachine(RuleBasedStateMachine):
    """Reference and backend caches of one kind under the same operations."""

    backend: ClassVar[Backend]
    #: Cache parameters: a strategy of (factory, head_dim, group_size or None).
    kinds: ClassVar[st.SearchStrategy[tuple[Factory, int, int | None]]]
    #: The longest append.
    max_length: ClassVar[int] = 9
    #: Where reads record their bounds, if anywhere (test_read_bounds.py).
    read_log: ClassVar[ReadLog | None] = None

    @initialize(
        data=st.data(),
        dtype=st.sampled_from(sorted(FLOAT_DTYPES)),
        batch=st.integers(1, 2),
        kv_heads=st.integers(1, 2),
        query_groups=st.sampled_from([1, 2]),
        same_v_dim=st.booleans(),
    )
    def start(self, data, dtype, batch, kv_heads, query_groups, same_v_dim) -> None:
        factory, head_dim, group_size = data.draw(self.kinds, label="kind")
        self.factory = factory
        self.dtype = FLOAT_DTYPES[dtype]
        self.batch, self.kv_heads = batch, kv_heads
        self.query_heads = kv_heads * query_groups
        self.head_dim = head_dim
        self.group_size = group_size
        self.ref = factory(reference)
        self.model = model_of(self.ref)
        fixed = getattr(self.ref, "head_dim", None) is not None
        self.v_dim = head_dim if same_v_dim or group_size is None or fixed else head_dim * 2
        self.got = factory(self.backend.module("caches"))
        self.long_appended = False

    # -- helpers -------------------------------------------------------------------------

    def _kv(
        self, seed: int, length: int, dtype: np.dtype | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        shape = (self.batch, self.kv_heads, length, self.head_dim)
        return cache_contents(seed, shape, self.v_dim, dtype or self.dtype)

    def _queries(self, seed: int, length: int) -> np.ndarray:
        rng = np.random.default_rng(seed + 1)
        shape = (self.batch, self.query_heads, length, self.head_dim)
        return rng.standard_normal(shape).astype(self.dtype)

    def _both(self, method: str, *arrays: np.ndarray) -> tuple[Any, Any]:
        """The same call on both caches, each given arrays of its own; what each received
        must be unchanged after the call (CONV-5)."""
        given = [np.array(a) for a in arrays]
        expected = getattr(self.ref, method)(*given)
        received = [self.backend.from_numpy(a) for a in arrays]
        actual = getattr(self.got, method)(*received)
        self._assert_inputs_unchanged(arrays, given, np.asarray)
        self._assert_inputs_unchanged(arrays, received, self.backend.to_numpy)
        return expected, actual

    @staticmethod
    def _assert_inputs_unchanged(originals: Any, received: Any, to_numpy: Callable) -> None:
        for original, array in zip(originals, received, strict=True):
            assert_same_bits(to_numpy(array), np.asarray(original), "an input after the call")

    # -- rules ---------------------------------------------------------------------------

    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1), read=st.sampled_from(READS))
    def append(self, data, seed, read) -> None:
        length = data.draw(st.integers(1, self.max_length), label="length")
        k, v = self._kv(seed, length)
        if read == "fetch":
            (ek, ev), (ak, av) = self._both("update_and_fetch", k, v)
            self.model.append(k, v)
            assert tuple(ak.shape) == ek.shape and tuple(av.shape) == ev.shape
            if self._fetch_exact():
                assert_same_bits(self.backend.to_numpy(ak), ek, "fetched keys")
                assert_same_bits(self.backend.to_numpy(av), ev, "fetched values")
            return
        method = "append_window" if read == "window" else "append_committed"
        expected, actual = self._both(method, k, v)
        if read == "committed" and self._positionwise_commit():
            model_read: ExpectedRead | list[ExpectedRead] = [
                self.model.append(k[:, :, i : i + 1], v[:, :, i : i + 1]) for i in range(length)
            ]
        else:
            model_read = self.model.append(k, v)
        queries = self._queries(seed, length)
        assert_read_matches_model(model_read, expected, queries)
        assert_read_within_bound(expected, actual, queries, self.backend, self.read_log)

    @rule(seed=st.integers(0, 2**32 - 1))
    def decode(self, seed) -> None:
        k, v = self._kv(seed, 1)
        expected, actual = self._both("append_decode", k, v)
        queries = self._queries(seed, 1)
        assert_read_matches_model(self.model.append(k, v), expected, queries)
        assert_read_within_bound(expected, actual, queries, self.backend, self.read_log)

    @precondition(lambda self: self.ref.offset > 0)
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def block(self, data, seed) -> None:
        """READ-5: the stored window and a block that is not appended, every key visible;
        nothing changes (the invariant after the step checks the rest)."""
        length = data.draw(st.integers(1, 4), label="length")
        k, v = self._kv(seed, length)
        before = self.ref.state()
        expected, actual = self._both("read_block", k, v)
        queries = self._queries(seed, length)
        assert_read_matches_model(self.model.block(k, v), expected, queries)
        assert_read_within_bound(expected, actual, queries, self.backend, self.read_log)
        assert self.ref.state().offset == before.offset

    @precondition(lambda self: self.ref.offset == 0 and not self._converted())
    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1), encoder=st.booleans())
    def first_window(self, data, seed, encoder) -> None:
        """READ-6: the causal mask of MASK-1 (windowed on a ring) or the marked pairs; the
        encoder read sees exactly the marked pairs."""
        length = data.draw(st.integers(1, self.max_length), label="length")
        k, v = self._kv(seed, length)
        rng = np.random.default_rng(seed + 2)
        bidirectional = rng.random((length, length)) < 0.3
        np.fill_diagonal(bidirectional, True)
        method = "append_encoder_window" if encoder else "append_bidirectional"
        expected, actual = self._both(method, k, v, bidirectional)
        model_read = self.model.append(k, v)
        # MASK-1's window on positions (a ring's max_size), not a ring's own (MASK-3).
        causal = self.model.visible(length, self.model.max_size)
        visible = bidirectional if encoder else causal | bidirectional
        queries = self._queries(seed, length)
        assert_read_matches_model(replace(model_read, visible=visible), expected, queries)
        assert_read_within_bound(expected, actual, queries, self.backend, self.read_log)

    @rule(n=st.integers(0, 12))
    def trim(self, n) -> None:
        if self.ref.is_trimmable():
            assert self.got.is_trimmable()
            assert self.got.trim(n) == self.ref.trim(n) == self.model.trim(n)
            return
        assert not self.got.is_trimmable()
        self._expect_rejected(lambda cache, _: cache.trim(n))

    @rule()
    def state_and_restore(self) -> None:
        """Restore fresh caches: the reference from its own state, the backend from the
        reference's arrays (the state format is the same on both sides)."""
        state = self.ref.state()
        self.ref = self.factory(reference)
        self.ref.restore_state(state)
        self.got = self.factory(self.backend.module("caches"))
        arrays = tuple(self.backend.from_numpy(a) for a in state.arrays)
        self.got.restore_state(replace(state, arrays=arrays))
        self.model.restored()

    @rule(bad=st.sampled_from(["signature", "offset", "ring_index", "slots"]))
    def restore_rejected(self, bad) -> None:
        """CACHE-8, RING-6, TQC-5, B16F-6: a state of another kind or with inconsistent
        arrays is rejected and changes nothing."""
        state = self.ref.state()
        if bad == "signature":
            state = replace(state, signature=state.signature + ":other")
        elif bad == "offset":
            if self.ref.ring_index is not None and state.arrays:
                return  # a ring's offset may exceed its rows (RING-1)
            state = replace(state, offset=state.offset + 1)
        elif bad == "ring_index":
            if self.ref.ring_index is None:
                return
            rows = state.arrays[0].shape[2] if state.arrays else 0
            state = replace(state, ring_index=rows + 1)
        elif bad == "slots":
            if not state.arrays:
                return
            state = replace(state, arrays=state.arrays[:-1])

        def restore(cache: Any, convert: Callable) -> None:
            cache.restore_state(replace(state, arrays=tuple(convert(a) for a in state.arrays)))

        self._expect_rejected(restore)

    @precondition(lambda self: self.ref.layout is not None)
    @rule(seed=st.integers(0, 2**32 - 1), data=st.data())
    def format_mixing(self, seed, data) -> None:
        """TQC-2: TurboQuant storage takes appends of any float format (the fields do not
        record it); every other storage rejects a format other than its layout's (CACHE-2)."""
        others = sorted(name for name, d in FLOAT_DTYPES.items() if d != self.dtype)
        dtype = FLOAT_DTYPES[data.draw(st.sampled_from(others), label="format")]
        k, v = self._kv(seed, data.draw(st.integers(1, 3), label="length"), dtype)
        if "turboquant" not in self.ref.signature():
            self._expect_rejected(
                lambda cache, convert: cache.update_and_fetch(convert(k), convert(v))
            )
            return
        self._both("update_and_fetch", k, v)
        self.model.append(k, v)

    @precondition(lambda self: not self.long_appended)
    @rule(seed=st.integers(0, 2**32 - 1), data=st.data())
    def long_append(self, seed, data) -> None:
        """CACHE-3, RING-3: one append past a 256-row growth step (in about one run in
        four: every later step costs ten times more)."""
        self.long_appended = True
        if data.draw(st.integers(0, 3), label="long") != 3:
            return
        length = data.draw(st.integers(250, 300), label="length")
        k, v = self._kv(seed, length)
        self._both("update_and_fetch", k, v)
        self.model.append(k, v)

    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1), window=st.integers(1, 12))
    def windowed_read(self, data, seed, window) -> None:
        """MASK-2, MASK-3: `make_mask(L, window)` taken before an append, as the model
        states it, and the read of the fetch under it."""
        length = data.draw(st.integers(1, 4), label="length")
        k, v = self._kv(seed, length)
        masks = self.ref.make_mask(length, window), self.got.make_mask(length, window)
        (ek, ev), (ak, av) = self._both("update_and_fetch", k, v)
        model_read = self.model.append(k, v)
        visible = self.model.visible(length, window)
        held = visible.shape[1]
        for cache, mask in zip((self.ref, self.got), masks, strict=True):
            matrix = visible_matrix(mask, length, held, self.backend.to_numpy)
            if self.model.max_size is not None:
                # Columns are ring slots: put them in temporal order as rows would be.
                by_slot = matrix.T[None, None]
                matrix = temporal(by_slot, cache.ring_index, self.model.keep)[0, 0].T
            np.testing.assert_array_equal(matrix, visible, err_msg=f"{type(cache)} mask")
        expected = DenseRead(ek, ev, masks[0])
        actual = self.backend.module("caches.reads").DenseRead(ak, av, masks[1])
        queries = self._queries(seed, length)
        assert_read_matches_model(replace(model_read, visible=visible), expected, queries)
        assert_read_within_bound(expected, actual, queries, self.backend, self.read_log)

    @rule(
        seed=st.integers(0, 2**32 - 1),
        bad=st.sampled_from(["length", "dtype", "head_dim", "rank", "value_rank", "nan"]),
    )
    def bad_append(self, seed, bad) -> None:
        k, v = self._kv(seed, 2)
        if bad == "length":
            v = v[:, :, :1]
        elif bad == "dtype":
            v = v.astype(np.float32 if self.dtype != np.float32 else np.float16)
        elif bad == "head_dim":
            if self.ref.layout is None and not self._fixed_head_dim():
                return
            k = np.concatenate([k, k], axis=-1)
        elif bad == "rank":
            k = k[0]
        elif bad == "value_rank":
            v = v[..., 0]  # [B, H, L]: its first three axes are still the keys'
        elif bad == "nan":
            if not self._rejects_nan():
                return
            k[0, 0, 0, 0] = np.nan
        method = "update_and_fetch" if seed % 2 else "append_window"
        self._expect_rejected(lambda cache, convert: getattr(cache, method)(convert(k), convert(v)))

    def _expect_rejected(self, operation: Callable[[Any, Callable], Any]) -> None:
        """CACHE-2, CONV-5: ValueError on both sides; each cache, and every array it was
        given, exactly as before."""
        before_ref, before_got = self.ref.state(), self.got.state()
        for cache, convert, to_numpy in (
            (self.ref, np.array, np.asarray),
            (self.got, self.backend.from_numpy, self.backend.to_numpy),
        ):
            recorded = RecordedInputs(convert)
            with pytest.raises(ValueError):
                operation(cache, recorded)
            self._assert_inputs_unchanged(recorded.originals, recorded.received, to_numpy)
        for cache, before in ((self.ref, before_ref), (self.got, before_got)):
            after = cache.state()
            assert (after.signature, after.offset, after.ring_index) == (
                before.signature,
                before.offset,
                before.ring_index,
            )
            for a, b in zip(after.arrays, before.arrays, strict=True):
                assert_same_bits(self.backend.to_numpy(a), self.backend.to_numpy(b), "unchanged")

    # -- what a kind may do --------------------------------------------------------------

    def _fetch_exact(self) -> bool:
        return fetch_is_exact(self.ref.signature(), self.backend)

    def _positionwise_commit(self) -> bool:
        """READ-4: a bf16-first ring commits a span one decode at a time."""
        return isinstance(self.model, Bf16FirstModel) and self.model.positionwise_commit

    def _converted(self) -> bool:
        return isinstance(self.ref, reference.Bf16FirstCache) and self.ref.converted

    def _fixed_head_dim(self) -> bool:
        return getattr(self.ref, "head_dim", None) is not None

    def _rejects_nan(self) -> bool:
        """Only plain storage holds NaN; a bf16-first cache will convert (B16F-3)."""
        plain = isinstance(self.ref, reference.KVCache | reference.RotatingKVCache)
        return not plain or isinstance(self.ref, reference.Bf16FirstCache)

    @precondition(lambda self: isinstance(self.ref, reference.KVCache | reference.RotatingKVCache))
    @rule(bits=st.sampled_from([2, 3, 4, 5, 6, 8]), group_size=st.sampled_from([32, 64]))
    def convert(self, bits, group_size) -> None:
        """CACHE-9: to_quantized consumes its source, leaving it empty."""
        if self.head_dim % group_size:
            group_size = 32
        sources = (self.ref, self.got)
        self.ref = self.ref.to_quantized(group_size, bits)
        self.got = self.got.to_quantized(group_size, bits)
        assert not isinstance(self.model, Bf16FirstModel)
        self.model = self.model.converted(AffineCodec(group_size, bits), "affine")
        for source in sources:
            assert source.offset == 0 and source.state().arrays == ()
            source.check_invariants()
        if isinstance(sources[0], reference.RotatingKVCache):
            max_size, keep = sources[0].max_size, sources[0].keep
            self.factory = lambda m: m.RotatingQuantizedKVCache(max_size, group_size, bits, keep)
        else:
            self.factory = lambda m: m.QuantizedKVCache(group_size, bits)

    @precondition(
        lambda self: (
            isinstance(self.ref, reference.KVCache)
            and self.head_dim in turboquant.HEAD_DIMS
            and self.v_dim == self.head_dim
        )
    )
    @rule(
        k_bits=st.sampled_from(turboquant.KEY_BITS),
        v_bits=st.sampled_from(turboquant.VALUE_BITS),
        kernels=st.sampled_from(KERNELS),
    )
    def convert_to_turboquant(self, k_bits, v_bits, kernels) -> None:
        """TQC-3: from_kv_cache consumes its source, leaving it empty."""
        sources = (self.ref, self.got)
        self.ref = reference.TurboQuantKVCache.from_kv_cache(self.ref, k_bits, v_bits, kernels)
        caches = self.backend.module("caches")
        self.got = caches.TurboQuantKVCache.from_kv_cache(self.got, k_bits, v_bits, kernels)
        assert not isinstance(self.model, Bf16FirstModel)
        codec = TurboQuantCodec(k_bits, v_bits, kernels == "deferred")
        self.model = self.model.converted(codec, "turboquant")
        for source in sources:
            assert source.offset == 0 and source.state().arrays == ()
            source.check_invariants()
        self.factory = lambda m: m.TurboQuantKVCache(k_bits, v_bits, kernels)

    @invariant()
    def same_caches(self) -> None:
        if not hasattr(self, "ref"):
            return
        assert_same_state(self.ref, self.got, self.backend)
        self.ref.check_invariants()
        self.got.check_invariants()
        # The reference's fields equal the backend's (above), so its fetch would only
        # repeat the backend's, which shares its steps.
        assert_matches_model(self.model, self.ref, np.asarray, fetch=False)
        assert_matches_model(self.model, self.got, self.backend.to_numpy, self._fetch_exact())


def run_machine(
    backend: Backend,
    kinds: st.SearchStrategy[tuple[Factory, int, int | None]],
    machine: type[CacheMachine] = CacheMachine,
    max_length: int = 9,
    read_log: ReadLog | None = None,
    max_examples: int | None = None,
    derandomize: bool = False,
) -> None:
    """Run `machine` over `kinds` against `backend`, scaled to the loaded profile unless
    `max_examples` is given; each read's bounds go to `read_log` if given. `derandomize`
    draws the same examples every run (for a measurement that must be reproducible), so it
    also leaves out the example database, whose saved examples would be replayed first."""
    profile = settings.default
    bound_machine = type(
        machine.__name__,
        (machine,),
        {"backend": backend, "kinds": kinds, "max_length": max_length, "read_log": read_log},
    )
    run_state_machine_as_test(
        bound_machine,
        settings=settings(
            max_examples=max_examples or max(10, profile.max_examples // 2),
            stateful_step_count=25,
            derandomize=derandomize,
            database=None if derandomize else profile.database,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
            print_blob=True,
        ),
    )


#: Ring sizes: mostly small rings, whose wraps the machines reach often; some larger, up
#: to one past a 256-row growth step (RING-2 grows a ring in steps of 256 up to max_size).
ring_sizes = st.one_of(st.integers(1, 8), st.sampled_from([9, 16, 33, 257]))

# Operation sequences shared by the explicit cache tests.
#: Ring operations: (kind, length) with kind append (length positions), decode, trim.
ring_operations = st.lists(
    st.tuples(st.sampled_from(["append", "decode", "decode", "trim"]), st.integers(1, 12)),
    min_size=1,
    max_size=16,
)
#: Append lengths of a bf16-first session.
appends = st.lists(st.integers(1, 9), min_size=1, max_size=8)
#: Conversion starts of bf16-first caches.
starts = st.sampled_from([0, 1, 5, 12])
