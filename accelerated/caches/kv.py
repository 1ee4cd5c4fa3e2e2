"""Growable storage and `KVCache` on MLX (spec CACHE-3 .. CACHE-8): the reference's
bookkeeping over mx.array, and a decode append planned once for every later one of its
shapes (`PlannedAppend`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import mlx.core as mx

from kvspec.accelerated.caches.reads import Encoder, ReadMethods, running
from kvspec.accelerated.caches.storage import PlainFields
from kvspec.reference.caches import kv
from kvspec.reference.caches.protocol import KvLayout

if TYPE_CHECKING:
    from kvspec.accelerated.caches.quantized import QuantizedKVCache


class PlannedAppend:
    """CACHE-3's append of keys and values of one shape and dtype into a storage whose
    layout they match, with every check and choice the first such append made: a decode
    step appends that shape at every layer and step, and the reference's path (the layout
    of the input, CACHE-2; the encoder's checks; the path it takes) costs the host more
    than the encode and the write it leads to. It runs the same encode and the same write,
    so it stores what that path stores; whatever it does not take (another shape, a
    storage whose layout or room changed) goes that path."""

    __slots__ = ("dtype", "encode", "k_shape", "layout", "v_shape")

    def __init__(self, k: mx.array, v: mx.array, layout: KvLayout, encode: Encoder) -> None:
        self.k_shape = k.shape
        self.v_shape = v.shape
        self.dtype = k.dtype
        #: The storage's layout object that the first append checked the input against.
        self.layout = layout
        self.encode = encode

    def __copy__(self) -> PlannedAppend:
        return self

    def __deepcopy__(self, memo: dict) -> PlannedAppend:
        # Immutable and tied to no storage's arrays: a copied storage shares it.
        return self

    def takes(self, storage: GrowingStorage, k: mx.array, v: mx.array) -> bool:
        """Whether `k`, `v` are of the planned shapes and dtype, the storage still has the
        layout they were checked against, and its buffers have room for them (CACHE-3
        step 1: growing is the reference's path)."""
        return (
            storage._layout is self.layout
            and k.shape == self.k_shape
            and v.shape == self.v_shape
            and k.dtype == self.dtype
            and v.dtype == self.dtype
            and storage.offset + self.k_shape[2] <= storage.capacity
        )

    def append(self, storage: GrowingStorage, k: mx.array, v: mx.array) -> None:
        """CACHE-3 steps 2 and 3 of an append this plan `takes`: encode (DEFER-3's running
        rank carried as `_record_failure` carries it), write the rows at the offset,
        advance it."""
        fields, failure = self.encode(k, v, running(storage))
        if failure is not None:
            storage._failure = failure
        prev = storage.offset
        storage._write_rows(prev, fields)
        storage.offset = prev + self.k_shape[2]


class GrowingStorage(ReadMethods, kv.GrowingStorage):
    """CACHE-3 storage over mx.array, its appends planned (PlannedAppend)."""

    #: The plan of the last append that went the reference's path.
    _planned_append: PlannedAppend | None = None

    def _append(self, k: mx.array, v: mx.array) -> None:
        planned = self._planned_append
        if planned is not None and planned.takes(self, k, v):
            planned.append(self, k, v)
            return
        super()._append(k, v)
        encode = self._append_encoder(k, v)
        assert self._layout is not None
        self._planned_append = None if encode is None else PlannedAppend(k, v, self._layout, encode)


class KVCache(PlainFields, GrowingStorage, kv.KVCache):
    """Keys and values stored as given (CACHE-3), on MLX."""

    def _new_quantized(self, group_size: int, bits: int, checks: str) -> QuantizedKVCache:
        from kvspec.accelerated.caches.quantized import QuantizedKVCache

        return QuantizedKVCache(group_size, bits, checks=checks)
