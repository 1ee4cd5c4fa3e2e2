"""What the growable and the ring storage share (spec CACHE-2, CACHE-6, CACHE-9): stored
fields [B, H, T, *] with the layout of what was appended, the codec hooks that fill them,
and `PlainFields`, the hooks of storage that keeps keys and values as given."""

from __future__ import annotations

from abc import abstractmethod

import numpy as np

from kvspec.reference.caches.protocol import KvLayout, kv_layout, require_same_layout
from kvspec.reference.caches.reads import ReadMethods

Fields = tuple[np.ndarray, ...]


class FieldStorage(ReadMethods):
    """Stored fields (None until the first append), their layout, offset and minimum
    reusable offset (CACHE-1). Subclasses say how positions are encoded into fields and
    decoded back, and which stored rows are live."""

    def __init__(self) -> None:
        self.offset = 0
        self.minimum_reusable_offset = 0
        self._fields: Fields | None = None
        self._layout: KvLayout | None = None

    @abstractmethod
    def _encode(self, k: np.ndarray, v: np.ndarray) -> Fields:
        """Fields of new positions; raises ValueError for what the storage cannot hold."""

    @abstractmethod
    def _decode(self, fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of stored positions."""

    @abstractmethod
    def _layout_of(self, fields: Fields) -> KvLayout:
        """The layout that stored fields imply (for restore_state)."""

    @abstractmethod
    def _live(self) -> Fields:
        """The stored rows a fetch returns, detached from the fields."""

    @property
    def layout(self) -> KvLayout | None:
        return self._layout

    def _append_layout(self, k: np.ndarray, v: np.ndarray) -> KvLayout:
        """The layout an append of `k`, `v` fixes (CACHE-2)."""
        return kv_layout(k, v, self.dtype_name(k.dtype))[0]

    def _checked(self, k: np.ndarray, v: np.ndarray) -> tuple[KvLayout, Fields]:
        layout = self._append_layout(k, v)
        require_same_layout(self._layout, layout)
        return layout, self._encode(k, v)

    def check_append(self, k: np.ndarray, v: np.ndarray) -> None:
        """CACHE-2: raise ValueError if `k`, `v` could not be appended."""
        self._checked(k, v)

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

    def release(self) -> None:
        """Back to the constructed state: what a consumed source is left as (CACHE-9)."""
        self._fields = None
        self._layout = None
        self.offset = 0
        self.minimum_reusable_offset = 0


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
