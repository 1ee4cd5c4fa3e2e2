"""A model's prompt cache of kvspec caches (SCHEME-3), and its mlx-lm-compatible files."""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as mlx_lm_cache

from kvspec.accelerated import caches
from kvspec.accelerated.mlx_lm.cache import CacheRecipe, KvspecCache, kvspec_cache


def layer_windows(model: Any) -> list[int | None]:
    """Per layer, the sliding window the model declares, or None for full attention: from
    the caches of its `make_cache` (KVCache: full; RotatingKVCache: its max_size), else
    from `layer_types` and `sliding_window` in its args, else full attention everywhere."""
    if hasattr(model, "make_cache"):
        return [_window_of(layer, cache) for layer, cache in enumerate(model.make_cache())]
    args = getattr(model, "args", None)
    layer_types = getattr(args, "layer_types", None)
    if layer_types is None:
        return [None] * len(model.layers)
    return [args.sliding_window if kind == "sliding_attention" else None for kind in layer_types]


def _window_of(layer: int, cache: Any) -> int | None:
    if isinstance(cache, KvspecCache):  # a model given a scheme by `use_scheme`
        return cache.recipe.max_size
    if type(cache) is mlx_lm_cache.KVCache:
        return None
    if type(cache) is mlx_lm_cache.RotatingKVCache:
        if cache.keep != 0:
            raise ValueError(
                f"layer {layer}: the model's RotatingKVCache keeps {cache.keep} positions; "
                "kvspec composes sliding-window caches with keep 0 (SCHEME-3)"
            )
        return cache.max_size
    raise ValueError(
        f"layer {layer}: the model's {type(cache).__name__} has no kvspec counterpart; kvspec "
        "composes full-attention (KVCache) and sliding-window (RotatingKVCache) layers"
    )


def make_prompt_cache(model: Any, scheme: str = "bf16") -> list[KvspecCache]:
    """One kvspec cache per layer of `model`, full or sliding-window as the model declares
    (`layer_windows`), composed by `scheme` in its short form (SCHEME-2, SCHEME-3)."""
    if not isinstance(scheme, str):
        raise TypeError(f"scheme is a short form (SCHEME-2) such as 'affine:4:64', got {scheme!r}")
    parsed = caches.parse_scheme(scheme)
    windows = layer_windows(model)
    if isinstance(parsed, caches.AffineLayersScheme):
        beyond = sorted(entry.layer for entry in parsed.layers if entry.layer >= len(windows))
        if beyond:
            raise ValueError(
                f"scheme {scheme!r} lists layers {beyond}; the model has {len(windows)} layers"
            )
    text = scheme.strip()
    return [kvspec_cache(CacheRecipe(text, layer, w)) for layer, w in enumerate(windows)]


def use_scheme(model: Any, scheme: str) -> None:
    """Gives `model` a `make_cache` that composes kvspec caches by `scheme`, so that every
    path of mlx-lm that makes the model's caches itself through mlx-lm's
    `make_prompt_cache(model)` (`generate` and `stream_generate` without a prompt cache,
    `BatchGenerator` and `batch_generate`, `mlx_lm.server` given this model) runs on them.
    The model's layer windows are read now, from the caches it makes before the call."""
    composed = make_prompt_cache(model, scheme)
    recipes = [cache.recipe for cache in composed]
    model.make_cache = lambda: [kvspec_cache(recipe) for recipe in recipes]


def load_prompt_cache(
    file_name: str, model: Any = None, scheme: str | None = None, return_metadata: bool = False
) -> Any:
    """mlx-lm's `load_prompt_cache`, checked: with `model`, the file must hold one cache per
    layer of the model's kinds and windows; with `scheme`, every layer must be a kvspec cache
    of that scheme (compared parsed, SCHEME-2). ValueError names the first mismatch."""
    loaded, metadata = mlx_lm_cache.load_prompt_cache(file_name, return_metadata=True)
    if model is not None:
        windows = layer_windows(model)
        if len(loaded) != len(windows):
            raise ValueError(
                f"{file_name} holds {len(loaded)} layer caches; the model has {len(windows)}"
            )
        for layer, (cache, window) in enumerate(zip(loaded, windows, strict=True)):
            if isinstance(cache, KvspecCache) and cache.recipe.max_size != window:
                raise ValueError(
                    f"{file_name}, layer {layer}: saved with window {cache.recipe.max_size}, "
                    f"the model declares {window}"
                )
    if scheme is not None:
        wanted = caches.parse_scheme(scheme)
        for layer, cache in enumerate(loaded):
            if not isinstance(cache, KvspecCache):
                raise ValueError(
                    f"{file_name}, layer {layer}: mlx-lm's {type(cache).__name__}, not a "
                    "kvspec cache"
                )
            if caches.parse_scheme(cache.recipe.scheme) != wanted:
                raise ValueError(
                    f"{file_name}, layer {layer}: saved with scheme {cache.recipe.scheme!r}, "
                    f"expected {scheme!r}"
                )
    if return_metadata:
        return loaded, metadata
    return loaded
