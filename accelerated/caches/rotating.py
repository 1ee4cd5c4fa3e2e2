"""Ring storage and `RotatingKVCache` on MLX (spec RING-1 .. RING-6): the reference's ring
over mx.array."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvspec.accelerated.caches.reads import ReadMethods
from kvspec.accelerated.caches.storage import PlainFields
from kvspec.reference.caches import rotating

if TYPE_CHECKING:
    from kvspec.accelerated.caches.rotating_quantized import RotatingQuantizedKVCache


class RingStorage(ReadMethods, rotating.RingStorage):
    """RING-1 storage over mx.array."""

    # ROWS-6: a ring's buffer rows are in ring order, not its positions.
    padded_rows_from_their_start = False


class RotatingKVCache(PlainFields, RingStorage, rotating.RotatingKVCache):
    """Keys and values stored as given in a ring (RING-1), on MLX."""

    def _new_quantized(self, group_size: int, bits: int, checks: str) -> RotatingQuantizedKVCache:
        from kvspec.accelerated.caches.rotating_quantized import RotatingQuantizedKVCache

        return RotatingQuantizedKVCache(self.max_size, group_size, bits, self.keep, checks)
