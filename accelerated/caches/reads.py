"""Reads on MLX (spec READ-1 .. READ-7): the reference's reads, bound to MLX arrays, masks
and `mx.fast.scaled_dot_product_attention`; the decode read of stored fields, whose
attention reads the codes where they lie (READ-7); and the compiled step's write-slot read
(COMPILE-4), which attends over the stored rows where they lie and the new position held
apart."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import mlx.core as mx
import numpy as np

from kvspec.accelerated import attention_kernels, dtypes
from kvspec.accelerated.attention_kernels import PLAIN, Stored, StoredSide
from kvspec.accelerated.caches import masks
from kvspec.accelerated.caches.attention import attention, check_queries
from kvspec.accelerated.caches.counting import COUNTS
from kvspec.accelerated.caches.planned import Encoder, PlannedAppend
from kvspec.accelerated.caches.protocol import KvLayout, Mask, Read
from kvspec.accelerated.cuda_source import KERNELS_MADE
from kvspec.accelerated.device import fused_kernels_enabled
from kvspec.reference.caches import reads
from kvspec.reference.caches.compiled import DecodePlan
from kvspec.reference.caches.storage import Fields


class DenseRead(reads.DenseRead):
    """READ-1 with MLX's attention."""

    attention = staticmethod(attention)


class PositionwiseRead(reads.PositionwiseRead):
    """READ-4's one decode read per position, outputs joined on MLX."""

    xp = mx


@dataclass(frozen=True)
class SlotRead:
    """COMPILE-4's write-slot read with MLX ops: the stored rows [B, Hk, T, *] decoded where
    they lie, of which the read sees those `visible` marks (bool [T]), and the new position
    [B, Hk, 1, *] held apart, in one softmax. No buffer is copied: hidden rows are masked
    out of the scores, and their values must be zero (a stale row or a NaN group a trim
    left behind would reach the output through a zero weight: the storages zero them where
    it costs least, `ReadMethods._values_hidden`). `unrotate` is TQ-8's, for values left
    rotated (TQC-4's deferred kernels); None otherwise."""

    keys: mx.array
    values: mx.array
    new_keys: mx.array
    new_values: mx.array
    visible: mx.array
    unrotate: Callable[[mx.array], mx.array] | None = None

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """READ-1 attention of `queries` [B, Hq, N, Dk], all of them seeing every row the
        read sees (READ-2), in the keys' format."""
        B, Hq, N, Dk = queries.shape
        _, Hk, T, _ = self.keys.shape
        dtype = self.keys.dtype
        check_queries(queries, (B, Hk, T, Dk), dtype)
        # The query heads of a KV head as the rows of one product (MLX's own attention
        # multiplies each of them on its own, at a multiple of the cost on the CPU).
        grouped = (queries.astype(dtype) * mx.array(scale, dtype)).reshape(B, Hk, -1, Dk)
        scores = grouped @ mx.swapaxes(self.keys, -1, -2)
        scores = mx.where(self.visible, scores, mx.array(-math.inf, dtype))
        new_scores = grouped @ mx.swapaxes(self.new_keys, -1, -2)
        weights = mx.softmax(
            mx.concatenate([scores, new_scores], axis=-1).astype(mx.float32), axis=-1
        )
        values = self.values.astype(mx.float32)
        out = weights[..., :T] @ values + weights[..., T:] * self.new_values.astype(mx.float32)
        if self.unrotate is not None:
            out = self.unrotate(out)
        return out.reshape(B, Hq, N, -1).astype(dtype)


@dataclass(frozen=True)
class WriteSlot:
    """The new position of a compiled step as the decode-attention kernels take it
    (COMPILE-4): the buffer row it replaces (int32 [1]) and its stored fields as sides
    of one row, or its record row. The kernels read that row from these, the others from
    the buffers where they lie: no copy."""

    position: mx.array
    new: tuple[StoredSide, StoredSide] | mx.array


