"""`TurboQuantKVCache`: growable storage in the TurboQuant format (spec TQC-1 .. TQC-5).

Full-attention layers only: the seeds' TurboQuant cache is never a ring.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

from kvspec.reference import turboquant
from kvspec.reference.caches.attention import attention
from kvspec.reference.caches.kv import GrowingStorage, KVCache
from kvspec.reference.caches.protocol import KvLayout, Mask, Read, require
from kvspec.reference.caches.storage import Fields

#: How the append reads attend (TQC-4): over decoded values, or over rotated values with
#: the output unrotated.
KERNELS = ("dense", "deferred")

#: The dtype of every TurboQuant read, whatever the input's format (TQC-2).
READ_DTYPE = "float32"


def check_turboquant_parameters(k_bits: int, v_bits: int, kernels: str) -> None:
    """TQC-1: the codec's key and value widths (TQ-1) and a kernel set of KERNELS."""
    if k_bits not in turboquant.KEY_BITS:
        raise ValueError(f"k_bits must be one of {turboquant.KEY_BITS}, got {k_bits}")
    if v_bits not in turboquant.VALUE_BITS:
        raise ValueError(f"v_bits must be one of {turboquant.VALUE_BITS}, got {v_bits}")
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")


@dataclass(frozen=True)
class DeferredRead:
    """Keys and rotated values [B, Hk, T, D] as one read saw them, and its mask (TQC-4):
    attention over the rotated values, then `unrotate` of each output row (TQ-8)."""

    keys: np.ndarray
    rotated_values: np.ndarray
    mask: Mask

    #: The attention (READ-1) and the codec (TQ-6); each backend binds its own.
    attention = staticmethod(attention)
    turboquant = turboquant

    def attend(self, queries: np.ndarray, scale: float) -> np.ndarray:
        """READ-1 attention of `queries` [B, Hq, N, D] over the rotated values, unrotated."""
        rotated = self.attention(queries, self.keys, self.rotated_values, scale, self.mask)
        return self.turboquant.unrotate(rotated)


