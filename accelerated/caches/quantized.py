"""`QuantizedKVCache` on MLX (spec QKV-1, QKV-2): the reference's cache with the MLX affine
codec, which stores the same bits (AFF-9)."""

from __future__ import annotations

from types import ModuleType

from kvspec.accelerated import affine
from kvspec.accelerated.caches.kv import GrowingStorage
from kvspec.reference.caches import quantized
from kvspec.reference.caches.quantized import check_affine_parameters

__all__ = ["AffineFields", "QuantizedKVCache", "check_affine_parameters"]


class AffineFields(quantized.AffineFields):
    """The six affine fields (QKV-1) through the MLX affine codec."""

    affine: ModuleType = affine


class QuantizedKVCache(AffineFields, GrowingStorage, quantized.QuantizedKVCache):
    """Affine growable storage (QKV-1) on MLX."""
