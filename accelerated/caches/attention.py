"""Attention through `mx.fast.scaled_dot_product_attention` (spec READ-1).

Not bit-exact with the reference's float64 attention: READ-1 states the bound the
conformance suite holds it to.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from kvspec.accelerated import device
from kvspec.accelerated.caches.protocol import Mask


def attention(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Mask
) -> mx.array:
    """READ-1: queries [B, Hq, N, D] over keys [B, Hk, T, D], values [B, Hk, T, Dv]."""
    if tuple(values.shape[:3]) != tuple(keys.shape[:3]):
        raise ValueError(f"keys {tuple(keys.shape)} and values {tuple(values.shape)} do not fit")
    check_queries(queries, tuple(keys.shape), keys.dtype)
    if keys.dtype == mx.float32:
        # Float32 keys (TurboQuant's reads, TQC-2): widening the queries is exact.
        queries = queries.astype(mx.float32)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def check_queries(
    queries: mx.array, keys_shape: tuple[int, int, int, int], keys_dtype: mx.Dtype
) -> None:
    """READ-1: ValueError unless queries [B, Hq, N, D] fit keys [B, Hk, T, D] of
    `keys_dtype`: the same dtype, or any float format for float32 keys (widened exactly)."""
    _check_query_fit(tuple(queries.shape), queries.dtype, tuple(keys_shape), keys_dtype)


@lru_cache(maxsize=256)
def _check_query_fit(
    query_shape: tuple[int, ...],
    query_dtype: mx.Dtype,
    keys_shape: tuple[int, ...],
    keys_dtype: mx.Dtype,
) -> None:
    # Kept for the shapes that fit (a decode step checks the same ones at every layer);
    # a misfit raises at every call.
    B, Hq, _, D = query_shape
    _, Hk, _, _ = keys_shape
    if tuple(keys_shape[:2]) != (B, Hk) or keys_shape[3] != D:
        raise ValueError(f"queries {query_shape} do not fit keys {keys_shape}")
    if Hq % Hk != 0:
        raise ValueError(f"query heads {Hq} are not a multiple of key heads {Hk}")
    if keys_dtype != mx.float32 and query_dtype != keys_dtype:
        raise ValueError(f"queries are {query_dtype}, keys {keys_dtype}: use one dtype")


def attention_roundoff() -> float:
    """Unit roundoff of the products and sums of float32 attention on MLX's default
    device (READ-1): on CUDA, attention outside the fused one-query kernel multiplies
    through TF32 (10 fraction bits, 2^-11), and so do the kernels' reads on tensor cores
    wherever the kernels run; on the CPU it is IEEE float32 (2^-24)."""
    on_cuda = mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()
    return 2.0**-11 if on_cuda or device.fused_kernels_enabled() else 2.0**-24
