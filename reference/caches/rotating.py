"""Ring storage with mlx-lm's `RotatingKVCache` semantics (spec RING-1 .. RING-6), and
`RotatingKVCache`, which stores keys and values as given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvspec.reference.caches.compiled import DecodePlan, DecodeRoom
from kvspec.reference.caches.kv import STEP
from kvspec.reference.caches.protocol import (
    CacheState,
    Mask,
    require,
)
from kvspec.reference.caches.storage import Fields, FieldStorage, PlainFields

if TYPE_CHECKING:
    from kvspec.reference.caches.rotating_quantized import RotatingQuantizedKVCache


def ring_positions(offset: int, ring_index: int, length: int) -> np.ndarray:
    """ROWS-6: the position each live row of a ring with keep 0 holds, rows 0 ..
    min(offset, length) - 1 in ring order (RING-4): the newest at row ring_index - 1, the
    rows from ring_index on older once the ring wrapped (ring_index < offset)."""
    rows = np.arange(min(offset, length))
    wrapped = (rows >= ring_index) & (ring_index < offset)
    return offset - ring_index + rows - np.where(wrapped, length, 0)


def check_ring_parameters(max_size: int, keep: int) -> None:
    """RING-1: 1 <= max_size and 0 <= keep < max_size, else ValueError."""
    if max_size < 1:
        raise ValueError(f"max_size must be at least 1, got {max_size}")
    if not 0 <= keep < max_size:
        raise ValueError(f"keep must be in [0, max_size), got {keep}")


class RingStorage(FieldStorage):
    """A sliding window of `max_size` positions whose first `keep` are never evicted
    (RING-1). Fields are [B, H, T, *]; `ring_index` is where the next one-position append
    writes.

    Invariants (RING-1): no fields iff nothing was appended (or the cache was consumed);
    0 <= keep < max_size; ring_index <= T; min(offset, max_size) <= T; while
    offset < max_size the buffer is in temporal order and ring_index == offset; once
    offset >= max_size, keep <= ring_index; T > max_size only as RING-3 leaves it, with
    ring_index == T. Arrays are made through ReadMethods' `xp`.
    """

    def __init__(self, max_size: int, keep: int = 0, checks: str = "eager") -> None:
        check_ring_parameters(max_size, keep)
        super().__init__(checks)
        self.max_size = max_size
        self.keep = keep
        self._index = 0

    @property
    def ring_index(self) -> int | None:
        return self._index

    @property
    def sliding_window(self) -> int | None:
        return self.max_size

    @property
    def length(self) -> int:
        """T: positions the buffers hold (RING-1)."""
        return 0 if self._fields is None else self._fields[0].shape[2]

    def update_and_fetch(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One position: in place (RING-2); more: in temporal order, then concatenated
        (RING-3). Returns the live buffer decoded, in ring order (RING-4)."""
        self._append(k, v)
        return self._decode(self._live())

    def _append(self, k: np.ndarray, v: np.ndarray) -> None:
        """RING-2, RING-3 but the fetch."""
        layout, new = self._checked(k, v)
        if k.shape[2] == 1:
            self._update_in_place(new)
        else:
            self._update_concat(new)
        self._layout = layout

    def _update_in_place(self, new: Fields) -> None:
        """RING-2."""
        self._fields, self._index, _ = self._ring_room(new)
        self._write_decoded(new, self._index)

    def _ring_room(self, new: Fields) -> tuple[Fields, int, int]:
        """RING-2 steps 1 .. 3 for one position of the widths and dtypes of `new`: the
        buffers, the ring index to write at and the rows the buffers hold (the cache itself
        unchanged)."""
        prev = self.offset
        fields, index = self._fields, self._index
        # The buffers' rows, read once (a field of a record is a view to make: accelerated).
        rows = self.length
        if fields is None or (prev >= rows and rows < self.max_size):
            # Grow by a step, never past max_size.
            size = min(STEP, self.max_size - prev)
            room = tuple(self.xp.zeros((*p.shape[:2], size, p.shape[3]), p.dtype) for p in new)
            if fields is None:
                fields = room
            else:
                fields = tuple(
                    self.xp.concatenate([f, r], axis=2) for f, r in zip(fields, room, strict=True)
                )
            rows = fields[0].shape[2]
            index = prev
        excess = rows - self.max_size
        if excess > 0:
            # A multi-position update left more than max_size: drop the oldest after keep.
            fields = self._evicted(excess, fields)
            rows = self.max_size
            index = self.max_size
        if index == self.max_size:
            index = self.keep
        return fields, index, rows

    def _decode_room(self) -> DecodeRoom:
        """COMPILE-2, RING-2 steps 1 .. 3: the step writes row i and reads rows
        0 .. min(offset + 1, T) - 1, in ring order (RING-4)."""
        assert self._fields is not None
        # The fields stand for one new position: the room takes only their widths.
        fields, index, rows = self._ring_room(self._fields)
        return DecodeRoom(DecodePlan(index, min(self.offset + 1, rows)), fields)

    def _write_decoded(self, new: Fields, position: int) -> None:
        """RING-2 step 4 at row `position`, the ring index steps 1 .. 3 chose."""
        self._write_rows(position, new)
        self.offset += 1
        self._index = position + 1

    def _update_concat(self, new: Fields) -> None:
        """RING-3."""
        if self._fields is None:
            self._fields = new
        else:
            ordered = self._temporal_order(self._fields)
            # Keep max_size - 1 old positions so each new query still sees max_size.
            excess = ordered[0].shape[2] - self.max_size + 1
            kept = self._evicted(excess, ordered)
            self._fields = tuple(
                self.xp.concatenate([f, p], axis=2) for f, p in zip(kept, new, strict=True)
            )
        self.offset += new[0].shape[2]
        self._index = self.length

    def _evicted(self, count: int, fields: Fields) -> Fields:
        """Drop `count` positions right after the first `keep` (RING-3)."""
        if count <= 0:
            return fields
        return tuple(
            self.xp.concatenate([f[:, :, : self.keep], f[:, :, count + self.keep :]], axis=2)
            for f in fields
        )

    def _temporal_order(self, fields: Fields) -> Fields:
        """The buffer oldest first, unused tail cut (RING-3)."""
        if self._index == self.length:
            return fields
        if self._index < self.offset:
            return tuple(
                self.xp.concatenate(
                    [
                        f[:, :, : self.keep],
                        f[:, :, self._index :],
                        f[:, :, self.keep : self._index],
                    ],
                    axis=2,
                )
                for f in fields
            )
        return tuple(f[:, :, : self._index] for f in fields)

    def _live_rows(self) -> int:
        """How many leading buffer rows are live: min(offset, T) (RING-4)."""
        return min(self.offset, self.length)

    def _live(self) -> Fields:
        assert self._fields is not None
        end = self._live_rows()
        return tuple(self._detached(f[:, :, :end]) for f in self._fields)

    def is_trimmable(self) -> bool:
        """Only while nothing was evicted: offset < max_size (RING-5)."""
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        """RING-5: lower offset and ring index by min(n, offset), at most the shortest
        row's positions (ROWS-7)."""
        if n < 0:
            raise ValueError(f"cannot trim a negative count {n}")
        if not self.is_trimmable():
            raise ValueError(
                f"a ring holding offset {self.offset} >= max_size {self.max_size} has evicted "
                "positions and cannot be trimmed"
            )
        trimmed = self._trimmed_count(n)
        self.offset -= trimmed
        self._index -= trimmed
        return trimmed

    def prepare(self, *, left_padding: Sequence[int]) -> None:
        """ROWS-11; a ring pads rows only with keep 0 (ROWS-5)."""
        if self.keep and any(left_padding):
            raise ValueError(
                f"rows of their own lengths need a ring with keep 0, not {self.keep} (ROWS-5)"
            )
        super().prepare(left_padding=left_padding)

    def _buffer_positions(self, count: int) -> np.ndarray:
        """ROWS-6: the live rows' positions in ring order, then a block's after them."""
        live = ring_positions(self.offset, self._index, self.length)
        block = self.offset + np.arange(count - live.size)
        return np.concatenate([live, block])

    def make_mask(self, n: int, window_size: int | None) -> Mask:
        """MASK-3."""
        return self.masks.rotating_make_mask(
            n, self.offset, self.max_size, self.keep, self._index, window_size
        )

    def state(self) -> CacheState[np.ndarray]:
        """RING-6: the whole buffer in ring order, offset, ring index; first raises a
        recorded deferred failure (DEFER-3)."""
        self.check()
        arrays = () if self._fields is None else tuple(self.xp.array(f) for f in self._fields)
        return CacheState(
            self.signature(),
            arrays,
            self.offset,
            self._index,
            self.minimum_reusable_offset,
            self._left_padding,
        )

    def restore_state(self, state: CacheState[np.ndarray]) -> None:
        """RING-6."""
        if state.signature != self.signature():
            raise ValueError(f"state of {state.signature!r} cannot restore {self.signature()!r}")
        index = state.ring_index
        length = state.arrays[0].shape[2] if state.arrays else 0
        if index is None or not 0 <= index <= length:
            raise ValueError(f"ring index {index} must be in [0, {length}]")
        layout = self._layout_of(state.arrays) if state.arrays else None
        if not state.arrays and state.offset != 0:
            raise ValueError("a state without arrays must have offset 0")
        padding = self._checked_padding(state, layout.batch if layout else None)
        if padding and self.keep:
            raise ValueError(
                f"rows of their own lengths need a ring with keep 0, not {self.keep} (ROWS-5)"
            )
        self._fields = tuple(self.xp.array(a) for a in state.arrays) if state.arrays else None
        self._layout = layout
        self.offset = state.offset
        self._index = index
        self.minimum_reusable_offset = state.minimum_reusable_offset
        self._failure = 0
        self._left_padding = padding
        self._prepared_padding = ()

    def release(self) -> None:
        """Back to the constructed state, ring index 0 included (CACHE-9)."""
        super().release()
        self._index = 0

    def check_invariants(self) -> None:
        """RING-1 invariants, and ROWS-5's."""
        if self._fields is None:
            require(self.offset == 0 and self._index == 0, "empty ring holds positions")
            return
        T = self.length
        require(self._index <= T, f"ring index {self._index} > length {T}")
        require(min(self.offset, self.max_size) <= T, f"length {T} < min(offset, max_size)")
        if self.offset < self.max_size:
            require(self._index == self.offset, f"ring index {self._index} != offset {self.offset}")
        else:
            require(self.keep <= self._index, f"ring index {self._index} < keep {self.keep}")
        if self.max_size < T:
            require(self._index == T, f"ring index {self._index} != length {T} > max_size")
        for field in self._fields:
            require(field.shape[:3] == self._fields[0].shape[:3], "fields disagree on B, H, T")
        self._check_padding_invariants()
        require(not (self._left_padding and self.keep), "a padded ring keeps positions")