class TurboQuantKVCache(GrowingStorage):
    """Keys and values in the TurboQuant format of `k_bits` and `v_bits` (TQC-1); reads
    attend with `kernels`, "dense" or "deferred" (TQC-4).

    Growth, trimming and masks are KVCache's (CACHE-3 .. CACHE-5); each position is
    encoded on its own (CACHE-4). Reads are float32 (TQC-2). Slot order (TQC-5): k_idx,
    k_scales, k_zeros, v_packed, v_scales, each [B, H, offset, *] (TQ-10).
    Invariants: CACHE-3's, a head_dim of turboquant.HEAD_DIMS for keys and values, and
    fields of this cache's widths.
    """

    #: The TurboQuant codec (TQ-1 .. TQ-10); the MLX backend binds its own, same bits.
    turboquant: ModuleType = turboquant
    deferred_checks = turboquant.DEFERRED_CHECKS
    #: The read of the deferred kernels (TQC-4).
    deferred_read: type[DeferredRead] = DeferredRead

    def __init__(
        self, k_bits: int = 8, v_bits: int = 4, kernels: str = "dense", checks: str = "eager"
    ) -> None:
        check_turboquant_parameters(k_bits, v_bits, kernels)
        super().__init__(checks)
        self.k_bits = k_bits
        self.v_bits = v_bits
        self.kernels = kernels

    def _append_layout(self, k: np.ndarray, v: np.ndarray) -> KvLayout:
        # The fields do not record the input format (encoding widens exactly), so the
        # layout holds the read dtype and appends of any float format may follow (TQC-2).
        return super()._append_layout(k, v)._replace(dtype=READ_DTYPE)

    def _encode(self, k: np.ndarray, v: np.ndarray) -> Fields:
        t = self.turboquant.encode(k, v, self.k_bits, self.v_bits)
        return t.k_idx, t.k_scales, t.k_zeros, t.v_packed, t.v_scales

    def _encode_deferred(self, k: np.ndarray, v: np.ndarray) -> tuple[Fields, int]:
        """DEFER-1 .. DEFER-3: the five fields with NaN groups, and the running rank."""
        t, failure = self.turboquant.encode_deferred(k, v, self.k_bits, self.v_bits)
        fields = (t.k_idx, t.k_scales, t.k_zeros, t.v_packed, t.v_scales)
        return fields, max(self._failure, failure)

    def _tensor_and_head_dim(self, fields: Fields) -> tuple[turboquant.TurboQuantTensor, int]:
        t = self.turboquant.TurboQuantTensor(*fields)
        return t, t.k_scales.shape[-1] * turboquant.BLOCK_SIZE

    def _decode(self, fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        t, head_dim = self._tensor_and_head_dim(fields)
        return self.turboquant.decode(t, t.k_idx.shape[2], head_dim)

    def _layout_of(self, fields: Fields) -> KvLayout:
        """TQC-5: the layout five fields imply; ValueError unless they hold this cache's
        widths."""
        if len(fields) != 5:
            raise ValueError(f"a TurboQuant state has 5 arrays, got {len(fields)}")
        t, head_dim = self._tensor_and_head_dim(fields)
        if self.turboquant.stored_bits(t, head_dim) != (self.k_bits, self.v_bits):
            raise ValueError(f"state fields are not k{self.k_bits}v{self.v_bits} at D={head_dim}")
        B, H = t.k_idx.shape[:2]
        return KvLayout(B, H, head_dim, head_dim, READ_DTYPE)

    def signature(self) -> str:
        """CACHE-7: "kv:turboquant:K_BITS:V_BITS" (the kernels store nothing)."""
        return f"kv:turboquant:{self.k_bits}:{self.v_bits}"

    def update_and_fetch_deferred_v(
        self, k: np.ndarray, v: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """update_and_fetch, but the values stay rotated (TQC-4, TQ-8)."""
        self._append(k, v)
        t, head_dim = self._tensor_and_head_dim(self._live())
        return self.turboquant.decode(t, self.offset, head_dim, defer_v=True)

    def append_and_read(self, k: np.ndarray, v: np.ndarray, mask: Mask) -> Read:
        """TQC-4: the dense kernels read decoded values; the deferred ones rotated values,
        unrotating the attention output."""
        if self.kernels == "dense":
            return super().append_and_read(k, v, mask)
        keys, rotated = self.update_and_fetch_deferred_v(k, v)
        return self.deferred_read(keys, rotated, self._rows_mask(mask, k.shape[2], keys.shape[2]))

    def _graph_parameters(self) -> tuple[str, str]:
        """COMPILE-3: the kernels decide the read the step traces (TQC-4)."""
        return self.signature(), self.kernels

    def _slot_read(
        self, fields: Fields, new: Fields, position: np.ndarray, active_length: np.ndarray
    ) -> Read:
        """COMPILE-4 with this cache's kernels (TQC-4): the deferred ones read the stored and
        the new values rotated."""
        if self.kernels == "dense":
            return super()._slot_read(fields, new, position, active_length)
        visible = self._slot_visible(fields, position, active_length)
        keys, rotated = self._decode_rotated(fields)
        new_keys, new_rotated = self._decode_rotated(new)
        return self.deferred_read(*self._slot_rows(keys, rotated, new_keys, new_rotated, visible))

    def _decode_rotated(self, fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        """Keys and values of stored positions, the values left rotated (TQ-8)."""
        t, head_dim = self._tensor_and_head_dim(fields)
        return self.turboquant.decode(t, t.k_idx.shape[2], head_dim, defer_v=True)

    @classmethod
    def from_kv_cache(
        cls,
        cache: KVCache,
        k_bits: int,
        v_bits: int,
        kernels: str = "dense",
        checks: str = "eager",
    ) -> TurboQuantKVCache:
        """TQC-3: the live window of `cache` encoded into a new TurboQuantKVCache with the
        same offset and minimum reusable offset, and `checks` (DEFER-3); `cache` is
        consumed (CACHE-9). Nothing is consumed when the window cannot be encoded."""
        if not isinstance(cache, KVCache) or cache.xp is not cls.xp:
            raise ValueError(
                f"from_kv_cache takes a KVCache of this backend, got {type(cache).__module__}."
                f"{type(cache).__name__}"
            )
        target = cls(k_bits, v_bits, kernels, checks)
        window = cache.keys_and_values()
        if window is not None:
            assert cache.layout is not None
            target.adopt_encoded(*window, cache.layout._replace(dtype=READ_DTYPE))
        target.carry_positions(cache)
        cache.release()
        return target

    def check_invariants(self) -> None:
        """CACHE-3 invariants, then fields of this cache's widths that imply its layout."""
        super().check_invariants()
        if self._fields is None:
            return
        layout = self._layout_of(self._fields)
        require(layout == self._layout, f"fields imply {layout}, the cache holds {self._layout}")
        for field in self._fields[1], self._fields[2], self._fields[4]:
            require(field.dtype == self.xp.float16, f"a group field is {field.dtype}, not float16")
