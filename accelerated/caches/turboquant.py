"""`TurboQuantKVCache` on MLX (spec TQC-1 .. TQC-5): the reference's cache with the MLX
TurboQuant codec. Stores the reference's bits; its fetches are bit-exact too (TQC-2)."""

from __future__ import annotations

from functools import partial
from types import ModuleType

import mlx.core as mx

from kvspec.accelerated import turboquant
from kvspec.accelerated.attention_kernels import TURBO_KEY, TURBO_VALUE, StoredSide
from kvspec.accelerated.caches.attention import attention
from kvspec.accelerated.caches.kv import GrowingStorage
from kvspec.accelerated.caches.planned import Encoder
from kvspec.accelerated.caches.protocol import Mask
from kvspec.accelerated.caches.reads import SlotRead, running
from kvspec.accelerated.caches.records import GrowingRecordStorage, record_encode
from kvspec.accelerated.device import fused_kernels_enabled
from kvspec.reference.caches import turboquant as reference
from kvspec.reference.caches.protocol import Read
from kvspec.reference.caches.storage import Fields
from kvspec.reference.caches.turboquant import check_turboquant_parameters

__all__ = ["DeferredRead", "TurboQuantKVCache", "check_turboquant_parameters"]


class DeferredRead(reference.DeferredRead):
    """The deferred kernels' read (TQC-4) with MLX's attention and unrotation."""

    attention = staticmethod(attention)
    turboquant = turboquant


class TurboQuantKVCache(GrowingRecordStorage, GrowingStorage, reference.TurboQuantKVCache):
    """TurboQuant growable storage (TQC-1) on MLX."""

    turboquant: ModuleType = turboquant
    deferred_read: type[reference.DeferredRead] = DeferredRead
    #: v_scales: a zero scale decodes a value group to zero (TQ-8).
    value_magnitudes = (4,)

    def _encode_deferred(self, k: mx.array, v: mx.array) -> tuple[Fields, mx.array]:
        """DEFER-1 .. DEFER-3 with the running rank folded inside the encode (TQ-10); on
        CUDA the fields come as the one record the kernel writes."""
        prior = running(self)
        encode = self._record_encoder(k, v)
        if encode is not None:
            fields, failure = encode(k, v, prior)
            return fields, failure
        t, failure = turboquant.encode_deferred(k, v, self.k_bits, self.v_bits, prior)
        return (t.k_idx, t.k_scales, t.k_zeros, t.v_packed, t.v_scales), failure

    def _record_encoder(self, k: mx.array, v: mx.array) -> Encoder | None:
        """The one-launch record encode of keys and values shaped as `k`, `v`, their layout
        checked (TQ-10); None off CUDA and for empty appends."""
        if not (fused_kernels_enabled() and k.size > 0):
            return None
        return partial(
            record_encode,
            encode=turboquant.record_encoder(k, v, self.k_bits, self.v_bits),
            layout=turboquant.stored_layout(self.k_bits, self.v_bits, k.shape[-1]),
        )

    def _read_of(self, live: Fields, mask: Mask = None) -> Read:
        """READ-2's read of live fields with this cache's kernels (TQC-4), under `mask`."""
        if self.kernels == "dense":
            return super()._read_of(live, mask)
        return self.deferred_read(*self._decode_rotated(live), mask)

    def _slot_decoded(self, fields: Fields, new: Fields, visible: mx.array) -> Read:
        """COMPILE-4 with this cache's kernels (TQC-4): the deferred ones attend over the
        values left rotated and unrotate the output."""
        if self.kernels == "dense":
            return super()._slot_decoded(fields, new, visible)
        stored = self._decode_rotated(self._values_hidden(fields, visible))
        return SlotRead(*stored, *self._decode_rotated(new), visible, turboquant.unrotate)

    def _stored_sides(self, fields: Fields) -> tuple[StoredSide, StoredSide]:
        """READ-7: key codes with scales and zero points (TQ-4), value codes with scales
        (TQ-7); the output is unrotated once, whichever kernels the cache names (TQC-4), with
        the codebook and signs the kernels hold."""
        k_idx, k_scales, k_zeros, v_packed, v_scales = fields
        head_dim = k_scales.shape[-1] * turboquant.BLOCK_SIZE
        keys = StoredSide(TURBO_KEY, k_idx, k_scales, k_zeros, self.k_bits, 32, head_dim)
        values = StoredSide(TURBO_VALUE, v_packed, v_scales, None, self.v_bits, 32, head_dim)
        return keys, values
