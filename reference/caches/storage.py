"""What the growable and the ring storage share (spec CACHE-2, CACHE-6, CACHE-9): stored
fields [B, H, T, *] with the layout of what was appended, the codec hooks that fill them,
and `PlainFields`, the hooks of storage that keeps keys and values as given."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import numpy as np

from kvspec.reference.caches.compiled import DecodeStepMethods
from kvspec.reference.caches.protocol import (
    CacheState,
    KvLayout,
    Mask,
    check_checks,
    kv_layout,
    require,
    require_same_layout,
)
from kvspec.reference.caches.reads import ReadMethods
from kvspec.reference.deferred import failure_message

Fields = tuple[np.ndarray, ...]


class FieldStorage(DecodeStepMethods, ReadMethods):
    """Stored fields (None until the first append), their layout, offset and minimum
    reusable offset (CACHE-1). Subclasses say how positions are encoded into fields and
    decoded back, and which stored rows are live; a compiled decode step drives them
    through DecodeStepMethods (COMPILE-2 .. COMPILE-5)."""

    #: The value checks a deferred encode of this storage ranks (DEFER-2); none when the
    #: storage keeps positions as given.
    deferred_checks: tuple[str, ...] = ()

    def __init__(self, checks: str = "eager") -> None:
        check_checks(checks)
        self.checks = checks
        self.offset = 0
        self.minimum_reusable_offset = 0
        self._fields: Fields | None = None
        self._layout: KvLayout | None = None
        self._failure = 0
        # Empty while every row starts at buffer position 0 (ROWS-5).
        self._left_padding: tuple[int, ...] = ()
        # Padding `prepare` set for the first append (ROWS-11).
        self._prepared_padding: tuple[int, ...] = ()

    @abstractmethod
    def _encode(self, k: np.ndarray, v: np.ndarray) -> Fields:
        """Fields of new positions; raises ValueError for what the storage cannot hold."""

    def _encode_deferred(self, k: np.ndarray, v: np.ndarray) -> tuple[Fields, int]:
        """Fields of new positions with NaN groups where the input cannot be held (DEFER-1),
        and the running failure rank: the larger of the cache's and this encode's (DEFER-2,
        DEFER-3). Storage that keeps positions as given has nothing to defer."""
        return self._encode(k, v), self._failure

    @abstractmethod
    def _decode(self, fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of stored positions."""

    @abstractmethod
    def _layout_of(self, fields: Fields) -> KvLayout:
        """The layout that stored fields imply (for restore_state)."""

    @abstractmethod
    def _append(self, k: np.ndarray, v: np.ndarray) -> None:
        """Store the new positions (checked first, CACHE-2); no fetch."""

    def _write_rows(self, start: int, parts: Fields) -> None:
        """Write `parts` [B, H, L, *] over the stored rows start .. start + L - 1 (CACHE-3
        step 2, RING-2 step 4)."""
        assert self._fields is not None
        L = parts[0].shape[2]
        for field, part in zip(self._fields, parts, strict=True):
            field[:, :, start : start + L] = part

    @abstractmethod
    def _live_rows(self) -> int:
        """How many leading buffer rows `_live` returns."""

    @abstractmethod
    def _live(self) -> Fields:
        """The stored rows a fetch returns, detached from the fields."""

    @property
    def layout(self) -> KvLayout | None:
        return self._layout

    @property
    def left_padding(self) -> tuple[int, ...]:
        """ROWS-5: B zeros unless rows of their own lengths were merged; () while empty."""
        if self._layout is None:
            return ()
        return self._left_padding or (0,) * self._layout.batch

    def _trimmed_count(self, n: int) -> int:
        """CACHE-5, ROWS-7: how many positions `trim(n)` drops from every row: n, at most
        the positions of the shortest row."""
        if n < 0:
            raise ValueError(f"cannot trim a negative count {n}")
        return min(n, self.offset - max(self._left_padding, default=0))

    def _buffer_positions(self, count: int) -> np.ndarray:
        """ROWS-6: the buffer position of each of the first `count` rows a read sees: the
        stored rows it fetched, then a block that is not appended (READ-5)."""
        return np.arange(count)

    def _rows_mask(self, mask: Mask, n: int, t: int, appended: bool = True) -> Mask:
        """ROWS-6: `mask` for `n` queries over `t` keys, and each row's padding hidden from
        that row's queries; `mask` itself while no row is padded. The queries of an append
        are its positions, the last `n` (ROWS-11)."""
        if not self._left_padding:
            return mask
        queries = np.arange(self.offset - n, self.offset) if appended else None
        return self.masks.padded_mask(
            mask, n, self._buffer_positions(t), np.array(self._left_padding), queries
        )

    def prepare(self, *, left_padding: Sequence[int]) -> None:
        """ROWS-11 (mlx-lm's `prepare(left_padding=...)`): the first append brings a
        left-padded prompt per row; row b's first `left_padding[b]` positions are padding.
        Only on a cache holding nothing; ValueError, nothing changed, otherwise."""
        padding = tuple(int(p) for p in left_padding)
        if self._fields is not None:
            raise ValueError("left padding can only be prepared on a cache holding nothing")
        if not padding or min(padding) != 0 or any(p < 0 for p in padding):
            raise ValueError(
                f"left padding {padding} must be one count >= 0 per row and leave a row with none"
            )
        self._prepared_padding = padding if any(padding) else ()

    def _checked_padding(self, state: CacheState, arrays_rows: int | None) -> tuple[int, ...]:
        """ROWS-5: a state's left padding checked against its arrays (rows, offset), as
        stored: () for no padded row; ValueError, nothing changed, if inconsistent."""
        padding = tuple(state.left_padding)
        if not padding:
            return ()
        if arrays_rows is None or len(padding) != arrays_rows:
            raise ValueError(f"left padding {padding} does not give one count per row")
        if any(not 0 <= p <= state.offset for p in padding) or min(padding) != 0:
            raise ValueError(
                f"left padding {padding} must lie in [0, offset={state.offset}] and leave a "
                "row with none"
            )
        return padding if any(padding) else ()

    def _check_padding_invariants(self) -> None:
        """ROWS-5 invariants: one count per row, each at most the offset, one row unpadded."""
        if not self._left_padding:
            return
        assert self._layout is not None
        padding = self._left_padding
        require(len(padding) == self._layout.batch, f"left padding {padding} is not one per row")
        require(min(padding) == 0, f"left padding {padding} leaves no row unpadded")
        require(max(padding) <= self.offset, f"left padding {padding} exceeds the offset")

    def carry_positions(self, source: FieldStorage) -> None:
        """A conversion's target takes its source's offset, minimum reusable offset and
        left padding (CACHE-9, ROWS-5)."""
        self.offset = source.offset
        self.minimum_reusable_offset = source.minimum_reusable_offset
        self._left_padding = source._left_padding

    def _append_layout(self, k: np.ndarray, v: np.ndarray) -> KvLayout:
        """The layout an append of `k`, `v` fixes (CACHE-2); a prepared padding must fit it
        (ROWS-11)."""
        layout, length = kv_layout(k, v, self.dtype_name(k.dtype))
        padding = self._prepared_padding
        if padding and (len(padding) != layout.batch or max(padding) > length):
            raise ValueError(
                f"the prepared left padding {padding} needs {len(padding)} rows of at least "
                f"{max(padding)} positions, got {layout.batch} rows of {length}"
            )
        return layout

    def _checked(self, k: np.ndarray, v: np.ndarray) -> tuple[KvLayout, Fields]:
        """The layout and fields of an append, checked as `checks` says (CACHE-2, DEFER-3);
        deferred failures are recorded, to be raised by `check()`."""
        layout = self._append_layout(k, v)
        require_same_layout(self._layout, layout)
        fields = self._encode_recorded(k, v)
        # Nothing after the encode raises: the prepared padding is the batch's (ROWS-11).
        if self._prepared_padding:
            self._left_padding, self._prepared_padding = self._prepared_padding, ()
        return layout, fields

    def _encode_recorded(self, k: np.ndarray, v: np.ndarray) -> Fields:
        if self.checks == "eager":
            return self._encode(k, v)
        fields, failure = self._encode_deferred(k, v)
        return self._record_failure(fields, failure)

    def _record_failure(self, fields: Fields, failure: int) -> Fields:
        """DEFER-3: keep the running failure rank; the fields to store."""
        self._failure = failure
        return fields

    def check(self) -> None:
        """DEFER-3: raise the earliest failed check recorded since the last call, once."""
        failure, self._failure = int(self._failure), 0
        if failure:
            raise ValueError(failure_message(self.deferred_checks, failure))

    def check_append(self, k: np.ndarray, v: np.ndarray) -> None:
        """CACHE-2: raise ValueError if `k`, `v` could not be appended (deferred checks:
        if their layout could not be, DEFER-3); records nothing."""
        layout = self._append_layout(k, v)
        require_same_layout(self._layout, layout)
        if self.checks == "eager":
            self._encode(k, v)
        else:
            self._encode_deferred(k, v)

    def keys_and_values(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The live rows decoded; None before the first append (CACHE-3, RING-4)."""
        if self._fields is None:
            return None
        return self._decode(self._live())

    def bytes_per_token(self) -> int:
        """CACHE-6: one row of every field; 0 before the first append."""
        if self._fields is None:
            return 0
        return sum(field[:, :, :1].nbytes for field in self._fields)

    def adopt(self, fields: Fields, layout: KvLayout) -> None:
        """Take `fields` as the stored rows (conversions, CACHE-9)."""
        self._fields = fields
        self._layout = layout

    def adopt_encoded(self, k: np.ndarray, v: np.ndarray, layout: KvLayout) -> None:
        """Encode `k`, `v` as this storage's fields and take them (conversions, CACHE-9),
        checked as `checks` says (DEFER-3)."""
        self.adopt(self._encode_recorded(k, v), layout)

    def release(self) -> None:
        """Back to the constructed state: what a consumed source is left as (CACHE-9)."""
        self._fields = None
        self._layout = None
        self.offset = 0
        self.minimum_reusable_offset = 0
        self._failure = 0
        self._left_padding = ()
        self._prepared_padding = ()


class PlainFields:
    """Keys and values stored as given, in the input dtype (CACHE-3, RING-1): fields
    (keys [B, H, T, Dk], values [B, H, T, Dv])."""

    def _encode(self, k: np.ndarray, v: np.ndarray) -> Fields:
        # Copies: later appends write into the fields, never into the caller's arrays.
        return self.xp.array(k), self.xp.array(v)

    def _decode(self, fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        return fields[0], fields[1]

    def _layout_of(self, fields: Fields) -> KvLayout:
        keys, values = fields
        B, H, _, k_dim = keys.shape
        return KvLayout(B, H, k_dim, values.shape[3], self.dtype_name(keys.dtype))
