"""`RotatingQuantizedKVCache` on MLX (spec QRING-1, QRING-2): the reference's affine ring with
the MLX affine codec, which stores the same bits (AFF-9), its six fields in one record per
row (QKV-1, TQC-1's records)."""

from __future__ import annotations

from kvspec.accelerated.caches.quantized import AffineRecordFields
from kvspec.accelerated.caches.records import RingRecordStorage
from kvspec.accelerated.caches.rotating import RingStorage
from kvspec.reference.caches import rotating_quantized


class RotatingQuantizedKVCache(
    RingRecordStorage, AffineRecordFields, RingStorage, rotating_quantized.RotatingQuantizedKVCache
):
    """The affine ring (QRING-1) on MLX."""
