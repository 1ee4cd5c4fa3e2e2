"""The compiled decode step (spec COMPILE-1 .. COMPILE-6): a decode step (`append_decode`
and its read on every layer) traced once with stand-in caches and replayed, the caches
supplying the graph's pieces and writing each step's new position after it.

A step is four calls per cache: `prepare_decode_step()` (the growth half of a
one-position append), `decode_slot(plan)` (what the graph looks like and a stand-in cache
for tracing it), `decode_inputs(plan)` (the arrays the graph reads) and
`commit_decode_step(slot, outputs)` (the write half). `compile_decode` drives them. The
graph sees the buffers' first rows, a window of WINDOW_STEP-row steps over the live rows,
with the write position and the live length as data, so its shapes change only when the
window moves a step, the buffers grow or the storage switches (COMPILE-3). It reads the
stored rows where they lie and the new position held apart (the write slot, COMPILE-4):
no buffer is copied inside the graph.

In NumPy nothing is compiled: `compile_decode` runs the traced step as written, which is
the behaviour a compiled step must reproduce. The MLX twin compiles it with `mx.compile`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np

from kvspec.reference.caches.protocol import Read, require_same_layout
from kvspec.reference.deferred import failure_message

#: The graph reads the buffers' leading rows in steps of this many (COMPILE-3).
WINDOW_STEP = 32


class DecodePlan(NamedTuple):
    """Where the step writes and what it reads (COMPILE-2): the buffer row of the new
    position, and how many leading buffer rows the step's read sees, the new one included.
    (The step's records are named tuples: each layer makes three per step, and a tuple is
    made in a fraction of a frozen dataclass's time.)"""

    write_position: int
    active_length: int


class DecodeRoom(NamedTuple):
    """The growth half of a one-position append, not yet adopted (COMPILE-2): the plan (a
    ring's write position is its index after RING-2 steps 1 .. 3) and the buffers with
    room for the position."""

    plan: DecodePlan
    fields: tuple[Any, ...]


class DecodeSlot(NamedTuple):
    """One cache's part of a step's graph (COMPILE-3).

    key: names the graph's shape: the storage kind and parameters, the read's kernels, the
        buffers' shapes and dtypes. Equal keys trace equal graphs.
    plan: the plan the slot was made for; the commit writes where it says.
    inputs: how many arrays `decode_inputs` gives; outputs: how many the trace returns.
    trace: a stand-in cache over the graph's inputs (`DecodeTrace`).
    """

    key: Hashable
    plan: DecodePlan
    inputs: int
    outputs: int
    trace: Callable[[Sequence[Any]], DecodeTrace]


class DecodeTrace:
    """A cache inside the step's graph (COMPILE-4): `append_decode(k, v)` encodes the new
    position and returns the read of the live stored rows, but the write row, and of the
    new position held apart; `outputs` are then the new position's fields (and the failure
    rank of an encoding storage, DEFER-2). It holds no array of the real cache's."""

    def __init__(self, storage: Any, fields: tuple[Any, ...], inputs: Sequence[Any]) -> None:
        self._storage = storage
        self._fields = fields
        self._inputs = inputs
        self.outputs: tuple[Any, ...] = ()

    def append_decode(self, k: Any, v: Any) -> Read:
        """COMPILE-4: one position, CACHE-2's layout checks, the deferred encode (DEFER-1)
        and the write-slot read."""
        storage = self._storage
        if self.outputs:
            raise ValueError("a compiled decode step appends one position per cache")
        require_same_layout(storage.layout, storage._append_layout(k, v))
        if k.shape[2] != 1:
            raise ValueError(f"a decode appends one position, got {k.shape[2]}")
        position, active_length, *failure = self._inputs
        storage._failure = failure[0] if failure else 0
        new, rank = storage._encode_deferred(k, v)
        arrays = storage._step_arrays(new)
        self.outputs = (*arrays, rank) if storage.deferred_checks else arrays
        return storage._slot_read(self._fields, new, position, active_length)


class DecodeStepMethods:
    """COMPILE-2 .. COMPILE-5 for field storage; the growable and ring storages supply
    the growth half (`_decode_room`), the encoding storages their deferred encode and
    their read. Until the commit the cache itself is untouched: the room is held apart,
    and the commit adopts it."""

    #: What the last `prepare_decode_step` made, and the fields, offset and ring index it
    #: was made from.
    _prepared: tuple[DecodeRoom, tuple[Any, ...]] | None = None

    def prepare_decode_step(self) -> DecodePlan:
        """COMPILE-2: room for one more position, as a one-position append makes it (CACHE-3
        step 1; RING-2 steps 1 .. 3), held apart from the cache; nothing written."""
        if self._fields is None:
            raise ValueError("a compiled decode step needs a cache holding a layout: prefill first")
        if self._left_padding:
            raise ValueError(
                "a compiled decode step takes rows of one length; this batch has left "
                f"padding {self._left_padding} (ROWS-6)"
            )
        room = self._decode_room()
        self._prepared = (room, (self._fields, self.offset, self.ring_index))
        return room.plan

    def _room_of(self, plan: DecodePlan) -> DecodeRoom:
        """The room `prepare_decode_step` made for `plan`, if the cache is as it left it."""
        if self._prepared is None or self._prepared[0].plan != plan:
            raise ValueError(f"no prepare_decode_step made {plan}")
        room, (fields, offset, ring_index) = self._prepared
        if fields is not self._fields or (offset, ring_index) != (self.offset, self.ring_index):
            raise ValueError("the cache changed after prepare_decode_step")
        return room

    def decode_slot(self, plan: DecodePlan) -> DecodeSlot:
        """COMPILE-3: the graph's key, and a trace over a copy of this storage's parameters
        made when it traces (no arrays: a compiled graph would keep them as constants)."""
        arrays = self._step_arrays(self._room_of(plan).fields)
        rows = self._window_rows(plan, arrays[0].shape[2])
        key = (
            type(self).__qualname__,
            self._graph_parameters(),
            tuple(((*array.shape[:2], rows, *array.shape[3:]), array.dtype) for array in arrays),
        )
        count = len(arrays)
        encoding = bool(self.deferred_checks)

        def trace(inputs: Sequence[Any]) -> DecodeTrace:
            parameters = copy.copy(self)
            parameters._fields = None
            parameters._prepared = None
            parameters._failure = 0
            fields = parameters._step_fields(tuple(inputs[:count]))
            return DecodeTrace(parameters, fields, inputs[count:])

        return DecodeSlot(key, plan, count + 2 + encoding, count + encoding, trace)

    def decode_inputs(self, plan: DecodePlan) -> tuple[Any, ...]:
        """COMPILE-3: the buffers' read windows, the write position and the active length as
        int32 scalars, and an encoding storage's running failure rank (DEFER-3)."""
        fields = self._windows(plan)
        position = self._int32_scalar(plan.write_position)
        length = self._int32_scalar(plan.active_length)
        rank = (self._rank_input(),) if self.deferred_checks else ()
        return (*fields, position, length, *rank)

    def commit_decode_step(self, slot: DecodeSlot, outputs: Sequence[Any]) -> None:
        """COMPILE-5: adopt the room, write the step's new position where the plan says and
        advance, as the one-position append would. Eager checks raise the failure the step's
        encode ranked before anything changes."""
        if len(outputs) != slot.outputs:
            raise ValueError(f"the step gives {slot.outputs} outputs, got {len(outputs)}")
        room = self._room_of(slot.plan)
        self._prepared = None
        new = tuple(outputs)
        if self.deferred_checks:
            *parts, failure = new
            if self.checks == "eager":
                rank = int(np.asarray(failure).reshape(-1)[0])
                if rank:
                    raise ValueError(failure_message(self.deferred_checks, rank))
                new = tuple(parts)
            else:
                new = self._record_failure(tuple(parts), failure)
        new = self._step_fields(new)
        self._adopt_room(room)
        self._write_decoded(new, slot.plan.write_position)

    def _windows(self, plan: DecodePlan) -> tuple[Any, ...]:
        """COMPILE-3: the first `_window_rows` rows of every buffer of the room `plan` was
        made with."""
        arrays = self._step_arrays(self._room_of(plan).fields)
        rows = self._window_rows(plan, arrays[0].shape[2])
        if rows == arrays[0].shape[2]:
            return arrays
        return tuple(array[:, :, :rows] for array in arrays)

    def _step_arrays(self, fields: tuple[Any, ...]) -> tuple[Any, ...]:
        """COMPILE-3, COMPILE-4: the arrays a step's graph takes and gives for `fields`:
        the fields themselves here; a backend that keeps a row's fields in one record
        gives the record (the same bytes)."""
        return tuple(fields)

    def _step_fields(self, arrays: tuple[Any, ...]) -> tuple[Any, ...]:
        """The fields of a step's arrays (`_step_arrays`): here the arrays themselves."""
        return arrays

    def _window_rows(self, plan: DecodePlan, length: int) -> int:
        """COMPILE-3: how many leading rows of buffers of `length` rows the graph reads: the
        active length rounded up to a multiple of WINDOW_STEP, at most the buffers'."""
        steps = -(-plan.active_length // WINDOW_STEP)
        return min(length, steps * WINDOW_STEP)

    def _adopt_room(self, room: DecodeRoom) -> None:
        """Take the buffers `room` made."""
        self._fields = room.fields

    def stored_fields(self) -> tuple[Any, ...]:
        """The stored buffers as they are now (none before the first append)."""
        return () if self._fields is None else tuple(self._fields)

    def _graph_parameters(self) -> Hashable:
        """What besides the buffers' shapes decides the step's graph: the signature."""
        return self.signature()

    def _int32_scalar(self, value: int) -> Any:
        """`value` as an int32 scalar array, as the graph reads the write position and the
        active length."""
        return self.xp.array(value, dtype=self.xp.int32)

    def _rank_input(self) -> Any:
        """The running failure rank as the graph reads it (DEFER-3)."""
        return self._failure

    def _slot_read(
        self, fields: tuple[Any, ...], new: tuple[Any, ...], position: Any, active_length: Any
    ) -> Read:
        """COMPILE-4 step 2: the stored rows decoded where they lie, those the read sees
        (`_slot_visible`) followed by the new position decoded, under the mask that shows
        them; the hidden rows zeroed first, so that what they hold (a stale row, a NaN
        group a trim left behind) reaches no output."""
        visible = self._slot_visible(fields, position, active_length)
        keys, values = self._decode(fields)
        new_keys, new_values = self._decode(new)
        return self.dense_read(*self._slot_rows(keys, values, new_keys, new_values, visible))

    def _slot_visible(self, fields: tuple[Any, ...], position: Any, active_length: Any) -> Any:
        """COMPILE-4: bool [T] over the window's rows: below `active_length` and not the
        write row, whose old content the new position replaces."""
        rows = self.xp.arange(fields[0].shape[2])
        return (rows < active_length) & (rows != position)

    def _slot_rows(
        self, keys: Any, values: Any, new_keys: Any, new_values: Any, visible: Any
    ) -> tuple[Any, Any, Any]:
        """Keys and values of the stored rows, hidden rows zeroed, then the new position's;
        and the mask [T + 1] that shows the visible rows and the new one."""
        hidden = ~visible[:, None]
        keys = self.xp.where(hidden, self.xp.zeros_like(keys), keys)
        values = self.xp.where(hidden, self.xp.zeros_like(values), values)
        mask = self.xp.concatenate([visible, self.xp.ones((1,), dtype=self.xp.bool_)])
        return (
            self.xp.concatenate([keys, new_keys], axis=2),
            self.xp.concatenate([values, new_values], axis=2),
            mask,
        )


#: How many compiled graphs a `CompiledDecode` keeps (COMPILE-6), newest first.
KEPT_GRAPHS = 4


class CompiledDecode:
    """COMPILE-6: `step_fn(traces, *args)` compiled once per tuple of slot keys and replayed;
    each call commits every cache and returns the step's outputs."""

    def __init__(self, step_fn: Callable[..., Any], caches: Sequence[Any]) -> None:
        self.step_fn = step_fn
        self.caches = tuple(caches)
        self.graphs: dict[tuple[Hashable, ...], Callable[..., Any]] = {}

    @staticmethod
    def compile_graph(graph: Callable[..., Any]) -> Callable[..., Any]:
        """NumPy has no compiler: the traced step runs as written."""
        return graph

    @staticmethod
    def start_evaluation(outputs: Any, step_outputs: Sequence[Any]) -> None:
        """COMPILE-6: hand the step's outputs to the device before the commits. NumPy has
        computed them already."""

    def __call__(self, *args: Any) -> Any:
        plans = [cache.prepare_decode_step() for cache in self.caches]
        slots = [cache.decode_slot(plan) for cache, plan in zip(self.caches, plans, strict=True)]
        inputs = [cache.decode_inputs(plan) for cache, plan in zip(self.caches, plans, strict=True)]
        key = tuple(slot.key for slot in slots)
        if key not in self.graphs:
            if len(self.graphs) == KEPT_GRAPHS:
                # Buffers only grow, so an old key rarely returns: keep the newest few.
                del self.graphs[next(iter(self.graphs))]
            self.graphs[key] = self.compile_graph(self._graph(slots))
        outputs, step_outputs = self.graphs[key](args, inputs)
        self.start_evaluation(outputs, step_outputs)
        for cache, slot, outs in zip(self.caches, slots, step_outputs, strict=True):
            cache.commit_decode_step(slot, outs)
        return outputs

    def _graph(self, slots: Sequence[DecodeSlot]) -> Callable[..., Any]:
        """The step as a function of (args, inputs): traces stand in for the caches."""

        def graph(args: Sequence[Any], inputs: Sequence[Sequence[Any]]) -> tuple[Any, list]:
            traces = [slot.trace(arrays) for slot, arrays in zip(slots, inputs, strict=True)]
            outputs = self.step_fn(traces, *args)
            return outputs, [list(trace.outputs) for trace in traces]

        return graph


def compile_decode(step_fn: Callable[..., Any], caches: Sequence[Any]) -> CompiledDecode:
    """COMPILE-6: the decode step `step_fn(traces, *args)` over `caches`, one trace per
    cache in order, as a callable `step(*args) -> outputs`."""
    return CompiledDecode(step_fn, caches)
