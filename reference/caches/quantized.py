"""`QuantizedKVCache`: growable storage in the affine format (spec QKV-1, QKV-2), and the
affine fields it shares with the affine ring."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import numpy as np

from kvspec.reference import affine
from kvspec.reference.caches.kv import GrowingStorage
from kvspec.reference.caches.protocol import KvLayout
from kvspec.reference.caches.storage import Fields


def check_affine_parameters(group_size: int, bits: int) -> None:
    """QKV-1: the affine codec's widths and group sizes (AFF-1)."""
    if bits not in affine.SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {affine.SUPPORTED_BITS}, got {bits}")
    if group_size not in affine.SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"group_size must be one of {affine.SUPPORTED_GROUP_SIZES}, got {group_size}"
        )


class AffineFields:
    """The six affine fields of keys and values (QKV-1), mixed into a storage (growable or
    ring) as its encoding: k_words, k_scales, k_biases, v_words, v_scales, v_biases.
    Groups run along head_dim, so each position is encoded on its own."""

    #: The affine codec (AFF-1 .. AFF-6); the MLX backend binds its own, same bits (AFF-9).
    affine: ModuleType = affine
    deferred_checks = affine.DEFERRED_CHECKS
    group_size: int
    bits: int
    #: From the storage this is mixed into (ReadMethods).
    dtype_name: Callable[[object], str]

    def _check_head_dims(self, k: np.ndarray, v: np.ndarray) -> None:
        for name, x in (("k", k), ("v", v)):
            if x.shape[-1] % self.group_size != 0:
                raise ValueError(
                    f"{name} head_dim {x.shape[-1]} is not a multiple of group_size "
                    f"{self.group_size}"
                )

    def _encode(self, k: np.ndarray, v: np.ndarray) -> Fields:
        """The six fields of new positions (QKV-1)."""
        self._check_head_dims(k, v)
        keys = self.affine.quantize(k, self.group_size, self.bits)
        values = self.affine.quantize(v, self.group_size, self.bits)
        return (*keys, *values)

    def _encode_deferred(self, k: np.ndarray, v: np.ndarray) -> tuple[Fields, int]:
        """The six fields with NaN groups, and the running failure rank: the largest of the
        cache's, k's and v's (DEFER-1 .. DEFER-3)."""
        self._check_head_dims(k, v)
        *keys, key_failure = self.affine.quantize_deferred(k, self.group_size, self.bits)
        *values, value_failure = self.affine.quantize_deferred(v, self.group_size, self.bits)
        failure = max(self._failure, key_failure, value_failure)
        return (*keys, *values), failure

    def _decode(self, fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of the six fields, in the input dtype (QKV-1, AFF-6)."""
        k_words, k_scales, k_biases, v_words, v_scales, v_biases = fields
        keys = self.affine.dequantize(k_words, k_scales, k_biases, self.group_size, self.bits)
        values = self.affine.dequantize(v_words, v_scales, v_biases, self.group_size, self.bits)
        return keys, values

    def _layout_of(self, fields: Fields) -> KvLayout:
        """The layout six affine fields imply (QKV-1)."""
        k_words, k_scales, _, v_words, _, _ = fields
        B, H, _, k_word_count = k_words.shape
        k_dim = k_word_count * 32 // self.bits
        v_dim = v_words.shape[3] * 32 // self.bits
        return KvLayout(B, H, k_dim, v_dim, self.dtype_name(k_scales.dtype))


class QuantizedKVCache(AffineFields, GrowingStorage):
    """Keys and values in the affine format of `bits` bits per value and groups of
    `group_size` along head_dim (QKV-1). Every supported width and any head_dim that is a
    multiple of group_size (mlx-lm's fails at bits 5 and 6 with head_dim 128).

    Growth, trimming and masks are KVCache's (CACHE-3 .. CACHE-5). Reads see the window
    dequantized. Slot order (CACHE-8): k_words, k_scales, k_biases, v_words, v_scales,
    v_biases, each [B, H, offset, *].
    """

    def __init__(self, group_size: int = 64, bits: int = 8, checks: str = "eager") -> None:
        check_affine_parameters(group_size, bits)
        super().__init__(checks)
        self.group_size = group_size
        self.bits = bits

    def signature(self) -> str:
        return f"kv:affine:{self.bits}:{self.group_size}"
