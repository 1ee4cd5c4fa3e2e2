"""A hypothesis state machine for rows of their own lengths (spec ROWS-5 .. ROWS-10).

A batch is merged from single-row caches of different lengths, then appended to, read,
trimmed, filtered, extended, saved and loaded, as a reference batch and a backend batch
given the same operations. Beside them, per row, run an independent model of the kind
(`oracles.py`, sharing no code with reference/caches or reference/rows) and a reference
cache given that row alone. After every step: the backend's batch state equals the
reference's bit for bit (left padding included), both hold their invariants, each row's
offset is its model's, and each extracted row holds its model's positions bit for bit
(a ring: its window, ROWS-8) and, where the batch holds the storage the row's own cache
holds, the fields of that cache. Each read of row b attends as its model's read and the
backend within READ-1's bound of the reference. bf16-first batches switch as one, when
the longest row is due (ROWS-7): the row models are told so.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, ClassVar

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvspec.conformance.backend import Backend
from kvspec.conformance.cache_machine import (
    Factory,
    assert_read_matches_model,
    assert_read_within_bound,
    assert_same_state,
    cache_contents,
    temporal,
)
from kvspec.conformance.compare import assert_same_bits
from kvspec.conformance.oracles import Model, RowsModel, model_of, plain_model
from kvspec.reference import caches as reference
from kvspec.reference import persistence as reference_persistence
from kvspec.reference import rows as reference_rows
from kvspec.reference.dtypes import FLOAT_DTYPES

MAX_ROWS = 4


class _RowOf:
    """Row `row` of a batch read, as a read of that row alone: `attend` answers the
    batch's queries and keeps the row's output."""

    def __init__(self, read: Any, row: int, queries: np.ndarray) -> None:
        self.read, self.row, self.queries = read, row, queries

    def attend(self, queries: np.ndarray, scale: float) -> np.ndarray:
        return self.read.attend(self.queries, scale)[self.row : self.row + 1]


class RowsMachine(RuleBasedStateMachine):
    """A padded batch on the reference and on a backend, with a model and a single cache
    per row."""

    backend: ClassVar[Backend]
    kinds: ClassVar[st.SearchStrategy[tuple[Factory, int]]]
    max_length: ClassVar[int] = 7

    @initialize(
        data=st.data(),
        dtype=st.sampled_from(sorted(FLOAT_DTYPES)),
        kv_heads=st.integers(1, 2),
        lengths=st.lists(st.integers(1, 7), min_size=2, max_size=3),
        seed=st.integers(0, 2**32 - 1),
        prepared=st.booleans(),
    )
    def start(self, data, dtype, kv_heads, lengths, seed, prepared) -> None:
        """Rows appended alone and merged (ROWS-9), or one left-padded first append of
        every row's prompt (ROWS-11)."""
        self.factory, self.head_dim = data.draw(self.kinds, label="kind")
        self.dtype = FLOAT_DTYPES[dtype]
        self.kv_heads = kv_heads
        self.family = self.backend.module("caches")
        self.rows = self.backend.module("rows")
        if prepared:
            self._start_prepared(lengths, seed)
            return
        singles = [self._new_row(seed + i, n) for i, n in enumerate(lengths)]
        # bf16-first rows join only rows holding the same storage (ROWS-3).
        singles = [row for row in singles if row[0].signature() == singles[0][0].signature()]
        self.alone = [ref for ref, _, _ in singles]
        self.model = RowsModel([model for _, _, model in singles], _start(self.alone[0]))
        cut = not _joined_as_they_lie([ref.state() for ref in self.alone])
        self.ref = reference_rows.merge([self._clone(ref) for ref in self.alone])
        self.got = self.rows.merge([got for _, got, _ in singles])
        self.model.follow(self.model.left_padding, cut)

    def _start_prepared(self, lengths: list[int], seed: int) -> None:
        """ROWS-11: the prompts left padded to the longest, padding of random content,
        appended at once; each row's model and own cache take the row's prompt alone (a
        bf16-first model due as the batch is, ROWS-7)."""
        longest = max(lengths)
        padding = [longest - n for n in lengths]
        k, v = self._kv(seed, len(lengths), longest)
        self.ref, self.got = self.factory(reference), self.factory(self.family)
        self.ref.prepare(left_padding=padding)
        self.got.prepare(left_padding=padding)
        self.ref.update_and_fetch(k, v)
        self.got.update_and_fetch(self.backend.from_numpy(k), self.backend.from_numpy(v))
        self.alone = [self.factory(reference) for _ in padding]
        self.model = RowsModel([model_of(alone) for alone in self.alone], _start(self.ref))
        self.model.follow(tuple(padding), cut=False)
        for b, pad in enumerate(padding):
            row_k, row_v = k[b : b + 1, :, pad:], v[b : b + 1, :, pad:]
            self.alone[b].update_and_fetch(row_k, row_v)
            self.model.rows[b].append(row_k, row_v)

    # -- helpers -------------------------------------------------------------------------

    def _kv(self, seed: int, batch: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        shape = (batch, self.kv_heads, length, self.head_dim)
        return cache_contents(seed, shape, self.head_dim, self.dtype)

    def _queries(self, seed: int, batch: int, length: int) -> np.ndarray:
        rng = np.random.default_rng(seed + 1)
        shape = (batch, 2 * self.kv_heads, length, self.head_dim)
        return rng.standard_normal(shape).astype(self.dtype)

    def _new_row(self, seed: int, length: int) -> tuple[Any, Any, Model]:
        """A row appended alone: its reference cache, its backend cache, its model."""
        ref, got = self.factory(reference), self.factory(self.family)
        model = model_of(ref)
        k, v = self._kv(seed, 1, length)
        ref.update_and_fetch(k, v)
        got.update_and_fetch(self.backend.from_numpy(k), self.backend.from_numpy(v))
        model.append(k, v)
        return ref, got, model

    @staticmethod
    def _clone(cache: Any) -> Any:
        """A new reference cache holding `cache`'s state."""
        parameters = reference_persistence.parameters(cache, reference)
        fresh = getattr(reference, type(cache).__name__)(**parameters)
        fresh.restore_state(cache.state())
        return fresh

    def _check_read(self, expected: Any, actual: Any, model_reads: list, seed: int, n: int):
        queries = self._queries(seed, len(self.model.rows), n)
        for b, model_read in enumerate(model_reads):
            assert_read_matches_model(model_read, _RowOf(expected, b, queries), queries[b : b + 1])
        assert_read_within_bound(expected, actual, queries, self.backend)

    def _both(self, method: str, k: np.ndarray, v: np.ndarray) -> tuple[Any, Any]:
        expected = getattr(self.ref, method)(k, v)
        actual = getattr(self.got, method)(self.backend.from_numpy(k), self.backend.from_numpy(v))
        return expected, actual

    def _positionwise(self) -> bool:
        return isinstance(self.ref, reference.Bf16FirstRotatingQuantizedKVCache)

    # -- rules ---------------------------------------------------------------------------

    @rule(
        data=st.data(),
        seed=st.integers(0, 2**32 - 1),
        read=st.sampled_from(["window", "committed", "decode"]),
    )
    def append(self, data, seed, read) -> None:
        """READ-2 .. READ-4 on the batch (ROWS-6); every row and its single cache take
        the row's positions."""
        length = 1 if read == "decode" else data.draw(st.integers(1, self.max_length))
        k, v = self._kv(seed, len(self.model.rows), length)
        method = {"window": "append_window", "committed": "append_committed"}.get(
            read, "append_decode"
        )
        expected, actual = self._both(method, k, v)
        model_reads = []
        for b, (model, alone) in enumerate(zip(self.model.rows, self.alone, strict=True)):
            row_k, row_v = k[b : b + 1], v[b : b + 1]
            alone.update_and_fetch(row_k, row_v)
            if read == "committed" and self._positionwise():
                model_reads.append(
                    [
                        model.append(row_k[:, :, i : i + 1], row_v[:, :, i : i + 1])
                        for i in range(length)
                    ]
                )
            else:
                model_reads.append(model.append(row_k, row_v))
        self._check_read(expected, actual, model_reads, seed, length)

    @rule(data=st.data(), seed=st.integers(0, 2**32 - 1))
    def block(self, data, seed) -> None:
        """READ-5: each row sees its own positions and the block."""
        length = data.draw(st.integers(1, 3))
        k, v = self._kv(seed, len(self.model.rows), length)
        expected, actual = self._both("read_block", k, v)
        model_reads = [
            model.block(k[b : b + 1], v[b : b + 1]) for b, model in enumerate(self.model.rows)
        ]
        self._check_read(expected, actual, model_reads, seed, length)

    @rule(n=st.integers(0, 9))
    def trim(self, n) -> None:
        """ROWS-7: every row loses min(n, the shortest row's offset)."""
        if not self.ref.is_trimmable():
            assert not self.got.is_trimmable()
            return
        trimmed = self.ref.trim(n)
        assert trimmed == self.got.trim(n) == self.model.trim(n)
        for alone in self.alone:
            # Each row's own ring holds no more than the batch's: trimmable too (RING-5).
            assert alone.trim(trimmed) == trimmed

    @rule(data=st.data())
    def filter(self, data) -> None:
        """ROWS-8: rows kept in any order, repeats allowed; padding no row needs dropped."""
        count = len(self.model.rows)
        picked = data.draw(
            st.lists(st.integers(0, count - 1), min_size=1, max_size=MAX_ROWS), label="rows"
        )
        cut = any(self.ref.left_padding)
        self.ref = reference_rows.filter_rows(self.ref, picked)
        self.got = self.rows.filter_rows(self.got, picked)
        self.model.filter(picked, cut)
        self.alone = [self._clone(self.alone[i]) for i in picked]

    @precondition(lambda self: len(self.model.rows) < MAX_ROWS)
    @rule(length=st.integers(1, 9), seed=st.integers(0, 2**32 - 1))
    def extend(self, length, seed) -> None:
        """ROWS-9: a row of its own length joins; a bf16-first row holding the other
        storage is refused and nothing changes."""
        ref, got, model = self._new_row(seed, length)
        if ref.signature() != self.ref.signature():
            before = self.ref.state()
            for batch, row, family in ((self.ref, ref, reference_rows), (self.got, got, self.rows)):
                try:
                    family.extend(batch, row)
                except ValueError as error:
                    assert "one layout" in str(error), error
                else:
                    raise AssertionError("extend joined caches holding different storage")
            assert_same_state(self.ref, self.got, self.backend)
            assert self.ref.state().offset == before.offset
            return
        cut = not _joined_as_they_lie([self.ref.state(), ref.state()])
        reference_rows.extend(self.ref, ref)
        self.rows.extend(self.got, got)
        self.alone.append(self._clone(ref))
        self.model.extend(model, cut)

    @rule()
    def save_and_load(self) -> None:
        """ROWS-10: a padded batch survives a file, each backend reading the other's."""
        persistence = self.backend.module("persistence")
        with tempfile.TemporaryDirectory() as folder:
            ours, theirs = os.path.join(folder, "ref"), os.path.join(folder, "got")
            reference_persistence.save_caches(ours, [self.ref])
            persistence.save_caches(theirs, [self.got])
            self.ref = reference_persistence.load_caches(theirs).caches[0]
            self.got = persistence.load_caches(ours).caches[0]

    @precondition(lambda self: min(self.ref.row_offsets) > 0)
    @rule()
    def donor_rows(self) -> None:
        """ROWS-10, DONOR-1: row b's positions are the last ends - starts of the window,
        decoded as its model decodes them."""
        donor = self.backend.module("caches").capture_donor_rows(self.got)
        rows = reference.capture_donor_rows(self.ref)
        assert (donor.offsets, donor.starts, donor.ends) == (rows.offsets, rows.starts, rows.ends)
        assert rows.offsets == self.ref.row_offsets == rows.ends
        for b, model in enumerate(self.model.rows):
            held = rows.ends[b] - rows.starts[b]
            want_k, want_v = model.window()  # type: ignore[misc]
            assert held <= want_k.shape[2]
            assert_same_bits(rows.keys[b : b + 1, :, -held:], want_k[:, :, -held:], "donor keys")
            assert_same_bits(
                rows.values[b : b + 1, :, -held:], want_v[:, :, -held:], "donor values"
            )

    # -- after every step ----------------------------------------------------------------

    @invariant()
    def same_rows(self) -> None:
        if not hasattr(self, "ref"):
            return
        self.ref.check_invariants()
        self.got.check_invariants()
        assert_same_state(self.ref, self.got, self.backend)
        assert self.got.left_padding == self.ref.left_padding
        assert self.ref.row_offsets == self.model.offsets
        assert self.ref.left_padding == self.model.left_padding
        for b, model in enumerate(self.model.rows):
            row = reference_rows.extract_row(self.ref, b)
            row.check_invariants()
            assert row.signature() == model.signature()
            assert row.offset == model.offset
            padding = self.ref.left_padding[b]
            assert row.minimum_reusable_offset == max(0, self.ref.minimum_reusable_offset - padding)
            arrays = stored_window(row.state(), plain_model(model).max_size)
            if not model.held:
                assert all(a.shape[2] == 0 for a in arrays), "a row trimmed to 0 holds rows"
                continue
            fields = _window_of_model(model)
            assert len(arrays) == len(fields)
            for slot, (got, want) in enumerate(zip(arrays, fields, strict=True)):
                assert_same_bits(got, want, f"row {b} slot {slot}")
            if self.alone[b].signature() == row.signature():
                self._assert_alone(self.alone[b], row)

    @staticmethod
    def _assert_alone(alone: Any, row: Any) -> None:
        """ROWS-8: the row's fields are its own cache's (a ring's: its window)."""
        max_size = row.sliding_window
        assert row.offset == alone.offset
        pairs = zip(
            stored_window(row.state(), max_size),
            stored_window(alone.state(), max_size),
            strict=True,
        )
        for slot, (got, want) in enumerate(pairs):
            assert_same_bits(got, want, f"alone slot {slot}")


def _start(cache: Any) -> int | None:
    """A bf16-first cache's start (B16F-1); None for other kinds."""
    return cache.start if isinstance(cache, reference.Bf16FirstCache) else None


def _joined_as_they_lie(states: list[Any]) -> bool:
    """ROWS-3: states without padding of one offset, ring index and buffer length are
    joined as they lie; any others are aligned (ROWS-9)."""
    lying = {(s.offset, s.ring_index, s.arrays[0].shape[2]) for s in states}
    return len(lying) == 1 and not any(s.left_padding for s in states)


def stored_window(state: Any, max_size: int | None) -> tuple[np.ndarray, ...]:
    """A single-row state's stored positions: growable storage's rows; a ring's window,
    its last min(offset, max_size) positions oldest first (ROWS-8)."""
    arrays = tuple(np.asarray(a) for a in state.arrays)
    if max_size is None:
        return arrays
    held = min(state.offset, max_size)
    ordered = []
    for a in arrays:
        live = temporal(a[:, :, : min(state.offset, a.shape[2])], state.ring_index, 0)
        ordered.append(live[:, :, live.shape[2] - held :])
    return tuple(ordered)


def _window_of_model(model: Model) -> tuple[np.ndarray, ...]:
    """The model's stored positions as `_window` takes them from a state."""
    fields = model.fields()
    max_size = plain_model(model).max_size
    if max_size is None:
        return fields
    held = min(model.offset, max_size)
    return tuple(f[:, :, f.shape[2] - held :] for f in fields)
