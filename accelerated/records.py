"""Records: a row's fields side by side in one uint8 buffer, each at its offset, the row's
end zero. The MLX storages keep their fields in one record per cache
(accelerated/caches/records.py) and the CUDA encoders write one: on MLX's CUDA backend
every array an op takes or makes costs the host time at every decode step
(docs/performance-log.md). A record holds the fields' own bits; the stored format is theirs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx

from kvspec.reference.caches.storage import Fields

#: A record row's bytes are a multiple of this, and no field's offset needs more.
ROW_ALIGNMENT = 16


class RecordLayout(NamedTuple):
    """Each field's dtype (its name in mlx.core: a cache is deep-copied, and an mx.Dtype
    cannot be), width (elements per row) and byte offset in a row; the row's bytes."""

    dtypes: tuple[str, ...]
    widths: tuple[int, ...]
    offsets: tuple[int, ...]
    row_bytes: int


def _alignment(row_bytes: int) -> int:
    # The largest power of two up to ROW_ALIGNMENT dividing a field's row: a kernel's loads
    # of the field (whole shares of the row, a power of two bytes each) stay aligned.
    alignment = 1
    while alignment < ROW_ALIGNMENT and row_bytes % (2 * alignment) == 0:
        alignment *= 2
    return alignment


def record_layout(fields: Sequence[tuple[mx.Dtype, int]]) -> RecordLayout:
    """The layout of fields of (dtype, width) side by side: in order of decreasing
    alignment (the largest power of two up to ROW_ALIGNMENT dividing the field's bytes per
    row; the given order among equals), each at the first offset past the one placed before
    it that is a multiple of its alignment, the row padded to ROW_ALIGNMENT bytes (so that
    every row starts aligned). Placing the widest alignments first leaves no gap but the
    row's end. The offsets are given in the fields' order."""
    sizes = [width * dtype.size for dtype, width in fields]
    order = sorted(range(len(fields)), key=lambda i: -_alignment(sizes[i]))
    offsets = [0] * len(fields)
    end = 0
    for i in order:
        alignment = _alignment(sizes[i])
        end = -(-end // alignment) * alignment
        offsets[i] = end
        end += sizes[i]
    row_bytes = -(-end // ROW_ALIGNMENT) * ROW_ALIGNMENT
    dtypes = tuple(str(dtype).removeprefix("mlx.core.") for dtype, _ in fields)
    widths = tuple(width for _, width in fields)
    return RecordLayout(dtypes, widths, tuple(offsets), row_bytes)


def layout_of(fields: Fields) -> RecordLayout:
    """The record layout of `fields` [B, H, T, w_i]."""
    return record_layout([(field.dtype, field.shape[3]) for field in fields])


def packed(fields: Fields, layout: RecordLayout) -> mx.array:
    """`fields` [B, H, T, *] as one uint8 record [B, H, T, row_bytes], the row's end zero."""
    # Placed by decreasing alignment, fields leave no gap between them (record_layout):
    # the row's end is the only one.
    placed = sorted(zip(layout.offsets, fields, strict=True), key=lambda pair: pair[0])
    parts = [field.view(mx.uint8) for _, field in placed]
    padding = layout.row_bytes - placed[-1][0] - parts[-1].shape[3]
    if padding > 0:
        parts.append(mx.zeros((*fields[0].shape[:3], padding), mx.uint8))
    return mx.concatenate(parts, axis=3)


def unpacked(record: mx.array, layout: RecordLayout) -> Fields:
    """The fields of `record` [B, H, T, row_bytes], each a view of it."""
    return tuple(field_view(record, layout, i) for i in range(len(layout.dtypes)))


def field_view(record: mx.array, layout: RecordLayout, index: int) -> mx.array:
    """Field `index` of `record` [B, H, T, row_bytes], a view of it."""
    dtype = getattr(mx, layout.dtypes[index])
    offset = layout.offsets[index]
    return record[..., offset : offset + layout.widths[index] * dtype.size].view(dtype)
