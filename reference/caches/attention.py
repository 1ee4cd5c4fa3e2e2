"""The reference attention every read is held to (spec READ-1)."""

from __future__ import annotations

import numpy as np

from kvspec.reference.caches.masks import mask_matrix
from kvspec.reference.caches.protocol import Mask


def attention(
    queries: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, mask: Mask
) -> np.ndarray:
    """softmax(scale * q k^T, masked) v in float64, returned as float32 (READ-1).

    queries [B, Hq, N, D], keys [B, Hk, T, D], values [B, Hk, T, Dv]; Hq is a multiple of
    Hk and query head h reads key head h // (Hq / Hk) (grouped query attention).
    """
    B, Hq, N, D = queries.shape
    _, Hk, T, _ = keys.shape
    Dv = values.shape[3]
    if keys.shape[:2] != (B, Hk) or keys.shape[3] != D or values.shape[:3] != (B, Hk, T):
        raise ValueError(
            f"queries {queries.shape}, keys {keys.shape}, values {values.shape} do not fit"
        )
    if Hq % Hk != 0:
        raise ValueError(f"query heads {Hq} are not a multiple of key heads {Hk}")
    group = Hq // Hk
    visible = mask_matrix(mask, N, T)
    if visible.ndim == 4:
        # Rows of their own lengths (ROWS-6): [B, 1, N, T] over the query-head group axis.
        visible = visible[:, :, None]
    if not np.all(np.any(visible, axis=-1)):
        raise ValueError("a query sees no key under this mask")
    q = queries.astype(np.float64).reshape(B, Hk, group, N, D)
    k = keys.astype(np.float64)[:, :, None]
    v = values.astype(np.float64)[:, :, None]
    scores = (q @ np.swapaxes(k, -1, -2)) * scale
    scores = np.where(visible, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    out = weights @ v
    return out.reshape(B, Hq, N, Dv).astype(np.float32)
