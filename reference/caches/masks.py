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
    n: int, offset: int, max_size: int, keep: int, ring_index: int, window_size: int | None
) -> Mask:
    """The mask of an append of `n` positions to a ring holding `offset` (MASK-3): query
    p = offset + i sees a held position j <= p that is one of the ring's own window (the
    `keep` kept positions and the last max_size - keep) or, with a window, one of the
    last `window_size` positions. Columns are the fetch's rows in ring order (RING-4);
    None when the one query sees every row, "causal" when the lower-right rule is exact."""
    held = _held_positions(n, offset, max_size, keep, ring_index)
    if n > 1:
        # RING-3 fetches in temporal order, the new positions last: query i has reached
        # exactly the keys the lower-right causal rule gives it, and the window hides one
        # of them from some query iff it hides it from the last, the farthest from every
        # key. So the last query's row decides "causal", with no n x t matrix.
        last_query = offset + n - 1
        if _in_window(last_query - held, held, max_size, keep, window_size).all():
            return "causal"
    key_positions = held[None, :]
    query_positions = np.arange(offset, offset + n)[:, None]
    distance = query_positions - key_positions
    visible = (distance >= 0) & _in_window(distance, key_positions, max_size, keep, window_size)
    if n == 1:
        return None if visible.all() else visible[0]
    return visible


def _in_window(
    distance: np.ndarray,
    key_positions: np.ndarray,
    max_size: int,
    keep: int,
    window_size: int | None,
) -> np.ndarray:
    """MASK-3's window: a key at `distance` behind a query is one of the ring's own window
    (a kept position, or one of the last max_size - keep) or, with a window, one of the
    last `window_size` positions."""
    if window_size is None:
        return (key_positions < keep) | (distance < max_size - keep)
    return distance < window_size


def _held_positions(n: int, offset: int, max_size: int, keep: int, ring_index: int) -> np.ndarray:
    """The position each row of a ring's fetch holds after appending `n` positions to a
    ring holding `offset`, rows in ring order (RING-2 .. RING-4)."""
    if n > 1:
        # RING-3: temporal order, the kept positions and the most recent old ones, so
        # that max_size - 1 old positions remain, then the new ones.
        old = min(offset, max_size - 1)
        kept = min(keep, old)
        recent = np.arange(offset - (old - kept), offset)
        return np.concatenate([np.arange(kept), recent, np.arange(offset, offset + n)])
    if offset < max_size:
        return np.arange(offset + 1)
    # RING-2: the write lands at the ring index, or at keep once the index reached
    # max_size; rows from keep on cycle back in time from there.
    write_row = ring_index if ring_index < max_size else keep
    rows = np.arange(max_size)
    cycled = offset - (write_row - rows) % (max_size - keep)
    return np.where(rows < keep, rows, cycled)


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
