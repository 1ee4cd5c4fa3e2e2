"""Masks on MLX (spec MASK-1 .. MASK-3): the reference's rules, their arrays as mx.array."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvspec.accelerated.caches.protocol import Mask
from kvspec.reference.caches import masks


def _on_mlx(mask: Mask) -> Mask:
    """None and "causal" as they are; a boolean array as an mx.array."""
    if mask is None or isinstance(mask, str):
        return mask
    return mx.array(mask)


def create_causal_mask(n: int, offset: int, window_size: int | None = None) -> mx.array:
    """bool [n, offset + n] (MASK-1)."""
    return mx.array(masks.create_causal_mask(n, offset, window_size))


def make_mask(n: int, offset: int, window_size: int | None) -> Mask:
    """MASK-2."""
    return _on_mlx(masks.make_mask(n, offset, window_size))


def rotating_make_mask(
    n: int, offset: int, max_size: int, keep: int, ring_index: int, window_size: int | None
) -> Mask:
    """MASK-3."""
    return _on_mlx(masks.rotating_make_mask(n, offset, max_size, keep, ring_index, window_size))


def padded_mask(mask: Mask, n: int, *positions: np.ndarray | None) -> mx.array:
    """ROWS-6: bool [B, 1, n, T]; `positions` as the reference takes them (the keys', the
    rows' left padding, the queries')."""
    return mx.array(masks.padded_mask(mask, n, *positions))
