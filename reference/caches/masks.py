"""Masks: which stored keys each query of an append sees (spec MASK-1 .. MASK-3)."""

from __future__ import annotations

import numpy as np

from kvspec.reference.caches.protocol import Mask


def create_causal_mask(n: int, offset: int, window_size: int | None = None) -> np.ndarray:
    """bool [n, offset + n]: query i sees key j iff offset + i >= j and, with a window,
    offset + i < j + window_size (MASK-1; mlx-lm's `create_causal_mask`)."""
    query_positions = np.arange(offset, offset + n)[:, None]
    key_positions = np.arange(offset + n)[None, :]
    visible = query_positions >= key_positions
    if window_size is not None:
        visible = visible & (query_positions < key_positions + window_size)
    return visible


def make_mask(n: int, offset: int, window_size: int | None) -> Mask:
    """The mask of an append of `n` positions to a full-attention cache holding `offset`
    (MASK-2): None when every query sees every key, "causal" when the lower-right causal
    rule alone is exact, else the explicit array."""
    if n == 1 and (window_size is None or offset < window_size):
        return None
    if window_size is None or offset + n <= window_size:
        return "causal"
    return create_causal_mask(n, offset, window_size)


def rotating_make_mask(
    n: int, offset: int, max_size: int, ring_index: int, window_size: int | None
) -> Mask:
    """The mask of an append of `n` positions to a ring (MASK-3; mlx-lm's
    `RotatingKVCache.make_mask`)."""
    if n > 1:
        window = window_size or max_size
        held = min(max_size - 1, offset)
        if held + n > window:
            return create_causal_mask(n, held, window)
        return "causal"
    if window_size is None:
        return None
    if offset >= window_size and max_size > window_size:
        # The ring holds more than the window: hide the oldest slots, which sit just
        # after the write index.
        index = 0 if ring_index >= max_size else ring_index
        size = offset + 1 if offset < max_size else max_size
        visible = np.arange(size) >= size - window_size
        return np.roll(visible, index + 1)
    return None


def mask_matrix(mask: Mask, n: int, t: int) -> np.ndarray:
    """Any mask as a bool array [n, t] (MASK-1): None is all visible, "causal" aligns the
    last query with the last key, an array of shape [t] or [n, t] broadcasts; a mask of
    rows of their own lengths, [B, 1, n or 1, t], gives [B, 1, n, t] (ROWS-6)."""
    if mask is None:
        return np.ones((n, t), dtype=bool)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"mask string must be 'causal', got {mask!r}")
        return create_causal_mask(n, t - n)
    visible = np.asarray(mask)
    if visible.dtype != np.bool_:
        raise ValueError(f"mask array must be bool, got {visible.dtype}")
    if visible.ndim == 4 and visible.shape[1] == 1:
        return np.broadcast_to(visible, (visible.shape[0], 1, n, t))
    if visible.ndim > 2:
        raise ValueError(
            f"mask array must be [T], [N, T] or [B, 1, N, T], got shape {visible.shape}"
        )
    return np.broadcast_to(visible, (n, t))


def padded_mask(
    mask: Mask,
    n: int,
    positions: np.ndarray,
    left_padding: np.ndarray,
    query_positions: np.ndarray | None = None,
) -> np.ndarray:
    """ROWS-6: bool [B, 1, n, T] for a batch whose row b starts at buffer position
    left_padding[b]: `mask` over keys at buffer `positions` [T], and each row's keys before
    its first position hidden from its queries. A query at buffer `query_positions[i]`
    before its row's first position (a padded prompt, ROWS-11) sees only its own key."""
    shared = mask_matrix(mask, n, positions.size)
    own = positions[None, :] >= left_padding[:, None]
    visible = shared[None, None] & own[:, None, None, :]
    if query_positions is None:
        return visible
    padding_query = query_positions[None, :] < left_padding[:, None]
    itself = query_positions[:, None] == positions[None, :]
    return visible | (padding_query[:, None, :, None] & itself[None, None])
