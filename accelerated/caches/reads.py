"""Reads on MLX (spec READ-1 .. READ-7): the reference's reads, bound to MLX arrays, masks
and `mx.fast.scaled_dot_product_attention`; and the decode read of stored fields, whose
attention reads the codes where they lie (READ-7)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import mlx.core as mx

from kvspec.accelerated import attention_kernels, dtypes
from kvspec.accelerated.attention_kernels import PLAIN, StoredSide
from kvspec.accelerated.caches import masks
from kvspec.accelerated.caches.attention import attention, checked_queries
from kvspec.accelerated.caches.protocol import Mask, Read
from kvspec.accelerated.device import fused_kernels_enabled
from kvspec.reference.caches import reads
from kvspec.reference.caches.storage import Fields


class DenseRead(reads.DenseRead):
    """READ-1 with MLX's attention."""

    attention = staticmethod(attention)


class PositionwiseRead(reads.PositionwiseRead):
    """READ-4's one decode read per position, outputs joined on MLX."""

    xp = mx


@dataclass(frozen=True)
class StoredRead:
    """READ-7: a decode read (READ-2) of the stored rows themselves. `attend` with one query
    position runs the decode-attention kernels over the fields where they lie; anywhere
    else (no CUDA, a shape the kernels do not take, several query positions) it attends
    through `decoded()`, READ-2's read of the same rows."""

    keys: StoredSide
    values: StoredSide
    #: The format keys are read in (the layout's dtype; float32 for TurboQuant, TQC-2).
    read_dtype: mx.Dtype
    #: TurboQuant values: the codebook and the sign vector that unrotates the output.
    codebook: mx.array | None
    signs: mx.array | None
    decoded: Callable[[], Read]

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """READ-1 attention of `queries` [B, Hq, N, Dk] over the read's rows."""
        B, Hq, N, _ = queries.shape
        if not (
            N == 1
            and fused_kernels_enabled()
            and attention_kernels.supported(self.keys, self.values, Hq)
        ):
            return self.decoded().attend(queries, scale)
        codes = self.keys.codes
        queries = checked_queries(
            queries, (B, codes.shape[1], codes.shape[2], self.keys.dim), self.read_dtype
        )
        return attention_kernels.decode_attention(
            queries, self.keys, self.values, scale, self.codebook, self.signs, queries.dtype
        )


class ReadMethods(reads.ReadMethods):
    """READ-2 .. READ-7, and what every MLX storage computes with: the reference's steps
    over mx.array, a decode read of stored fields, and deferred failures kept in the graph
    (DEFER-3)."""

    xp: ModuleType = mx
    masks: ModuleType = masks
    dense_read: type[reads.DenseRead] = DenseRead
    dtype_name = staticmethod(dtypes.dtype_name)

    @staticmethod
    def _detached(rows: mx.array) -> mx.array:
        # An MLX slice is a value: a later write rebinds the field, never the slice, so
        # no copy (CACHE-3, CACHE-8).
        return rows

    def append_and_read(self, k: mx.array, v: mx.array, mask: Mask) -> Read:
        """A read without a mask is a decode read (READ-2): append, then READ-7's read of
        the stored rows, decoded only if its attention needs them."""
        if mask is not None:
            return super().append_and_read(k, v, mask)
        self._append(k, v)
        live = self._live()
        keys, values, codebook, signs = self._stored_sides(live)
        read_dtype = dtypes.FLOAT_DTYPES[self.layout.dtype]
        return StoredRead(keys, values, read_dtype, codebook, signs, lambda: self._read_of(live))

    def _read_of(self, live: Fields) -> Read:
        """READ-2's read of live fields, decoded."""
        return self.dense_read(*self._decode(live), None)

    def _stored_sides(
        self, live: Fields
    ) -> tuple[StoredSide, StoredSide, mx.array | None, mx.array | None]:
        """READ-7: keys and values of live fields as stored, with the value codebook and signs
        where values stay rotated. Here fields stored as given (CACHE-3, RING-1)."""
        keys, values = live
        return (
            StoredSide(PLAIN, keys, None, None, 0, 0, keys.shape[-1]),
            StoredSide(PLAIN, values, None, None, 0, 0, values.shape[-1]),
            None,
            None,
        )

    def _record_failure(self, fields: Fields, failure: mx.array) -> Fields:
        """DEFER-3: keep the largest rank as a lazy scalar, and return the fields to store
        tied to it, so evaluating what was stored evaluates the record: its graph stays one
        step deep however long a decode loop runs, and no step reads it on the host."""
        total = mx.maximum(self._failure, failure)
        self._failure = total
        return tuple(mx.depends(list(fields), [total]))
