"""bf16-first caches on MLX (spec B16F-1 .. B16F-6): the reference's array-agnostic
`Bf16FirstCache` over the MLX storages."""

from __future__ import annotations

import mlx.core as mx

from kvspec.accelerated.caches.kv import KVCache
from kvspec.accelerated.caches.protocol import Cache
from kvspec.accelerated.caches.quantized import QuantizedKVCache, check_affine_parameters
from kvspec.accelerated.caches.reads import PositionwiseRead
from kvspec.accelerated.caches.rotating import RotatingKVCache
from kvspec.accelerated.caches.rotating_quantized import RotatingQuantizedKVCache
from kvspec.accelerated.caches.turboquant import TurboQuantKVCache
from kvspec.reference.caches.bf16_first import Bf16FirstCache, transition_due
from kvspec.reference.caches.turboquant import check_turboquant_parameters

__all__ = [
    "Bf16FirstCache",
    "Bf16FirstKv4Head256Cache",
    "Bf16FirstQuantizedKVCache",
    "Bf16FirstRotatingQuantizedKVCache",
    "Bf16FirstTurboQuantKVCache",
    "transition_due",
]


class Bf16FirstQuantizedKVCache(Bf16FirstCache[mx.array]):
    """KVCache, then QuantizedKVCache(group_size, bits) (B16F-2)."""

    def __init__(self, group_size: int, bits: int, start: int) -> None:
        check_affine_parameters(group_size, bits)
        self.group_size = group_size
        self.bits = bits
        super().__init__(start)

    def _new_plain(self) -> KVCache:
        return KVCache()

    def _new_converted(self) -> QuantizedKVCache:
        return QuantizedKVCache(self.group_size, self.bits)

    def _convert(self, plain: Cache[mx.array]) -> QuantizedKVCache:
        assert isinstance(plain, KVCache)
        return plain.to_quantized(self.group_size, self.bits)


class Bf16FirstRotatingQuantizedKVCache(Bf16FirstCache[mx.array]):
    """RotatingKVCache(max_size), then RotatingQuantizedKVCache (B16F-2, READ-4)."""

    def __init__(self, max_size: int, group_size: int, bits: int, start: int) -> None:
        check_affine_parameters(group_size, bits)
        self.max_size = max_size
        self.group_size = group_size
        self.bits = bits
        super().__init__(start)

    def _new_plain(self) -> RotatingKVCache:
        return RotatingKVCache(self.max_size)

    def _new_converted(self) -> RotatingQuantizedKVCache:
        return RotatingQuantizedKVCache(self.max_size, self.group_size, self.bits)

    def _convert(self, plain: Cache[mx.array]) -> RotatingQuantizedKVCache:
        assert isinstance(plain, RotatingKVCache)
        return plain.to_quantized(self.group_size, self.bits)

    def append_committed(self, k: mx.array, v: mx.array) -> PositionwiseRead:
        """READ-4: one `append_decode` per position."""
        self.check_append(k, v)
        reads = [
            self.append_decode(k[:, :, i : i + 1], v[:, :, i : i + 1]) for i in range(k.shape[2])
        ]
        return PositionwiseRead(tuple(reads))


class Bf16FirstKv4Head256Cache(Bf16FirstQuantizedKVCache):
    """Bf16FirstQuantizedKVCache at 4 bits, group 64, for head_dim 256 only (B16F-2)."""

    head_dim = 256

    def __init__(self, start: int) -> None:
        super().__init__(64, 4, start)


class Bf16FirstTurboQuantKVCache(Bf16FirstCache[mx.array]):
    """KVCache, then TurboQuantKVCache(k_bits, v_bits, kernels) (B16F-2): the cache the turbo
    scheme composes for full-attention layers (SCHEME-4)."""

    def __init__(self, k_bits: int, v_bits: int, start: int, kernels: str = "dense") -> None:
        check_turboquant_parameters(k_bits, v_bits, kernels)
        self.k_bits = k_bits
        self.v_bits = v_bits
        self.kernels = kernels
        super().__init__(start)

    def _new_plain(self) -> KVCache:
        return KVCache()

    def _new_converted(self) -> TurboQuantKVCache:
        return TurboQuantKVCache(self.k_bits, self.v_bits, self.kernels)

    def _convert(self, plain: Cache[mx.array]) -> TurboQuantKVCache:
        assert isinstance(plain, KVCache)
        return TurboQuantKVCache.from_kv_cache(plain, self.k_bits, self.v_bits, self.kernels)
