"""mlx-lm's attention function, routed so that a kvspec cache's read attends itself.

mlx-lm's models call `mlx_lm.models.base.scaled_dot_product_attention(queries, keys,
values, cache=, scale=, mask=)` with what the layer's cache returned from
`update_and_fetch`, and that function picks its quantized path by `hasattr(cache,
"bits")`. A kvspec cache returns a `PendingAttention` instead of arrays, and the routed
function hands the queries to it, so attention runs in kvspec's own read (READ-1, READ-2,
READ-3) and mlx-lm's function never sees the stored fields. Every other call goes to
mlx-lm's function unchanged.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from kvspec.accelerated.caches.protocol import Mask, Read
from kvspec.accelerated.mlx_lm.batch import RowsAttention

_MLX_LM_ATTENTION = base.scaled_dot_product_attention


@dataclass(frozen=True)
class PendingAttention:
    """The read of one append (READ-2 for one position, READ-3 for more), handed to the model
    as its keys and values: the routed attention function attends with it."""

    read: Read
    positions: int

    def attend(self, queries: mx.array, scale: float, mask: Mask) -> mx.array:
        """The read's attention of `queries` [B, Hq, N, D], in the queries' dtype.

        The read applies the mask of its cache (MASK-2, MASK-3), which is what the cache's
        `make_mask` gave the model; a decode read sees every key its cache holds, so a mask
        on a decode means the model asked for a window the cache does not apply."""
        if self.positions == 1 and mask is not None:
            raise ValueError(
                "a kvspec decode read sees every key its cache holds (READ-2); the model "
                "passed a mask, so it wants a window this cache does not apply"
            )
        # TurboQuant reads are float32 (TQC-2): the next layer takes the model's dtype.
        return self.read.attend(queries, scale).astype(queries.dtype)


def scaled_dot_product_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Mask,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention`, but keys from a kvspec cache attend through
    their own read."""
    if isinstance(keys, PendingAttention | RowsAttention):
        if sinks is not None:
            raise ValueError("kvspec reads do not take attention sinks")
        return keys.attend(queries, scale, mask)
    if sinks is None:
        return _MLX_LM_ATTENTION(queries, keys, values, cache=cache, scale=scale, mask=mask)
    return _MLX_LM_ATTENTION(
        queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks
    )


def route_attention() -> None:
    """Point mlx-lm's attention function, in its base module and in every model module
    already imported, at `scaled_dot_product_attention`. Model modules imported later take
    it from the base module. Idempotent."""
    if base.scaled_dot_product_attention is scaled_dot_product_attention:
        return
    for name, module in list(sys.modules.items()):
        if (
            name.startswith("mlx_lm.models.")
            and getattr(module, "scaled_dot_product_attention", None) is _MLX_LM_ATTENTION
        ):
            module.scaled_dot_product_attention = scaled_dot_product_attention
