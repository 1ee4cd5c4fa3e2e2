"""KV storage schemes composed into MLX caches (spec SCHEME-1 .. SCHEME-4). Parsing and the
composition rule are the reference's; only the cache family differs."""

from __future__ import annotations

from typing import Any

from kvspec.reference.caches.scheme import (
    AffineLayer,
    AffineLayersScheme,
    AffineScheme,
    Bf16Scheme,
    KvStorageScheme,
    TurboScheme,
    full_attention_cache,
    parse_scheme,
    sliding_attention_cache,
)

__all__ = [
    "AffineLayer",
    "AffineLayersScheme",
    "AffineScheme",
    "Bf16Scheme",
    "KvStorageScheme",
    "TurboScheme",
    "composed_full_attention_cache",
    "composed_sliding_attention_cache",
    "parse_scheme",
]


def composed_full_attention_cache(
    scheme: KvStorageScheme, layer: int, checks: str = "eager"
) -> Any:
    """The MLX cache `scheme` names for full-attention layer `layer` (SCHEME-3), checking
    as `checks` says: "deferred" for decode loops that must not wait (DEFER-3)."""
    from kvspec.accelerated import caches

    return full_attention_cache(scheme, layer, caches, checks)


def composed_sliding_attention_cache(
    scheme: KvStorageScheme, layer: int, max_size: int, checks: str = "eager"
) -> Any:
    """The MLX cache `scheme` names for sliding-window layer `layer` (SCHEME-3), checking
    as `checks` says (DEFER-3)."""
    from kvspec.accelerated import caches

    return sliding_attention_cache(scheme, layer, max_size, caches, checks)
