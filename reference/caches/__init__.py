"""The cache family and its transitions (spec chapter 5), in NumPy.

Modules, bottom up: protocol (the Cache ABC, CacheState), masks, attention (the reference
attention), reads, kv (growable storage, KVCache), quantized, rotating (the ring,
RotatingKVCache), rotating_quantized, turboquant (TurboQuantKVCache), bf16_first, scheme
(composition), donor (donor reads).
"""

from kvspec.reference.caches.bf16_first import (
    Bf16FirstCache,
    Bf16FirstKv4Head256Cache,
    Bf16FirstQuantizedKVCache,
    Bf16FirstRotatingQuantizedKVCache,
    Bf16FirstTurboQuantKVCache,
    transition_due,
)
from kvspec.reference.caches.donor import DonorRows, capture_donor_attention, capture_donor_rows
from kvspec.reference.caches.kv import STEP, KVCache
from kvspec.reference.caches.protocol import Cache, CacheState, KvLayout
from kvspec.reference.caches.quantized import QuantizedKVCache
from kvspec.reference.caches.rotating import RotatingKVCache
from kvspec.reference.caches.rotating_quantized import RotatingQuantizedKVCache
from kvspec.reference.caches.scheme import (
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
from kvspec.reference.caches.turboquant import TurboQuantKVCache

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
    "DonorRows",
    "KVCache",
    "KvLayout",
    "KvStorageScheme",
    "QuantizedKVCache",
    "RotatingKVCache",
    "RotatingQuantizedKVCache",
    "TurboQuantKVCache",
    "TurboScheme",
    "capture_donor_attention",
    "capture_donor_rows",
    "composed_full_attention_cache",
    "composed_sliding_attention_cache",
    "parse_scheme",
    "transition_due",
]
