"""`RotatingQuantizedKVCache` on MLX (spec QRING-1, QRING-2): the reference's affine ring with
the MLX affine codec, which stores the same bits (AFF-9)."""

from __future__ import annotations

from kvspec.accelerated.caches.quantized import AffineFields
from kvspec.accelerated.caches.rotating import RingStorage
from kvspec.reference.caches import rotating_quantized


class RotatingQuantizedKVCache(
    AffineFields, RingStorage, rotating_quantized.RotatingQuantizedKVCache
):
    """The affine ring (QRING-1) on MLX."""
