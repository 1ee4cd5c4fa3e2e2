"""The cache family and its transitions (spec chapter 5), on MLX.

Each cache here is a thin subclass of its reference twin (kvspec.reference.caches): the
reference writes every state machine once, over a class-level array namespace `xp` and a
few named hooks, and these classes bind MLX to them: `xp = mx`, the MLX codecs
(kvspec.accelerated.affine, kvspec.accelerated.turboquant), the masks as mx.array and
`mx.fast.scaled_dot_product_attention` (attention). Protocol, parameters and schemes hold
no arrays; both backends share them.
"""

from kvspec.accelerated.caches.bf16_first import (
    Bf16FirstKv4Head256Cache,
    Bf16FirstQuantizedKVCache,
    Bf16FirstRotatingQuantizedKVCache,
    Bf16FirstTurboQuantKVCache,
)
from kvspec.accelerated.caches.donor import DonorRows, capture_donor_attention, capture_donor_rows
from kvspec.accelerated.caches.kv import KVCache
from kvspec.accelerated.caches.quantized import QuantizedKVCache
from kvspec.accelerated.caches.rotating import RotatingKVCache
from kvspec.accelerated.caches.rotating_quantized import RotatingQuantizedKVCache
from kvspec.accelerated.caches.scheme import (
    composed_full_attention_cache,
    composed_sliding_attention_cache,
)
from kvspec.accelerated.caches.turboquant import TurboQuantKVCache
from kvspec.reference.caches import (
    STEP,
    AffineLayer,
    AffineLayersScheme,
    AffineScheme,
    Bf16FirstCache,
    Bf16Scheme,
    Cache,
    CacheState,
    KvLayout,
    KvStorageScheme,
    TurboScheme,
    parse_scheme,
    transition_due,
)

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
