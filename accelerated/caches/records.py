"""A storage's fields in one record (accelerated/records.py), for the MLX storages: one
slice write stores a position, one encode output makes it and one attention input reads
it, where fields apart take one of each per field. Reading `_fields` gives the fields
back as views of the record."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import mlx.core as mx

from kvspec.accelerated.attention_kernels import RecordFormat, StoredRecord, side_format
from kvspec.accelerated.caches.planned import Encoder
from kvspec.accelerated.caches.reads import WriteSlot, written_rows
from kvspec.accelerated.records import RecordLayout, field_view, layout_of, packed, unpacked
from kvspec.reference.caches.kv import STEP
from kvspec.reference.caches.storage import Fields


class RecordFields(Sequence):
    """The fields of a record, as a sequence of views made when first read: a decode step
    that only writes and reads the record (`record`) makes none."""

    def __init__(self, record: mx.array, layout: RecordLayout) -> None:
        self.record = record
        self.layout = layout
        self._views: Fields | None = None

    def views(self) -> Fields:
        """The fields, views of the record (made at the first call)."""
        if self._views is None:
            self._views = unpacked(self.record, self.layout)
        return self._views

    def __len__(self) -> int:
        return len(self.layout.dtypes)

    def __getitem__(self, index: Any) -> Any:
        if self._views is None and isinstance(index, int):
            # One field's view alone (a ring asks fields[0] for its rows at every step).
            return field_view(self.record, self.layout, index)
        return self.views()[index]

    def __iter__(self) -> Iterator[mx.array]:
        return iter(self.views())


#: What the kernels read a record with, by storage type, signature and record layout
#: (which decide it; a layout alone does not: 8-bit groups of 32 at head dim 32 lay out as
#: 4-bit groups of 64 at 64): its RecordFormat (`_stored_sides`).
_READ_FORMATS: dict[tuple[type, str, RecordLayout], RecordFormat] = {}


class RecordStorage:
    """An MLX storage whose fields live in one record (above). Whatever reads `_fields`
    gets the record's RecordFields; whatever sets them gives a record (RecordFields are
    taken as they are, other fields packed); a write of rows is one slice write of a
    record's rows."""

    _record: mx.array | None = None
    _record_layout: RecordLayout | None = None
    #: The RecordFields of the record they were made for.
    _record_fields: RecordFields | None = None
    #: The last record layout read and its RecordFormat (`_stored_rows`, at every step).
    _read_format: tuple[RecordLayout, RecordFormat] | None = None

    @property  # type: ignore[override]
    def _fields(self) -> RecordFields | None:
        record = self._record
        if record is None:
            return None
        fields = self._record_fields
        if fields is None or fields.record is not record:
            assert self._record_layout is not None
            fields = RecordFields(record, self._record_layout)
            self._record_fields = fields
        return fields

    @_fields.setter
    def _fields(self, fields: Fields | None) -> None:
        if fields is None:
            self._record = self._record_fields = None
            return
        if not isinstance(fields, RecordFields):
            layout = layout_of(fields)
            fields = RecordFields(packed(fields, layout), layout)
        self._record, self._record_layout = fields.record, fields.layout
        self._record_fields = fields

    @property
    def capacity(self) -> int:
        """Positions the buffers hold room for (CACHE-3)."""
        return 0 if self._record is None else self._record.shape[2]

    def _write_rows(self, start: int, parts: Fields) -> None:
        assert self._record is not None and self._record_layout is not None
        rows = parts.record if isinstance(parts, RecordFields) else None
        layout = self._record_layout
        if rows is None or (parts.layout is not layout and parts.layout != layout):
            rows = packed(parts, layout)
        (self._record,) = written_rows((self._record,), start, (rows,))
        # The RecordFields of the record before would hold it, and its write would copy it.
        self._record_fields = None

    def _append_encoder(self, k: mx.array, v: mx.array) -> Encoder | None:
        """The storage's one-launch record encode (`_record_encoder`, which each record
        storage has) where deferred checks take it; eager checks read the input on the host."""
        if self.checks != "deferred":  # type: ignore[attr-defined]
            return None
        return self._record_encoder(k, v)  # type: ignore[attr-defined]

    def _step_arrays(self, fields: Fields) -> tuple[mx.array, ...]:
        """COMPILE-3, COMPILE-4: a compiled step takes and gives the record, not its views."""
        if isinstance(fields, RecordFields):
            return (fields.record,)
        return (packed(fields, layout_of(fields)),)

    def _step_fields(self, arrays: tuple[mx.array, ...]) -> Fields:
        """The fields of a step's record (`_step_arrays`)."""
        assert self._record_layout is not None
        (record,) = arrays
        return RecordFields(record, self._record_layout)

    def _write_slot(self, position: mx.array, new: Fields) -> Any:
        """COMPILE-4: the new position's record row, as the kernels read it."""
        if not isinstance(new, RecordFields):
            return super()._write_slot(position, new)  # type: ignore[misc]
        return WriteSlot(position, new.record)

    def _stored_rows(self, fields: Fields) -> Any:
        """READ-7: the record as the kernels read it (one input)."""
        if not isinstance(fields, RecordFields):
            return super()._stored_rows(fields)  # type: ignore[misc]
        known = self._read_format
        if known is not None and known[0] is fields.layout:
            return StoredRecord(fields.record, known[1])
        signature = self.signature()  # type: ignore[attr-defined]
        key = (type(self), signature, fields.layout)
        record_format = _READ_FORMATS.get(key)
        if record_format is None:
            keys, values = self._stored_sides(fields)  # type: ignore[attr-defined]
            # The sides hold views of the record: each field's offset is its view's.
            views = [id(view) for view in fields]
            stored = [
                views.index(id(array))
                for side in (keys, values)
                for array in (side.codes, side.scales, side.biases)
                if array is not None
            ]
            offsets = tuple(fields.layout.offsets[i] for i in stored)
            record_format = RecordFormat(side_format(keys), side_format(values), offsets)
            _READ_FORMATS[key] = record_format
        self._read_format = (fields.layout, record_format)
        return StoredRecord(fields.record, record_format)


class GrowingRecordStorage(RecordStorage):
    """A growable storage (CACHE-3) in one record: growth adds rows to the record."""

    def _grown(self, new: Fields, prev: int, L: int) -> Fields:
        """CACHE-3 step 1 (mlx-lm's rule, as the reference's `_grown`) on the record: whole
        steps covering L, a record whose offset is off a step boundary first cut to it."""
        layout = self._record_layout if self._record is not None else layout_of(new)
        B, H = new[0].shape[:2]
        room = mx.zeros((B, H, -(-L // STEP) * STEP, layout.row_bytes), mx.uint8)
        if self._record is None:
            return RecordFields(room, layout)
        kept = self._record if prev % STEP == 0 else self._record[:, :, :prev]
        return RecordFields(mx.concatenate([kept, room], axis=2), layout)


class RingRecordStorage(RecordStorage):
    """A ring (RING-1) in one record."""

    @property
    def length(self) -> int:
        """T: positions the buffers hold (RING-1)."""
        return 0 if self._record is None else self._record.shape[2]


def record_encode(
    k: mx.array,
    v: mx.array,
    prior: mx.array | None,
    encode: Callable[..., tuple[mx.array, mx.array]],
    layout: RecordLayout,
) -> tuple[RecordFields, mx.array]:
    """A record storage's encode (reads.Encoder): `encode(k, v, prior=prior)`'s record of
    `layout` as the storage's fields, and the running rank it returns."""
    record, failure = encode(k, v, prior=prior)
    return RecordFields(record, layout), failure