@dataclass(slots=True)
class StoredRead:
    """READ-7: a decode read (READ-2) of the stored rows themselves. `attend` with one query
    position runs the decode-attention kernels over the fields where they lie; anywhere
    else (no CUDA, a shape the kernels do not take, several query positions) it attends
    through `decoded()`, READ-2's read of the same rows. (Not frozen: a decode step makes
    one a layer, and a frozen dataclass takes a microsecond more to make.)"""

    #: The stored sides, or the record that holds both: whole buffers.
    stored: Stored
    #: The kernels' launches for reads of this configuration (its storage's, kept).
    launches: ReadLaunches
    decoded: Callable[[], Read]
    #: The live row count as data (int32 [1]; COMPILE-4 in the compiled step): the kernels
    #: read the first rows[0] rows of the buffers. None: every row read.
    rows: mx.array | None = None
    #: The compiled step's new position, held apart from the buffers (COMPILE-4).
    slot: WriteSlot | None = None
    #: The order of each batch row's live rows (ROWS-6's padding, a ring's turn; with a slot,
    #: a ring's keep alone, `_slot_order`). None: the buffer's order, every row live.
    order: attention_kernels.RowsOrder | mx.array | None = None

    def attend(self, queries: mx.array, scale: float, tensor_cores: bool | None = None) -> mx.array:
        """READ-1 attention of `queries` [B, Hq, N, Dk] over the read's rows. On the kernels'
        path, `tensor_cores` picks their pass-1 body (READ-7; None: tensor cores where they
        fit); elsewhere it is not used."""
        launch = None
        if fused_kernels_enabled():
            launch = self.launches.launch(
                queries,
                scale,
                tensor_cores,
                self.rows is not None,
                self.slot is not None,
                self.order is not None,
            )
        if launch is None:
            return self.decoded().attend(queries, scale)
        slot = None if self.slot is None else (self.slot.position, self.slot.new)
        # The kernels widen the queries themselves; the output is in the read's format.
        return launch(queries, self.stored, self.rows, slot, self.order)


class ReadLaunches:
    """READ-7's launches over one configuration of stored rows (a storage's layout and the
    shape of its buffers: `serves`), made once per query configuration. A decode step reads
    one configuration at every layer and step until the buffers grow, and finding its
    launch anew (the stored formats, whether the kernels take them, the queries' fit) costs
    the host more than the rest of the read. Not copied with a storage: it holds no array,
    and what it holds depends only on what `serves` compares."""

    __slots__ = (
        "_formats",
        "_generation",
        "_launches",
        "_layout",
        "_record_format",
        "_rows_shape",
        "read_dtype",
    )

    def __init__(self, stored: Stored, read_dtype: mx.Dtype, layout: KvLayout) -> None:
        self._formats = attention_kernels.stored_formats(stored)
        self._layout = layout
        self._record_format, self._rows_shape = _stored_configuration(stored)
        #: The format keys are read in (the layout's dtype; float32 for TurboQuant, TQC-2).
        self.read_dtype = read_dtype
        self._launches: dict[tuple, attention_kernels.ReadLaunch | None] = {}
        #: The kernels' generation the launches were made in (KERNELS_MADE).
        self._generation = KERNELS_MADE.count

    def __copy__(self) -> ReadLaunches:
        return self

    def __deepcopy__(self, memo: dict) -> ReadLaunches:
        return self

    def serves(self, stored: Stored, layout: KvLayout) -> bool:
        """Whether `stored`, of a storage holding `layout`, is of this configuration."""
        record_format, rows_shape = _stored_configuration(stored)
        return (
            layout is self._layout
            and record_format is self._record_format
            and rows_shape == self._rows_shape
        )

    def launch(
        self,
        queries: mx.array,
        scale: float,
        tensor_cores: bool | None,
        counted: bool,
        slotted: bool,
        ordered: bool = False,
    ) -> attention_kernels.ReadLaunch | None:
        """`attention_kernels.read_launch` for these queries, their fit checked (READ-1:
        ValueError, at every call, for queries that do not fit); kept per query shape and
        dtype, scale, body, count and slot, until the kernels' caches are cleared
        (KERNELS_MADE). None where the kernels do not take the read, asked anew whenever
        MLX's default device is not a CUDA GPU."""
        if not attention_kernels.on_cuda():
            return None
        generation = KERNELS_MADE.count
        if generation != self._generation:
            # The kernel objects were dropped (other sources, shapes or stand-ins).
            self._launches.clear()
            self._generation = generation
        key = (queries.shape, queries.dtype, scale, tensor_cores, counted, slotted, ordered)
        try:
            return self._launches[key]
        except KeyError:
            pass
        launch = attention_kernels.read_launch(
            queries, self._formats, scale, self.read_dtype, counted, tensor_cores, slotted, ordered
        )
        if launch is not None:
            check_queries(queries, launch.keys_shape, self.read_dtype)
        self._launches[key] = launch
        return launch


