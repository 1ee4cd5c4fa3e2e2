"""`QuantizedKVCache` on MLX (spec QKV-1, QKV-2): the reference's cache with the MLX affine
codec, which stores the same bits (AFF-9)."""

from __future__ import annotations

from functools import partial
from types import ModuleType

import mlx.core as mx

from kvspec.accelerated import affine
from kvspec.accelerated.attention_kernels import AFFINE, StoredSide
from kvspec.accelerated.caches.kv import GrowingStorage
from kvspec.accelerated.caches.planned import Encoder
from kvspec.accelerated.caches.reads import running
from kvspec.accelerated.caches.records import GrowingRecordStorage, record_encode
from kvspec.reference.caches import quantized
from kvspec.reference.caches.quantized import check_affine_parameters
from kvspec.reference.caches.storage import Fields

__all__ = ["AffineFields", "AffineRecordFields", "QuantizedKVCache", "check_affine_parameters"]


class AffineFields(quantized.AffineFields):
    """The six affine fields (QKV-1) through the MLX affine codec."""

    affine: ModuleType = affine
    #: v_scales and v_biases: zero both and a value decodes to zero (AFF-6).
    value_magnitudes = (4, 5)

    def _encode_deferred(self, k: mx.array, v: mx.array) -> tuple[Fields, mx.array]:
        """DEFER-1 .. DEFER-3 with the running rank folded inside the encode: no op of its
        own (one launch for k and v together on CUDA)."""
        self._check_head_dims(k, v)
        *fields, failure = affine.quantize_deferred_pair(
            k, v, self.group_size, self.bits, running(self)
        )
        return tuple(fields), failure

    def _stored_sides(self, fields: Fields) -> tuple[StoredSide, StoredSide]:
        """READ-7: words, scales and biases of keys and values (AFF-5)."""
        k_words, k_scales, k_biases, v_words, v_scales, v_biases = fields
        sides = [
            StoredSide(AFFINE, words, scales, biases, self.bits, self.group_size, dim)
            for words, scales, biases in (
                (k_words, k_scales, k_biases),
                (v_words, v_scales, v_biases),
            )
            for dim in [words.shape[-1] * 32 // self.bits]
        ]
        return sides[0], sides[1]


class AffineRecordFields(AffineFields):
    """AffineFields kept in one record per row (TQC-1's records, QKV-1)."""

    def _encode_deferred(self, k: mx.array, v: mx.array) -> tuple[Fields, mx.array]:
        """AffineFields' encode; on CUDA the fields come as the one record the kernel
        writes."""
        encode = self._record_encoder(k, v)
        if encode is None:
            return super()._encode_deferred(k, v)
        fields, failure = encode(k, v, running(self))
        return fields, failure

    def _record_encoder(self, k: mx.array, v: mx.array) -> Encoder | None:
        """The one-launch record encode of keys and values shaped as `k`, `v`, their head
        dims checked (QKV-1); None where `affine.record_encoder_takes` them not."""
        if not affine.record_encoder_takes(k, v):
            return None
        self._check_head_dims(k, v)
        return partial(
            record_encode,
            encode=affine.record_encoder(k, self.group_size, self.bits),
            layout=affine.stored_layout(self.group_size, self.bits, k.shape[-1], k.dtype),
        )


class QuantizedKVCache(
    GrowingRecordStorage, AffineRecordFields, GrowingStorage, quantized.QuantizedKVCache
):
    """Affine growable storage (QKV-1) on MLX, its six fields in one record per row."""
