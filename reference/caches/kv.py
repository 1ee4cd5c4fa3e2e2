"""Growable storage: positions 0..offset-1 at buffer rows 0..offset-1 (spec CACHE-3 ..
CACHE-8), and `KVCache`, which stores keys and values as given."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvspec.reference.caches.compiled import DecodePlan, DecodeRoom
from kvspec.reference.caches.protocol import (
    CacheState,
    Mask,
    require,
)
from kvspec.reference.caches.storage import Fields, FieldStorage, PlainFields

if TYPE_CHECKING:
    from kvspec.reference.caches.quantized import QuantizedKVCache

#: Capacity grows in steps of this many positions (CACHE-3).
STEP = 256


class GrowingStorage(FieldStorage):
    """Stored fields [B, H, capacity, *] of which rows 0..offset-1 are live (CACHE-3).

    Invariants: no fields iff nothing was ever appended (or the cache was consumed);
    0 <= offset <= capacity; all fields share B, H and capacity.
    Subclasses say how positions are encoded into fields and decoded back; arrays are made
    through ReadMethods' namespace `xp`.
    """

    @property
    def ring_index(self) -> int | None:
        return None

    @property
    def sliding_window(self) -> int | None:
        return None

    @property
    def capacity(self) -> int:
        """Positions the buffers hold room for (CACHE-3)."""
        return 0 if self._fields is None else self._fields[0].shape[2]

    def update_and_fetch(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Write the new positions at the offset, growing first if needed, and return
        positions 0..offset-1 decoded (CACHE-3)."""
        self._append(k, v)
        return self._decode(self._live())

    def _append(self, k: np.ndarray, v: np.ndarray) -> None:
        """CACHE-3 steps 1 .. 3 but the fetch."""
        layout, new = self._checked(k, v)
        L = k.shape[2]
        prev = self.offset
        if self._fields is None or prev + L > self.capacity:
            self._fields = self._grown(new, prev, L)
        self._write_rows(prev, new)
        self.offset = prev + L
        self._layout = layout

    def _grown(self, new: Fields, prev: int, L: int) -> Fields:
        # mlx-lm's rule: whole steps covering L; a buffer whose offset is not on a step
        # boundary is first cut to the offset (positions beyond it are dropped).
        n_steps = (STEP + L - 1) // STEP
        room = [
            self.xp.zeros((*part.shape[:2], n_steps * STEP, part.shape[3]), part.dtype)
            for part in new
        ]
        if self._fields is None:
            return tuple(room)
        kept = self._fields
        if prev % STEP != 0:
            kept = tuple(field[:, :, :prev] for field in kept)
        return tuple(
            self.xp.concatenate([field, extra], axis=2)
            for field, extra in zip(kept, room, strict=True)
        )

    def _decode_room(self) -> DecodeRoom:
        """COMPILE-2: CACHE-3 step 1 for one position; the step writes row offset and reads
        rows 0 .. offset."""
        assert self._fields is not None
        prev = self.offset
        fields = self._fields
        if prev + 1 > self.capacity:
            fields = self._grown(tuple(field[:, :, :1] for field in fields), prev, 1)
        return DecodeRoom(DecodePlan(prev, prev + 1), fields)

    def _write_decoded(self, new: Fields, position: int) -> None:
        """COMPILE-5: CACHE-3 steps 2 and 3 for the position the plan made room for."""
        self._write_rows(position, new)
        self.offset = position + 1

    def _live_rows(self) -> int:
        """How many leading buffer rows are live: the offset (CACHE-3)."""
        return self.offset

    def _live(self) -> Fields:
        assert self._fields is not None
        return tuple(self._detached(field[:, :, : self.offset]) for field in self._fields)

    def is_trimmable(self) -> bool:
        """Always (CACHE-5)."""
        return True

    def trim(self, n: int) -> int:
        """Lower the offset by min(n, offset), at most the shortest row's positions (ROWS-7);
        stored rows stay until overwritten (CACHE-5)."""
        trimmed = self._trimmed_count(n)
        self.offset -= trimmed
        return trimmed

    def make_mask(self, n: int, window_size: int | None) -> Mask:
        """MASK-2."""
        return self.masks.make_mask(n, self.offset, window_size)

    def state(self) -> CacheState[np.ndarray]:
        """CACHE-8: the fields cut to the offset, in the kind's slot order; first raises a
        recorded deferred failure (DEFER-3)."""
        self.check()
        arrays = () if self._fields is None else self._live()
        return CacheState(
            self.signature(),
            arrays,
            self.offset,
            None,
            self.minimum_reusable_offset,
            self._left_padding,
        )

    def restore_state(self, state: CacheState[np.ndarray]) -> None:
        """CACHE-8: adopt fields of `offset` rows; capacity becomes the offset."""
        if state.signature != self.signature():
            raise ValueError(f"state of {state.signature!r} cannot restore {self.signature()!r}")
        if state.ring_index is not None:
            raise ValueError("a growable cache has no ring index")
        layout = None
        if state.arrays:
            if any(a.shape[2] != state.offset for a in state.arrays):
                raise ValueError(f"state arrays must hold exactly offset={state.offset} rows")
            layout = self._layout_of(state.arrays)
        elif state.offset != 0:
            raise ValueError("a state without arrays must have offset 0")
        padding = self._checked_padding(state, layout.batch if layout else None)
        self._fields = tuple(self.xp.array(a) for a in state.arrays) if state.arrays else None
        self._layout = layout
        self.offset = state.offset
        self.minimum_reusable_offset = state.minimum_reusable_offset
        self._failure = 0
        self._left_padding = padding
        self._prepared_padding = ()

    def check_invariants(self) -> None:
        """CACHE-3 invariants, and ROWS-5's."""
        if self._fields is None:
            require(self.offset == 0 and self._layout is None, "empty storage holds positions")
            return
        require(0 <= self.offset <= self.capacity, f"offset {self.offset} > capacity")
        for field in self._fields:
            require(field.shape[:3] == self._fields[0].shape[:3], "fields disagree on B, H, T")
        self._check_padding_invariants()


class KVCache(PlainFields, GrowingStorage):
    """Keys and values stored as given, in the input dtype (CACHE-3).

    Slot order (CACHE-8): keys [B, H, offset, Dk], values [B, H, offset, Dv].
    """

    def signature(self) -> str:
        return "kv"

    def to_quantized(self, group_size: int, bits: int, checks: str = "eager") -> QuantizedKVCache:
        """The live window quantized into a new QuantizedKVCache with `checks` (DEFER-3);
        this cache is consumed: left empty (CACHE-9). Offset and minimum reusable offset
        carry over."""
        target = self._new_quantized(group_size, bits, checks)
        window = self.keys_and_values()
        if window is not None:
            assert self._layout is not None
            target.adopt_encoded(*window, self._layout)
        target.carry_positions(self)
        self.release()
        return target

    def _new_quantized(self, group_size: int, bits: int, checks: str) -> QuantizedKVCache:
        """An empty QuantizedKVCache of this backend: the target of `to_quantized`."""
        from kvspec.reference.caches.quantized import QuantizedKVCache

        return QuantizedKVCache(group_size, bits, checks=checks)