class RotatingKVCache(PlainFields, RingStorage):
    """Keys and values stored as given in a ring (RING-1).

    Slot order (RING-6): keys [B, H, T, Dk], values [B, H, T, Dv], the buffer in ring order.
    """

    def signature(self) -> str:
        return f"kv:rotating:{self.max_size}:{self.keep}"

    def to_quantized(
        self, group_size: int, bits: int, checks: str = "eager"
    ) -> RotatingQuantizedKVCache:
        """The whole buffer quantized position by position into a RotatingQuantizedKVCache
        with this ring's max_size, keep, offset and ring index, and `checks` (DEFER-3);
        this cache is consumed (CACHE-9, QRING-2)."""
        target = self._new_quantized(group_size, bits, checks)
        if self._fields is not None:
            assert self._layout is not None
            target.adopt_encoded(*self._fields, self._layout)
        target.carry_positions(self)
        target._index = self._index
        self.release()
        return target

    def _new_quantized(self, group_size: int, bits: int, checks: str) -> RotatingQuantizedKVCache:
        """An empty RotatingQuantizedKVCache of this backend with this ring's max_size and
        keep: the target of `to_quantized`."""
        from kvspec.reference.caches.rotating_quantized import RotatingQuantizedKVCache

        return RotatingQuantizedKVCache(self.max_size, group_size, bits, self.keep, checks)
