"""TurboQuant rows for tools/compare.py: the reference and accelerated backends on one
workload, per (k_bits, v_bits, head_dim, dtype).

Each row counts the elements that differ in each stored field (zero is the only
passing answer), the relative MSE of the keys and values read back, and the bits
stored per value with the scales and zero points counted. Run alone it prints the
rows for a random Gaussian workload with outlier channels and exits 1 when any
stored field differs:

    python tools/compare_turboquant.py --head-dims 128 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from kvspec.accelerated import turboquant as accelerated
from kvspec.accelerated.dtypes import from_numpy, to_numpy
from kvspec.conformance.compare import mismatches
from kvspec.reference import turboquant as reference
from kvspec.reference.dtypes import FLOAT_DTYPES

FIELDS = ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales")
COLUMNS = (
    "k_bits",
    "v_bits",
    "head_dim",
    "dtype",
    *FIELDS,
    "key rel MSE",
    "value rel MSE",
    "bits/value",
)


def _relative_mse(read: np.ndarray, exact: np.ndarray) -> float:
    exact64 = exact.astype(np.float64)
    return float(np.sum((read.astype(np.float64) - exact64) ** 2) / np.sum(exact64**2))


def turboquant_rows(
    workload: dict[int, tuple[np.ndarray, np.ndarray]],
    k_bits_list: Sequence[int],
    v_bits_list: Sequence[int],
    dtype_names: Sequence[str],
) -> tuple[list[list[str]], bool]:
    """(rows, differs) for keys and values [B, H, L, D] given per head_dim (TQ-10).

    Rows follow COLUMNS; `differs` is set when any stored field differs.
    """
    rows: list[list[str]] = []
    differs = False
    for head_dim, (keys, values) in workload.items():
        for dtype_name in dtype_names:
            k = keys.astype(FLOAT_DTYPES[dtype_name])
            v = values.astype(FLOAT_DTYPES[dtype_name])
            for k_bits in k_bits_list:
                for v_bits in v_bits_list:
                    expected = reference.encode(k, v, k_bits, v_bits)
                    stored = accelerated.encode(from_numpy(k), from_numpy(v), k_bits, v_bits)
                    counts = [
                        mismatches(to_numpy(getattr(stored, f)), getattr(expected, f))
                        for f in FIELDS
                    ]
                    differs |= any(counts)
                    read_k, read_v = accelerated.decode(stored, k.shape[2], head_dim)
                    stored_bits = 8 * sum(getattr(expected, f).nbytes for f in FIELDS)
                    rows.append(
                        [str(k_bits), str(v_bits), str(head_dim), dtype_name]
                        + [str(c) for c in counts]
                        + [f"{_relative_mse(to_numpy(read_k), k):.4g}"]
                        + [f"{_relative_mse(to_numpy(read_v), v):.4g}"]
                        + [f"{stored_bits / (k.size + v.size):.3f}"]
                    )
    return rows, differs


def default_workload(
    seed: int, head_dims: Sequence[int]
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Gaussian keys and values [1, 4, 64, D] with four outlier channels 20x larger."""
    rng = np.random.default_rng(seed)
    workload = {}
    for head_dim in head_dims:
        keys = rng.standard_normal((1, 4, 64, head_dim)).astype(np.float32)
        values = rng.standard_normal((1, 4, 64, head_dim)).astype(np.float32)
        for array in (keys, values):
            array[..., rng.choice(head_dim, 4, replace=False)] *= 20.0
        workload[head_dim] = (keys, values)
    return workload


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--k-bits", type=int, nargs="+", default=list(reference.KEY_BITS))
    parser.add_argument("--v-bits", type=int, nargs="+", default=list(reference.VALUE_BITS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(reference.HEAD_DIMS))
    parser.add_argument(
        "--dtypes", nargs="+", choices=sorted(FLOAT_DTYPES), default=sorted(FLOAT_DTYPES)
    )
    args = parser.parse_args(argv)
    workload = default_workload(args.seed, args.head_dims)
    rows, differs = turboquant_rows(workload, args.k_bits, args.v_bits, args.dtypes)
    print(f"device: {mx.default_device()}  mlx {mx.__version__}")
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for row in rows:
        print("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    print("stored fields differ" if differs else "no stored field differs")
    return 1 if differs else 0


if __name__ == "__main__":
    sys.exit(main())
