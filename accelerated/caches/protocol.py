"""The cache protocol and state record (spec CACHE-1, CACHE-2, CACHE-8): array-agnostic, so
the MLX caches implement the reference's own types."""

from kvspec.reference.caches.protocol import (
    Cache,
    CacheState,
    KvLayout,
    Mask,
    Read,
    kv_layout,
    require,
    require_same_layout,
)

__all__ = [
    "Cache",
    "CacheState",
    "KvLayout",
    "Mask",
    "Read",
    "kv_layout",
    "require",
    "require_same_layout",
]
