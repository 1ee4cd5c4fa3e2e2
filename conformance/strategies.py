"""Hypothesis strategies for codec inputs, including the values that break codecs.

Arrays are drawn group by group: each group of the last axis takes one "kind" of
content, so a single example mixes ordinary groups with the edges the spec names
(CONV-5, AFF-7): constant groups, zeros and -0.0, groups with no positive value,
tiny and subnormal values, large magnitudes, and exact ties where half-to-even and
half-away-from-zero differ.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from kvspec.reference.dtypes import FLOAT_DTYPES, largest_finite, smallest_subnormal

dtype_names = st.sampled_from(sorted(FLOAT_DTYPES))

GROUP_KINDS = (
    "normal",
    "wide",
    "constant",
    "zeros",
    "signed_zeros",
    "non_positive",
    "tiny",
    "subnormal",
    "large",
    "ties",
)


def edge_group(kind: str, size: int, dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """One group of `size` float32 values of the given kind, finite in `dtype`."""
    top = largest_finite(dtype)
    if kind == "normal":
        return rng.standard_normal(size).astype(np.float32)
    if kind == "wide":
        return (rng.standard_normal(size) * 10.0 ** rng.uniform(-6, 4)).astype(np.float32)
    if kind == "constant":
        return np.full(size, rng.standard_normal() * 10.0 ** rng.uniform(-4, 3), np.float32)
    if kind == "zeros":
        return np.zeros(size, np.float32)
    if kind == "signed_zeros":
        return np.where(rng.random(size) < 0.5, np.float32(-0.0), np.float32(0.0))
    if kind == "non_positive":
        return -np.abs(rng.standard_normal(size)).astype(np.float32)
    if kind == "tiny":
        return (rng.standard_normal(size) * 1e-6).astype(np.float32)
    if kind == "subnormal":
        steps = rng.integers(-64, 64, size)
        return (steps * smallest_subnormal(dtype)).astype(np.float32)
    if kind == "large":
        # Large but finite in the dtype, with a range that stays finite in float32.
        return (rng.uniform(-1, 1, size) * min(top, 1e30) * 0.25).astype(np.float32)
    if kind == "ties":
        # Integers 0..2m with both ends present: the affine step is exactly 2, so odd
        # values sit on ties; small integers are exact in every dtype.
        m = int(rng.choice([1, 3, 7, 15, 31]))
        group = rng.integers(0, 2 * m + 1, size).astype(np.float32)
        group[0], group[-1] = 0, 2 * m
        return group
    raise AssertionError(kind)


@st.composite
def grouped_arrays(
    draw: st.DrawFn,
    dtype_name: str,
    last: int,
    group_size: int,
    lead_shape: tuple[int, ...],
    kinds: tuple[str, ...] = GROUP_KINDS,
) -> np.ndarray:
    """An array of shape lead_shape + (last,) in `dtype_name`, one kind per group."""
    dtype = FLOAT_DTYPES[dtype_name]
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_groups = int(np.prod(lead_shape, dtype=np.int64)) * (last // group_size)
    weights = draw(st.sampled_from(["mostly_normal", "mixed", "edges"]))
    if weights == "mostly_normal":
        chosen = [kinds[0] if rng.random() < 0.8 else rng.choice(kinds) for _ in range(n_groups)]
    elif weights == "mixed":
        chosen = list(rng.choice(kinds, n_groups))
    else:
        edges = [k for k in kinds if k not in ("normal", "wide")] or list(kinds)
        chosen = list(rng.choice(edges, n_groups))
    flat = np.concatenate([edge_group(str(k), group_size, dtype, rng) for k in chosen])
    return flat.reshape(*lead_shape, last).astype(dtype)


lead_shapes = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(tuple)


#: Group kinds for the TurboQuant codec: "large" is left out because its magnitudes
#: (up to 1e29) need scales beyond float16, which TQ-3 rejects; explicit tests cover it.
TURBOQUANT_KINDS = tuple(kind for kind in GROUP_KINDS if kind != "large")


@st.composite
def kv_pairs(
    draw: st.DrawFn, head_dims: tuple[int, ...], group_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values [B, H, L, D] of one dtype and head_dim, drawn group by group."""
    dtype_name = draw(dtype_names)
    head_dim = draw(st.sampled_from(head_dims))
    lead = draw(st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 4)))
    keys = draw(grouped_arrays(dtype_name, head_dim, group_size, lead, TURBOQUANT_KINDS))
    values = draw(grouped_arrays(dtype_name, head_dim, group_size, lead, TURBOQUANT_KINDS))
    return keys, values
