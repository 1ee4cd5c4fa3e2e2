"""Attention through `mx.fast.scaled_dot_product_attention` (spec READ-1).

Not bit-exact with the reference's float64 attention: READ-1 states the bound the
conformance suite holds it to.
"""

from __future__ import annotations

import mlx.core as mx

from kvspec.accelerated.caches.protocol import Mask


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Mask
) -> mx.array:
    """READ-1: queries [B, Hq, N, D] over keys [B, Hk, T, D], values [B, Hk, T, Dv]."""
    B, Hq, _, D = queries.shape
    _, Hk, T, _ = keys.shape
    if (
        tuple(keys.shape[:2]) != (B, Hk)
        or keys.shape[3] != D
        or tuple(values.shape[:3]) != (B, Hk, T)
    ):
        raise ValueError(
            f"queries {tuple(queries.shape)}, keys {tuple(keys.shape)}, "
            f"values {tuple(values.shape)} do not fit"
        )
    if Hq % Hk != 0:
        raise ValueError(f"query heads {Hq} are not a multiple of key heads {Hk}")
    if keys.dtype == mx.float32:
        # Float32 keys (TurboQuant's reads, TQC-2): widening the queries is exact.
        queries = queries.astype(mx.float32)
    if queries.dtype != keys.dtype:
        raise ValueError(f"queries are {queries.dtype}, keys {keys.dtype}: use one dtype")
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def attention_roundoff() -> float:
    """Unit roundoff of the products and sums of float32 attention on MLX's default
    device (READ-1): on CUDA, attention outside the fused one-query kernel multiplies
    through TF32 (10 fraction bits, 2^-11); on the CPU it is IEEE float32 (2^-24)."""
    on_cuda = mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()
    return 2.0**-11 if on_cuda else 2.0**-24
