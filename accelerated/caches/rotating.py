"""Ring storage and `RotatingKVCache` on MLX (spec RING-1 .. RING-6): the reference's ring
over mx.array."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from kvspec.accelerated import attention_kernels
from kvspec.accelerated.caches.reads import ReadMethods
from kvspec.accelerated.caches.storage import PlainFields
from kvspec.reference.caches import rotating

if TYPE_CHECKING:
    from kvspec.accelerated.caches.rotating_quantized import RotatingQuantizedKVCache


class RingStorage(ReadMethods, rotating.RingStorage):
    """RING-1 storage over mx.array."""

    rotates = True

    def _live_positions(self) -> Callable[[], np.ndarray]:
        """ROWS-6: the live rows' positions in ring order (`ring_positions`)."""
        return partial(rotating.ring_positions, self.offset, self._index, self.length)

    def _rotation(self, rows: int) -> tuple[int, int]:
        """READ-7: once the ring wrapped (ring index < offset, RING-1), its oldest row past
        the kept ones is the ring index's: turn = ring index - keep, modulo the rows past
        keep (0 where the last write filled the last row)."""
        if self._index >= self.offset:
            return self.keep, 0
        return self.keep, (self._index - self.keep) % (rows - self.keep)

    def _slot_order(self) -> mx.array:
        """READ-7 in the compiled step: the ring's keep (`padding_order`), from which the
        kernels read its live rows oldest first, the turn following from the write row, which
        holds the newest position (decode_attention.cuh's RowOrder::after_write)."""
        layout = self._layout
        assert layout is not None
        return attention_kernels.padding_order(self.keep, (0,) * layout.batch)


class RotatingKVCache(PlainFields, RingStorage, rotating.RotatingKVCache):
    """Keys and values stored as given in a ring (RING-1), on MLX."""

    def _new_quantized(self, group_size: int, bits: int, checks: str) -> RotatingQuantizedKVCache:
        from kvspec.accelerated.caches.rotating_quantized import RotatingQuantizedKVCache

        return RotatingQuantizedKVCache(self.max_size, group_size, bits, self.keep, checks)
