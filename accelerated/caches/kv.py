"""Growable storage and `KVCache` on MLX (spec CACHE-3 .. CACHE-8): the reference's
bookkeeping over mx.array."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvspec.accelerated.caches.reads import ReadMethods
from kvspec.accelerated.caches.storage import PlainFields
from kvspec.reference.caches import kv

if TYPE_CHECKING:
    from kvspec.accelerated.caches.quantized import QuantizedKVCache


class GrowingStorage(ReadMethods, kv.GrowingStorage):
    """CACHE-3 storage over mx.array."""


class KVCache(PlainFields, GrowingStorage, kv.KVCache):
    """Keys and values stored as given (CACHE-3), on MLX."""

    def _new_quantized(self, group_size: int, bits: int, checks: str) -> QuantizedKVCache:
        from kvspec.accelerated.caches.quantized import QuantizedKVCache

        return QuantizedKVCache(group_size, bits, checks=checks)
