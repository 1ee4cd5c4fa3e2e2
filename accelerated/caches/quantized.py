"""`QuantizedKVCache`: growable storage in the affine format (spec QKV-1, QKV-2)."""

from __future__ import annotations

import mlx.core as mx

from kvspec.accelerated import affine
from kvspec.accelerated.caches.kv import Fields, GrowingStorage
from kvspec.accelerated.caches.protocol import KvLayout
from kvspec.accelerated.dtypes import dtype_name


def check_affine_parameters(group_size: int, bits: int) -> None:
    """QKV-1: the affine codec's widths and group sizes (AFF-1)."""
    if bits not in affine.SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {affine.SUPPORTED_BITS}, got {bits}")
    if group_size not in affine.SUPPORTED_GROUP_SIZES:
        raise ValueError(
            f"group_size must be one of {affine.SUPPORTED_GROUP_SIZES}, got {group_size}"
        )


def encode_affine(k: mx.array, v: mx.array, group_size: int, bits: int) -> Fields:
    """The six fields of new positions (QKV-1); groups run along head_dim, so each
    position is encoded on its own."""
    for name, x in (("k", k), ("v", v)):
        if x.shape[-1] % group_size != 0:
            raise ValueError(
                f"{name} head_dim {x.shape[-1]} is not a multiple of group_size {group_size}"
            )
    return (*affine.quantize(k, group_size, bits), *affine.quantize(v, group_size, bits))


def decode_affine(fields: Fields, group_size: int, bits: int) -> tuple[mx.array, mx.array]:
    """Keys and values of the six fields, in the input dtype (QKV-1, AFF-6)."""
    k_words, k_scales, k_biases, v_words, v_scales, v_biases = fields
    keys = affine.dequantize(k_words, k_scales, k_biases, group_size, bits)
    values = affine.dequantize(v_words, v_scales, v_biases, group_size, bits)
    return keys, values


def affine_layout(fields: Fields, bits: int) -> KvLayout:
    """The layout six affine fields imply (QKV-1)."""
    k_words, k_scales, _, v_words, _, _ = fields
    B, H, _, k_word_count = k_words.shape
    return KvLayout(
        B, H, k_word_count * 32 // bits, v_words.shape[3] * 32 // bits, dtype_name(k_scales.dtype)
    )


class QuantizedKVCache(GrowingStorage):
    """Keys and values in the affine format of `bits` bits per value and groups of
    `group_size` along head_dim (QKV-1). Every supported width and any head_dim that is a
    multiple of group_size (mlx-lm's fails at bits 5 and 6 with head_dim 128).

    Growth, trimming and masks are KVCache's (CACHE-3 .. CACHE-5). Reads see the window
    dequantized. Slot order (CACHE-8): k_words, k_scales, k_biases, v_words, v_scales,
    v_biases, each [B, H, offset, *].
    """

    def __init__(self, group_size: int = 64, bits: int = 8) -> None:
        check_affine_parameters(group_size, bits)
        super().__init__()
        self.group_size = group_size
        self.bits = bits

    def _encode(self, k: mx.array, v: mx.array) -> Fields:
        return encode_affine(k, v, self.group_size, self.bits)

    def _decode(self, fields: Fields) -> tuple[mx.array, mx.array]:
        return decode_affine(fields, self.group_size, self.bits)

    def _layout_of(self, fields: Fields) -> KvLayout:
        return affine_layout(fields, self.bits)

    def signature(self) -> str:
        return f"kv:affine:{self.bits}:{self.group_size}"
