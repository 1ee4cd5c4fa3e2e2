"""What the MLX growable and ring storages share (spec CACHE-3, RING-1): `PlainFields`
without the reference's copies."""

from __future__ import annotations

import mlx.core as mx

from kvspec.accelerated.caches.planned import Encoder
from kvspec.reference.caches import storage
from kvspec.reference.caches.storage import Fields


class PlainFields(storage.PlainFields):
    """Keys and values stored as given (CACHE-3, RING-1). An MLX write rebinds the field and
    never reaches the caller's array, so the new positions need no copy of their own (the
    reference copies, as NumPy writes in place)."""

    def _encode(self, k: mx.array, v: mx.array) -> Fields:
        return k, v

    def _append_encoder(self, k: mx.array, v: mx.array) -> Encoder:
        """Keys and values as given, whatever the checks (none reads them)."""
        return _as_given


def _as_given(k: mx.array, v: mx.array, prior: mx.array | None) -> tuple[Fields, None]:
    return (k, v), None
