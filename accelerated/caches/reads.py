"""Reads on MLX (spec READ-1 .. READ-7): the reference's reads, bound to MLX arrays, masks
and `mx.fast.scaled_dot_product_attention`; and the decode read of stored fields, whose
attention reads the codes where they lie (READ-7)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import ModuleType

import mlx.core as mx

from kvspec.accelerated import attention_kernels, dtypes
from kvspec.accelerated.attention_kernels import PLAIN, StoredSide
from kvspec.accelerated.caches import masks
from kvspec.accelerated.caches.attention import attention, check_queries
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
    #: The compiled step's live row count as data (int32 [1], COMPILE-4): the kernels read
    #: the first rows[0] rows of whole buffers. None: every row of the key codes.
    rows: mx.array | None = None

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
        check_queries(queries, (B, codes.shape[1], codes.shape[2], self.keys.dim), self.read_dtype)
        # The kernels widen the queries themselves; the output is in the read's format.
        return attention_kernels.decode_attention(
            queries,
            self.keys,
            self.values,
            scale,
            self.codebook,
            self.signs,
            self.read_dtype,
            self.rows,
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
        the stored rows, decoded only if its attention needs them. Rows of their own
        lengths read through their padding mask (ROWS-6)."""
        if mask is not None or self._left_padding:
            return super().append_and_read(k, v, mask)
        self._append(k, v)
        assert self._fields is not None and self.layout is not None
        # Snapshots of the buffers as they are now (a later write rebinds the fields' own
        # arrays, never these), whole: only the key codes are cut to the live rows, which
        # tells the kernels how many there are. No op but that one slice.
        fields = tuple(copy.copy(field) for field in self._fields)
        rows = self._live_rows()
        keys, values, codebook, signs = self._stored_sides(fields)
        keys = replace(keys, codes=keys.codes[:, :, :rows])
        read_dtype = dtypes.FLOAT_DTYPES[self.layout.dtype]

        def decoded() -> Read:
            return self._read_of(tuple(field[:, :, :rows] for field in fields))

        return StoredRead(keys, values, read_dtype, codebook, signs, decoded)

    def _decode_read(self, fields: Fields, visible: mx.array, active_length: mx.array) -> Read:
        """COMPILE-4 with READ-7: on CUDA the kernels read the first `active_length` rows of
        the joined buffers where they lie; elsewhere (and for several query positions) the
        portable read of the decoded buffers under `visible`."""
        assert self.layout is not None
        keys, values, codebook, signs = self._stored_sides(fields)
        read_dtype = dtypes.FLOAT_DTYPES[self.layout.dtype]

        def decoded() -> Read:
            return super(ReadMethods, self)._decode_read(fields, visible, active_length)

        rows = active_length.reshape(1)
        return StoredRead(keys, values, read_dtype, codebook, signs, decoded, rows)

    def _read_of(self, live: Fields) -> Read:
        """READ-2's read of live fields, decoded."""
        return self.dense_read(*self._decode(live), None)

    def _stored_sides(
        self, fields: Fields
    ) -> tuple[StoredSide, StoredSide, mx.array | None, mx.array | None]:
        """READ-7: keys and values of the stored fields as they lie, with the value codebook
        and signs where values stay rotated. Here fields stored as given (CACHE-3, RING-1)."""
        keys, values = fields
        return (
            StoredSide(PLAIN, keys, None, None, 0, 0, keys.shape[-1]),
            StoredSide(PLAIN, values, None, None, 0, 0, values.shape[-1]),
            None,
            None,
        )

    def _rank_input(self) -> mx.array:
        """The running rank as the compiled step reads it (COMPILE-3): uint32 [1], zero
        before the first record."""
        failure = running(self)
        return mx.zeros((1,), mx.uint32) if failure is None else failure

    def _record_failure(self, fields: Fields, failure: mx.array) -> Fields:
        """DEFER-3: keep the running rank as a lazy uint32 [1], and return the fields to
        store with the first tied to it, so evaluating what was stored evaluates the rank:
        its graph stays one step deep however long a decode loop runs, and no step reads
        it on the host."""
        self._failure = failure
        first, *rest = fields
        return (mx.depends(first, failure), *rest)


def running(storage: ReadMethods) -> mx.array | None:
    """A deferred storage's running failure rank (DEFER-3); None before its first record."""
    failure = storage._failure
    return failure if isinstance(failure, mx.array) else None
