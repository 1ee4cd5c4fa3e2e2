"""kvspec's caches in mlx-lm's generation (an optional extra: `pip install 'kvspec[mlx-lm]'`).

`make_prompt_cache(model, scheme)` gives one cache per layer that mlx-lm's `generate`,
`stream_generate` and `generate_step` take as `prompt_cache`, and `BatchGenerator` and
`batch_generate` batch, one per prompt (`batch`); attention runs in kvspec's reads.
`use_scheme(model, scheme)` makes mlx-lm's own `make_prompt_cache(model)` build them, for
the paths that make their caches themselves (`mlx_lm.server` among them).
`save_prompt_cache` is mlx-lm's; `load_prompt_cache` is mlx-lm's with checks against the
model and scheme. `python -m kvspec.accelerated.mlx_lm --help` generates from a local
model directory.
"""

try:
    import mlx_lm  # noqa: F401
except ImportError as error:
    raise ImportError(
        "kvspec.accelerated.mlx_lm needs mlx-lm: pip install 'kvspec[mlx-lm]'"
    ) from error

from mlx_lm.models.cache import save_prompt_cache

from kvspec.accelerated.mlx_lm.cache import CacheRecipe, KvspecCache, KvspecPlainCache
from kvspec.accelerated.mlx_lm.prompt_cache import (
    layer_windows,
    load_prompt_cache,
    make_prompt_cache,
    use_scheme,
)

__all__ = [
    "CacheRecipe",
    "KvspecCache",
    "KvspecPlainCache",
    "layer_windows",
    "load_prompt_cache",
    "make_prompt_cache",
    "save_prompt_cache",
    "use_scheme",
]
