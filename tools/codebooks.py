"""Gaussian Lloyd-Max codebooks for TurboQuant values (spec TQ-2).

Computes, for each supported width, the centroids of the mean-squared-error optimal
scalar quantizer of N(0, 1) with 2^bits levels, rounds them to float32, and prints
them; `--check` exits 1 when they differ from the tables frozen in
kvspec.reference.turboquant_tables, and `--emit` prints those tables as Python.

The density is symmetric, so only the positive half is computed: levels p[0] < ...
< p[m-1], m = 2^(bits-1), with cell edges 0, (p[i] + p[i+1]) / 2, +inf. Lloyd's
iteration (each level moves to the mean of N(0, 1) over its cell, in closed form
through norm.pdf and norm.sf) is run as a warm start; its fixed point is then
solved to double precision with scipy's root finder, since at 8 bits the plain
iteration contracts too slowly to settle in reasonable time. The Gaussian is
log-concave, so that fixed point is the unique Lloyd-Max quantizer.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
from scipy import integrate, optimize
from scipy.stats import norm

from kvspec.reference import turboquant as frozen

WARM_START_ITERATIONS = 200
# A level is accepted once it moves less than this under one more Lloyd step.
FIXED_POINT_TOLERANCE = 1e-13


def lloyd_step(levels: np.ndarray) -> np.ndarray:
    """Each positive level moved to the conditional mean of N(0, 1) over its cell."""
    edges = np.concatenate([[0.0], (levels[:-1] + levels[1:]) / 2, [np.inf]])
    mass = norm.sf(edges[:-1]) - norm.sf(edges[1:])  # sf keeps the far tail exact
    return (norm.pdf(edges[:-1]) - norm.pdf(edges[1:])) / mass


def positive_levels(bits: int) -> np.ndarray:
    """The positive half of the Lloyd-Max centroids of N(0, 1), float64."""
    m = 2 ** (bits - 1)
    levels = norm.ppf(0.5 + (np.arange(m) + 0.5) / (2 * m))
    for _ in range(WARM_START_ITERATIONS):
        levels = lloyd_step(levels)
    solved = optimize.root(lambda p: p - lloyd_step(p), levels, method="hybr", tol=1e-15)
    levels = solved.x
    residual = float(np.max(np.abs(lloyd_step(levels) - levels)))
    if residual > FIXED_POINT_TOLERANCE:
        raise RuntimeError(f"{bits}-bit Lloyd-Max did not converge (residual {residual:.1e})")
    return levels


def float32_margin(levels: np.ndarray) -> float:
    """Smallest distance, relative to the float32 spacing, from a level to a point where
    its float32 rounding would change; a margin far above the solver's residual means
    the frozen bits do not depend on the last digits of the computation."""
    rounded = levels.astype(np.float32)
    spacing = np.spacing(rounded).astype(np.float64)
    offset = np.abs(levels - rounded.astype(np.float64))
    return float(np.min((spacing / 2 - offset) / spacing))


def centroids(bits: int) -> np.ndarray:
    """All 2^bits centroids as float32, ascending: the negated positive half, then it."""
    positive = positive_levels(bits).astype(np.float32)
    return np.concatenate([-positive[::-1], positive])


def distortion(levels: np.ndarray) -> float:
    """Mean squared error of the quantizer on N(0, 1), by numerical integration."""
    edges = np.concatenate([[0.0], (levels[:-1] + levels[1:]) / 2, [np.inf]])
    total = 0.0
    for low, high, level in zip(edges[:-1], edges[1:], levels, strict=True):
        cell, _ = integrate.quad(lambda x, c=level: (x - c) ** 2 * norm.pdf(x), low, high)
        total += cell
    return 2 * total


def emit(tables: dict[int, np.ndarray]) -> str:
    """The positive halves as the Python literal kept in turboquant_tables.py."""
    lines = ["POSITIVE_CENTROID_BITS: dict[int, tuple[int, ...]] = {"]
    for bits, table in tables.items():
        lines.append(f"    {bits}: (")
        for value in table[len(table) // 2 :]:
            pattern = int(np.float32(value).view(np.uint32))
            lines.append(f"        0x{pattern:08X},  # {float(value):.9g}")
        lines.append("    ),")
    lines.append("}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the frozen tables differ")
    parser.add_argument("--emit", action="store_true", help="print the tables as Python")
    parser.add_argument(
        "--bits", type=int, nargs="+", choices=frozen.VALUE_BITS, default=list(frozen.VALUE_BITS)
    )
    args = parser.parse_args(argv)
    tables = {bits: centroids(bits) for bits in args.bits}
    if args.emit:
        print(emit(tables))
        return 0
    differ = 0
    for bits, table in tables.items():
        levels = positive_levels(bits)
        print(
            f"{frozen.codebook_id(bits)}: {bits} bits, MSE {distortion(levels):.6g}, "
            f"float32 margin {float32_margin(levels):.3g} ulp"
        )
        stored = frozen.centroids(bits)
        for index, value in enumerate(table):
            pattern = int(value.view(np.uint32))
            mark = ""
            if stored[index].view(np.uint32) != value.view(np.uint32):
                differ += 1
                mark = f"  != frozen {float(stored[index]):.9g}"
            print(f"  {index:3d}  0x{pattern:08X}  {float(value):+.9f}{mark}")
    if args.check and differ:
        print(f"{differ} centroids differ from the frozen tables", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
