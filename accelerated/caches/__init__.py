"""The cache family and its transitions (spec chapter 5), on MLX.

Modules, bottom up: protocol (the reference's Cache ABC and CacheState), masks,
attention (mx.fast.scaled_dot_product_attention), reads, kv (growable storage, KVCache),
quantized, rotating (the ring, RotatingKVCache), rotating_quantized, turboquant
(TurboQuantKVCache), bf16_first, scheme (composition).
"""

from kvspec.accelerated.caches.bf16_first import (
    Bf16FirstCache,
    Bf16FirstKv4Head256Cache,
    Bf16FirstQuantizedKVCache,
    Bf16FirstRotatingQuantizedKVCache,
    Bf16FirstTurboQuantKVCache,
    transition_due,
)
from kvspec.accelerated.caches.kv import STEP, KVCache
from kvspec.accelerated.caches.protocol import Cache, CacheState, KvLayout
from kvspec.accelerated.caches.quantized import QuantizedKVCache
from kvspec.accelerated.caches.rotating import RotatingKVCache
from kvspec.accelerated.caches.rotating_quantized import RotatingQuantizedKVCache
from kvspec.accelerated.caches.scheme import (
    AffineLayer,
    AffineLayersScheme,
    AffineScheme,
    Bf16Scheme,
    KvStorageScheme,
    TurboScheme,
    composed_full_attention_cache,
    composed_sliding_attention_cache,
    parse_scheme,
)
from kvspec.accelerated.caches.turboquant import TurboQuantKVCache

__all__ = [
    "STEP",
    "AffineLayer",
    "AffineLayersScheme",
    "AffineScheme",
    "Bf16FirstCache",
    "Bf16FirstKv4Head256Cache",
    "Bf16FirstQuantizedKVCache",
    "Bf16FirstRotatingQuantizedKVCache",
    "Bf16FirstTurboQuantKVCache",
    "Bf16Scheme",
    "Cache",
    "CacheState",
    "KVCache",
    "KvLayout",
    "KvStorageScheme",
    "QuantizedKVCache",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "TurboQuantKVCache",
    "TurboScheme",
    "composed_full_attention_cache",
    "composed_sliding_attention_cache",
    "parse_scheme",
    "transition_due",
]
