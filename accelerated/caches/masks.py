"""Masks on MLX (spec MASK-1 .. MASK-3); the same values as the reference's."""

from __future__ import annotations

import mlx.core as mx

from kvspec.accelerated.caches.protocol import Mask


def create_causal_mask(n: int, offset: int, window_size: int | None = None) -> mx.array:
    """bool [n, offset + n] (MASK-1)."""
    query_positions = mx.arange(offset, offset + n)[:, None]
    key_positions = mx.arange(offset + n)[None, :]
    visible = query_positions >= key_positions
    if window_size is not None:
        visible = visible & (query_positions < key_positions + window_size)
    return visible


def make_mask(n: int, offset: int, window_size: int | None) -> Mask:
    """MASK-2."""
    if n == 1 and (window_size is None or offset < window_size):
        return None
    if window_size is None or offset + n <= window_size:
        return "causal"
    return create_causal_mask(n, offset, window_size)


def rotating_make_mask(
    n: int, offset: int, max_size: int, ring_index: int, window_size: int | None
) -> Mask:
    """MASK-3."""
    if n > 1:
        window = window_size or max_size
        held = min(max_size - 1, offset)
        if held + n > window:
            return create_causal_mask(n, held, window)
        return "causal"
    if window_size is None:
        return None
    if offset >= window_size and max_size > window_size:
        index = 0 if ring_index >= max_size else ring_index
        size = offset + 1 if offset < max_size else max_size
        visible = mx.arange(size) >= size - window_size
        return mx.roll(visible, index + 1)
    return None
