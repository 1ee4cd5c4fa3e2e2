"""Crafted TurboQuant value inputs for the golden vectors: rows whose stored bits depend on
the rms summation order (TQ-7), and rows that use every centroid of a codebook (TQ-2).

Both are built in the rotated domain and carried back with `unrotate`. At head_dim 64 the
scale 1/8 is a power of two, so a row of integer multiples of a power of two whose
absolute sum stays below 2^24 multiples rotates and unrotates exactly: the vector's
value is then precisely the crafted row.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvspec.reference import turboquant

HEAD_DIM = 64
GRID = np.float32(2.0**-16)  # crafted rows are integer multiples of GRID

SumOrder = Callable[[np.ndarray], np.ndarray]


def _sequential(y: np.ndarray) -> np.ndarray:
    squares = y * y
    total = squares[..., 0]
    for i in range(1, squares.shape[-1]):
        total = total + squares[..., i]
    return total


def _float64(y: np.ndarray) -> np.ndarray:
    wide = y.astype(np.float64)
    return np.sum(wide * wide, axis=-1).astype(np.float32)


def _library(y: np.ndarray) -> np.ndarray:
    return np.sum(y * y, axis=-1, dtype=np.float32)


def _fused_first_level(y: np.ndarray) -> np.ndarray:
    """The tree, but its first level adds y[i] * y[i] to f32(y[i+16]^2) with one rounding,
    as an FMA does (emulated in float64, where the 48-bit product is exact)."""
    low = y[..., :16].astype(np.float64)
    high_squares = (y[..., 16:] * y[..., 16:]).astype(np.float64)
    partial = (low * low + high_squares).astype(np.float32)
    for w in turboquant.TREE_WIDTHS[1:]:
        partial = partial[..., :w] + partial[..., w : 2 * w]
    return partial[..., 0]


#: Sums of a 32-group's squares in orders that are not TQ-7's halving tree; each name is a
#: flag suffix in the vectors ("RmsOrder" tests hold one row against each).
WRONG_SUM_ORDERS: dict[str, SumOrder] = {
    "sequential": _sequential,
    "float64": _float64,
    "library": _library,
    "fused": _fused_first_level,
}


def halving_tree(y: np.ndarray) -> np.ndarray:
    """TQ-7's sum of a 32-group's squares: the order every wrong order is measured by."""
    with np.errstate(over="ignore"):  # an infinite rms is rejected where it is stored
        partial = y * y
    for w in turboquant.TREE_WIDTHS:
        partial = partial[..., :w] + partial[..., w : 2 * w]
    return partial[..., 0]


def _stored(y_groups: np.ndarray, total: np.ndarray, bits: int) -> np.ndarray:
    """Indices and float16 rms bits of groups [n, 32] given their sums of squares."""
    rms = np.sqrt(total / np.float32(turboquant.BLOCK_SIZE))
    u = y_groups / (rms + turboquant.EPS)[:, None]
    indices = np.count_nonzero(turboquant.boundaries(bits) < u[..., None], axis=-1)
    return np.concatenate([indices, rms.astype(np.float16).view(np.uint16)[:, None]], axis=1)


def _rms_order_group(order: SumOrder, bits: int, rng: np.random.Generator) -> np.ndarray:
    """32 integers k such that k * GRID stores other bits under `order` than under the tree.

    Random integer groups, one element moved onto a codebook boundary, then every nearby
    integer for that element tried at once; on average a few dozen draws."""
    usable = turboquant.boundaries(bits)[np.abs(turboquant.boundaries(bits)) < 2.0]
    shifts = np.arange(-256, 257)
    while True:
        k = np.rint(rng.standard_normal(32) / GRID).astype(np.int64)
        i = int(rng.integers(32))
        boundary = float(rng.choice(usable))
        for _ in range(4):  # moving k[i] moves the rms: settle k[i] = boundary * rms
            y = k.astype(np.float32) * GRID
            rms = np.sqrt(halving_tree(y) / np.float32(32))
            k[i] = round(boundary * float(rms) / float(GRID))
        candidates = np.repeat(k[None], shifts.size, axis=0)
        candidates[:, i] += shifts
        y = candidates.astype(np.float32) * GRID
        differs = np.any(_stored(y, halving_tree(y), bits) != _stored(y, order(y), bits), axis=1)
        if differs.any():
            return candidates[int(np.argmax(differs))]


def _exact_values(rotated: np.ndarray) -> np.ndarray:
    """Values whose rotation is exactly `rotated` (rows of GRID multiples, see above)."""
    values = turboquant.unrotate(rotated)
    assert np.array_equal(turboquant.rotate(values), rotated), "crafted row did not round-trip"
    return values


def rms_order_values(bits: int, rng: np.random.Generator) -> np.ndarray:
    """float32 values [len(WRONG_SUM_ORDERS), 64]: row j's first 32-group stores other bits
    when its squares are summed by the j-th wrong order instead of the tree (TQ-7)."""
    rows = []
    for order in WRONG_SUM_ORDERS.values():
        crafted = _rms_order_group(order, bits, rng)
        rest = rng.integers(-1024, 1025, HEAD_DIM - 32)  # keeps the row's sum below 2^24
        rows.append(np.concatenate([crafted, rest]).astype(np.float32) * GRID)
    return _exact_values(np.stack(rows))


def _unit_rms_groups(targets: np.ndarray) -> list[np.ndarray]:
    """Groups of 32 holding every target once, padded so that each group's rms is 1: the
    coded u of a target is then the target itself."""
    by_size = list(targets[np.argsort(-np.abs(targets), kind="stable")])
    interleaved = [by_size.pop(0) if j % 2 == 0 else by_size.pop() for j in range(len(by_size))]
    groups, current = [], []
    for target in [*interleaved, None]:
        full = target is None or len(current) == 28 or sum(t * t for t in current) + target**2 > 28
        if full and current:
            energy = sum(t * t for t in current)
            filler = np.sqrt((32 - energy) / (32 - len(current)))
            groups.append(np.array([*current, *[filler] * (32 - len(current))]))
            current = []
        if target is not None:
            current.append(float(target))
    return [np.array(g, np.float32) for g in groups]


def all_centroid_values(bits: int) -> np.ndarray:
    """float32 values [rows, 64] whose codes at `bits` use every centroid (TQ-2)."""
    groups = _unit_rms_groups(turboquant.centroids(bits))
    if len(groups) % 2:
        groups.append(groups[0])
    rotated = np.stack(groups).reshape(-1, HEAD_DIM)
    values = turboquant.unrotate(rotated)
    indices, _ = turboquant.encode_values(values, bits)
    assert np.unique(indices).size == 2**bits, f"not every {bits}-bit centroid is coded"
    return values
