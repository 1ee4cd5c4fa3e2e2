"""bf16-first caches on MLX (spec B16F-1 .. B16F-6): the reference's caches over the MLX
storages."""

from __future__ import annotations

from kvspec.accelerated.caches.kv import KVCache
from kvspec.accelerated.caches.quantized import QuantizedKVCache
from kvspec.accelerated.caches.reads import PositionwiseRead
from kvspec.accelerated.caches.rotating import RotatingKVCache
from kvspec.accelerated.caches.rotating_quantized import RotatingQuantizedKVCache
from kvspec.accelerated.caches.turboquant import TurboQuantKVCache
from kvspec.reference.caches import bf16_first
from kvspec.reference.caches.bf16_first import Bf16FirstCache, transition_due

__all__ = [
    "Bf16FirstCache",
    "Bf16FirstKv4Head256Cache",
    "Bf16FirstQuantizedKVCache",
    "Bf16FirstRotatingQuantizedKVCache",
    "Bf16FirstTurboQuantKVCache",
    "transition_due",
]


class Bf16FirstQuantizedKVCache(bf16_first.Bf16FirstQuantizedKVCache):
    """KVCache, then QuantizedKVCache (B16F-2), on MLX."""

    plain_kind = KVCache
    converted_kind = QuantizedKVCache


class Bf16FirstRotatingQuantizedKVCache(bf16_first.Bf16FirstRotatingQuantizedKVCache):
    """RotatingKVCache, then RotatingQuantizedKVCache (B16F-2, READ-4), on MLX."""

    plain_kind = RotatingKVCache
    converted_kind = RotatingQuantizedKVCache
    positionwise_read = PositionwiseRead


class Bf16FirstKv4Head256Cache(Bf16FirstQuantizedKVCache, bf16_first.Bf16FirstKv4Head256Cache):
    """Bf16FirstQuantizedKVCache at 4 bits, group 64, head_dim 256 only (B16F-2), on MLX."""


class Bf16FirstTurboQuantKVCache(bf16_first.Bf16FirstTurboQuantKVCache):
    """KVCache, then TurboQuantKVCache (B16F-2, SCHEME-4), on MLX."""

    plain_kind = KVCache
    converted_kind = TurboQuantKVCache
