"""`TurboQuantKVCache` on MLX (spec TQC-1 .. TQC-5): the reference's cache with the MLX
TurboQuant codec. Stores the reference's bits; its fetches are bit-exact too (TQC-2)."""

from __future__ import annotations

from types import ModuleType

from kvspec.accelerated import turboquant
from kvspec.accelerated.caches.attention import attention
from kvspec.accelerated.caches.kv import GrowingStorage
from kvspec.reference.caches import turboquant as reference
from kvspec.reference.caches.turboquant import check_turboquant_parameters

__all__ = ["DeferredRead", "TurboQuantKVCache", "check_turboquant_parameters"]


class DeferredRead(reference.DeferredRead):
    """The deferred kernels' read (TQC-4) with MLX's attention and unrotation."""

    attention = staticmethod(attention)
    turboquant = turboquant


class TurboQuantKVCache(GrowingStorage, reference.TurboQuantKVCache):
    """TurboQuant growable storage (TQC-1) on MLX."""

    turboquant: ModuleType = turboquant
    deferred_read: type[reference.DeferredRead] = DeferredRead