def _stored_configuration(stored: Stored) -> tuple[object, tuple[int, ...]]:
    """What, beside the storage's layout, fixes how the kernels read `stored`: a record's
    format and shape, or the shape of the key codes (their formats follow the layout)."""
    if isinstance(stored, attention_kernels.StoredRecord):
        return stored.record_format, stored.record.shape
    return None, stored[0].codes.shape


class ReadMethods(reads.ReadMethods):
    """READ-2 .. READ-7, and what every MLX storage computes with: the reference's steps
    over mx.array, a decode read of stored fields, and deferred failures kept in the graph
    (DEFER-3)."""

    xp: ModuleType = mx
    masks: ModuleType = masks
    dense_read: type[reads.DenseRead] = DenseRead
    dtype_name = staticmethod(dtypes.dtype_name)

    @staticmethod
    def _detached(rows: mx.array) -> mx.array:
        # An MLX slice is a value: a later write rebinds the field, never the slice, so
        # no copy (CACHE-3, CACHE-8).
        return rows

    def _write_rows(self, start: int, parts: Fields) -> None:
        assert self._fields is not None
        self._fields = written_rows(self._fields, start, parts)

    def append_and_read(self, k: mx.array, v: mx.array, mask: Mask) -> Read:
        """A read without a mask is a decode read (READ-2): append, then READ-7's read of
        the stored rows, decoded only if its attention needs them, each batch row's live
        rows oldest first (`_row_order`: a padded batch's rows from their first position
        on, ROWS-6; a ring's from its oldest row on)."""
        padding = self._left_padding
        if mask is not None:
            return super().append_and_read(k, v, mask)
        self._append(k, v)
        # The buffers as they are now (a later write rebinds the fields, never changes
        # these), whole, and the live row count as data: no op at all. (A slice of the
        # buffers would be one more op per layer; the count is one array for every layer
        # at this offset.)
        fields = self._fields
        assert fields is not None
        rows = self._live_rows()
        offset = self.offset
        positions = self._live_positions() if padding else None

        def decoded() -> Read:
            live = tuple(field[:, :, :rows] for field in fields)
            if not padding:
                return self._read_of(live)
            # ROWS-6's mask of this decode, as it was at the append.
            assert positions is not None
            query = np.array([offset - 1])
            return self._read_of(
                live, self.masks.padded_mask(None, 1, positions(), np.array(padding), query)
            )

        stored = self._stored_rows(fields)
        # (Off CUDA no kernel reads the order: no array a step made for it.)
        ordered = (padding or self.rotates) and fused_kernels_enabled()
        order = self._row_order(rows) if ordered else None
        launches = self._launches(stored)
        return StoredRead(stored, launches, decoded, COUNTS.single(rows), order=order)

    #: READ-7: whether the storage's buffer rows may lie in another order than its positions
    #: (a ring's, `_rotation`).
    rotates: bool = False

    def _live_positions(self) -> Callable[[], np.ndarray]:
        """ROWS-6: the buffer position of each live row as the storage holds them now,
        computed when asked (`_buffer_positions`). Growable storage: row r holds r."""
        return partial(np.arange, self._live_rows())

    def _rotation(self, rows: int) -> tuple[int, int]:
        """READ-7: keep and turn of RowOrder for `rows` live rows: temporal row u lies at
        buffer row u below keep, at keep + (u - keep + turn) mod (rows - keep) from there
        on. Growable storage: every row in temporal order."""
        return 0, 0

    def _row_order(self, rows: int) -> attention_kernels.RowsOrder | None:
        """ROWS-6, READ-7: the order in which the kernels read each batch row's live rows,
        oldest first from its first position on; None where that is the buffer's order
        from row 0. The last `rows` positions are live, the oldest of them at
        offset - rows; row b's first left_padding[b] positions are hidden. The turn and
        the oldest position are counts in device memory, the padding one array per
        storage configuration: a decode loop makes no array from host data."""
        keep, turn = self._rotation(rows)
        oldest = self.offset - rows
        padding = self._left_padding
        if turn == 0 and all(pad <= oldest for pad in padding):
            return None
        layout = self._layout
        assert layout is not None
        order = attention_kernels.padding_order(keep, padding or (0,) * layout.batch)
        return attention_kernels.RowsOrder(order, COUNTS.single(turn), COUNTS.single(oldest))

    #: The launches of this storage's last read configuration (`_launches`).
    _read_launches: ReadLaunches | None = None

    def _launches(self, stored: Stored) -> ReadLaunches:
        """READ-7: the kernels' launches for reads of `stored`, kept while the storage reads
        that configuration."""
        layout = self._layout
        assert layout is not None
        known = self._read_launches
        if known is None or not known.serves(stored, layout):
            read_dtype = dtypes.FLOAT_DTYPES[layout.dtype]
            known = self._read_launches = ReadLaunches(stored, read_dtype, layout)
        return known

    def _stored_rows(self, fields: Fields) -> Stored:
        """READ-7: the stored fields as the kernels read them (`_stored_sides`)."""
        return self._stored_sides(fields)

    def _slot_read(
        self, fields: Fields, new: Fields, position: mx.array, active_length: mx.array
    ) -> Read:
        """COMPILE-4 on MLX: the write-slot read of MLX ops (SlotRead). On CUDA a one-query
        read runs READ-7's kernels over the first `active_length` rows of the buffers, given
        the new position apart (WriteSlot), oldest first as the eager read reads them
        (`_slot_order`); other reads there are the write-slot read."""
        visible = self._slot_visible(fields, position, active_length)
        portable = self._slot_decoded(fields, new, visible)
        if not fused_kernels_enabled():
            return portable
        stored = self._stored_rows(fields)
        slot = self._write_slot(position, new)
        launches = self._launches(stored)
        order = self._slot_order()
        return StoredRead(stored, launches, lambda: portable, active_length, slot, order)

    def _slot_order(self) -> mx.array | None:
        """READ-7 in the compiled step: the order the kernels' slot read takes (a ring's);
        None where the buffer's order is the positions' (growable storage)."""
        return None

    def _write_slot(self, position: mx.array, new: Fields) -> WriteSlot:
        """COMPILE-4: the new position's fields `new` as the kernels read them at buffer row
        position[0]."""
        new_keys, new_values = self._stored_sides(new)
        return WriteSlot(position, (new_keys, new_values))

    def _window_rows(self, plan: DecodePlan, length: int) -> int:
        """COMPILE-3 on MLX: on CUDA the kernels read the live rows of whole buffers, the
        count as data, and a step costs less than tracing its graph again: whole buffers.
        Elsewhere the read's cost follows its rows: the reference's window."""
        return length if fused_kernels_enabled() else super()._window_rows(plan, length)

    def _slot_decoded(self, fields: Fields, new: Fields, visible: mx.array) -> Read:
        """The write-slot read of stored rows `fields` and the new position's fields `new`,
        both decoded as READ-2's read decodes them, hidden rows' values zero."""
        stored = self._decode(self._values_hidden(fields, visible))
        return SlotRead(*stored, *self._decode(new), visible)

    #: The fields whose zero makes a row's values decode to zero: here the values
    #: themselves; scales (and biases) where codes are multiplied by them.
    value_magnitudes: tuple[int, ...] = (1,)

    def _values_hidden(self, fields: Fields, visible: mx.array) -> Fields:
        """`fields` with the `value_magnitudes` fields of the rows `visible` (bool [T]) does
        not mark zeroed: one pass over the smallest fields that zero the decoded values."""
        hidden = ~visible[:, None]
        return tuple(
            mx.where(hidden, mx.zeros((), field.dtype), field)
            if i in self.value_magnitudes
            else field
            for i, field in enumerate(fields)
        )

    def _read_of(self, live: Fields, mask: Mask = None) -> Read:
        """READ-2's read of live fields, decoded, under `mask` (a padded batch's)."""
        return self.dense_read(*self._decode(live), mask)

    def _stored_sides(self, fields: Fields) -> tuple[StoredSide, StoredSide]:
        """READ-7: keys and values of the stored fields as they lie. Here fields stored as
        given (CACHE-3, RING-1)."""
        keys, values = fields
        return (
            StoredSide(PLAIN, keys, None, None, 0, 0, keys.shape[-1]),
            StoredSide(PLAIN, values, None, None, 0, 0, values.shape[-1]),
        )

    @staticmethod
    def _int32_scalar(value: int) -> mx.array:
        """COMPILE-3 on MLX: one array per value, shared by every cache of a step (arrays are
        values), so that a step over many layers hands the device its write position and
        active length once, not once per layer; int32 [1], as the kernels take them, so
        that the graph holds no reshape of them per layer; views of a table in device memory
        (CountingTable), which the kernels read without crossing the bus."""
        return COUNTS.single(value)

    #: The plan of the last append that went the checked path (accelerated/caches/planned.py).
    _planned_append: PlannedAppend | None = None

    def _checked(self, k: mx.array, v: mx.array) -> tuple[KvLayout, Fields]:
        """CACHE-2, DEFER-3: an append of the planned shapes into the planned layout runs the
        planned encode, its running rank kept by `_record_failure` as the checked path keeps
        it; any other is checked as the reference checks it, and planned for the next."""
        planned = self._planned_append
        # (A padding `prepare` set, which the checked path applies, is only ever on a storage
        # holding nothing: no layout, so no plan takes its append.)
        if planned is not None and planned.takes(self, k, v):
            fields, failure = planned.encode(k, v, running(self))
            if failure is not None:
                fields = self._record_failure(fields, failure)
            return planned.layout, fields
        layout, fields = super()._checked(k, v)
        encode = self._append_encoder(k, v)
        self._planned_append = None if encode is None else PlannedAppend(k, v, layout, encode)
        return layout, fields

    def _append_encoder(self, k: mx.array, v: mx.array) -> Encoder | None:
        """What `_encode_recorded` does with an append shaped as `k`, `v`, its checks made
        here (raising as they would): an encode that later appends of the same shapes and
        dtype run unchecked (PlannedAppend). None where none is planned: eager checks,
        which read the input on the host, and encoders that check at every call."""
        return None

    def _rank_input(self) -> mx.array:
        """The running rank as the compiled step reads it (COMPILE-3): uint32 [1], zero
        before the first record."""
        failure = running(self)
        return mx.zeros((1,), mx.uint32) if failure is None else failure

    def _record_failure(self, fields: Fields, failure: mx.array) -> Fields:
        """DEFER-3: keep the running rank as a lazy uint32 [1]. The encoders hand back
        fields whose evaluation evaluates it (on CUDA one launch makes both; the MLX-ops
        encoders tie the first field to it), so its graph stays one step deep however long
        a decode loop runs, and no step reads it on the host."""
        self._failure = failure
        return fields


def written_rows(fields: Fields, start: int, parts: Fields) -> Fields:
    """`fields` with `parts` [B, H, L, *] over rows start .. start + L - 1 (CACHE-3 step 2,
    RING-2 step 4), as new array objects: no stored array object is changed, so a read,
    fetch or state holding the old ones needs no copy. (Evaluated, an update still writes
    its buffer in place when nothing else holds it.) The start is a Python int, a static
    slice write: mx.slice_update with an array start costs about 0.5 ms per layer on MLX's
    CUDA backend (0.32.4, docs/performance-log.md)."""
    written = []
    for field, part in zip(fields, parts, strict=True):
        field = copy.copy(field)
        field[:, :, start : start + part.shape[2]] = part
        written.append(field)
    return tuple(written)


def running(storage: ReadMethods) -> mx.array | None:
    """A deferred storage's running failure rank (DEFER-3); None before its first record."""
    failure = storage._failure
    return failure if isinstance(failure, mx.array) else None
