"""Reads on MLX (spec READ-1 .. READ-6): the reference's reads, bound to MLX arrays, masks
and `mx.fast.scaled_dot_product_attention`."""

from __future__ import annotations

from types import ModuleType

import mlx.core as mx

from kvspec.accelerated import dtypes
from kvspec.accelerated.caches import masks
from kvspec.accelerated.caches.attention import attention
from kvspec.reference.caches import reads


class DenseRead(reads.DenseRead):
    """READ-1 with MLX's attention."""

    attention = staticmethod(attention)


class PositionwiseRead(reads.PositionwiseRead):
    """READ-4's one decode read per position, outputs joined on MLX."""

    xp = mx


class ReadMethods(reads.ReadMethods):
    """READ-2 .. READ-6, and what every MLX storage computes with: the reference's steps
    over mx.array."""

    xp: ModuleType = mx
    masks: ModuleType = masks
    dense_read: type[reads.DenseRead] = DenseRead
    dtype_name = staticmethod(dtypes.dtype_name)

    @staticmethod
    def _detached(rows: mx.array) -> mx.array:
        # An MLX slice is a value: a later write rebinds the field, never the slice, so
        # no copy (CACHE-3, CACHE-8).
        return rows
