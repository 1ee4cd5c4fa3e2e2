"""`QuantizedKVCache` on MLX (spec QKV-1, QKV-2): the reference's cache with the MLX affine
codec, which stores the same bits (AFF-9)."""

from __future__ import annotations

from types import ModuleType

from kvspec.accelerated import affine
from kvspec.accelerated.caches.kv import GrowingStorage
from kvspec.reference.caches import quantized


class QuantizedKVCache(GrowingStorage, quantized.QuantizedKVCache):
    """Affine growable storage (QKV-1) on MLX."""

    affine: ModuleType = affine
