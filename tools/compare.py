"""Diff the reference and accelerated backends on a workload.

Runs every codec configuration on both backends and prints one table per codec:
per configuration, how many stored elements differ (zero is the only passing
answer), the largest read error, and the bits stored per value. Then a scripted
cache session per KV scheme and layer kind (prefill, decode, trim, decode), run
step by step on both backends: the first stored divergence (step, array, index,
both values) or none, the offset, bytes per token and the largest read error over
its bound. A summary table closes the report: per table, how many configurations
were compared and how many differ. Exit status: 0 when every stored field matches, 1
when any differs, 2 on bad usage (an unknown option or width, an unreadable input, a
malformed scheme).

    python tools/compare.py                       # the default random workload
    python tools/compare.py --seed 7 --json       # another workload, one JSON document
    python tools/compare.py --input kv.safetensors --bits 4 8
    python tools/compare.py --schemes turbo:k4v3 affine:4:64:start=16
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvspec.accelerated import affine as accelerated_affine
from kvspec.accelerated import caches as accelerated_caches
from kvspec.accelerated import turboquant as accelerated_turboquant
from kvspec.accelerated.dtypes import from_numpy, to_numpy
from kvspec.conformance.bounds import affine_read_bound, read_bound, read_error
from kvspec.conformance.cache_scenarios import TURBOQUANT_FIELDS, slot_names
from kvspec.conformance.compare import bit_view, mismatches
from kvspec.reference import affine as reference_affine
from kvspec.reference import caches as reference_caches
from kvspec.reference import turboquant as reference_turboquant
from kvspec.reference.dtypes import BFLOAT16, FLOAT_DTYPES


@dataclass
class Table:
    """Rows of one codec's comparison; `differs` is set when any stored field differs."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    differs: bool = False
    differing_rows: int = 0

    def add(self, row: list[str], differs: bool) -> None:
        """One configuration's row; `differs` when one of its stored fields differs."""
        self.rows.append(row)
        self.differing_rows += differs
        self.differs |= differs

    def as_json(self) -> dict:
        return {
            "title": self.title,
            "differs": self.differs,
            "rows": [dict(zip(self.columns, row, strict=True)) for row in self.rows],
        }

    def render(self) -> str:
        if not self.rows:
            return f"{self.title}\n  (no array of this workload fits this codec)"
        widths = [
            max(len(column), *(len(row[i]) for row in self.rows))
            for i, column in enumerate(self.columns)
        ]
        lines = [
            self.title,
            "  ".join(c.rjust(w) for c, w in zip(self.columns, widths, strict=True)),
        ]
        lines += [
            "  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)) for row in self.rows
        ]
        return "\n".join(lines)


def default_workload(seed: int) -> dict[str, np.ndarray]:
    """KV-like arrays [B, H, L, D]: Gaussian with outlier channels, plus rows of the
    edge groups the spec names (constant, zero, no positive value, tiny)."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((1, 8, 256, 128)).astype(np.float32)
    keys[..., rng.choice(128, 4, replace=False)] *= 20.0
    edges = np.zeros((1, 1, 4, 128), np.float32)
    edges[0, 0, 1] = 0.75
    edges[0, 0, 2] = -np.abs(rng.standard_normal(128))
    edges[0, 0, 3] = rng.standard_normal(128) * 1e-9
    values = np.concatenate([rng.standard_normal((1, 1, 252, 128)).astype(np.float32), edges], 2)
    return {"keys": keys, "values": values}


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """Arrays from a .npy or .safetensors file, as NumPy arrays holding the same bits."""
    if path.suffix == ".npy":
        return {path.stem: np.load(path)}
    if path.suffix == ".safetensors":
        return {name: to_numpy(array) for name, array in mx.load(str(path)).items()}
    raise ValueError(f"{path}: expected a .npy or .safetensors file")


def affine_table(
    arrays: dict[str, np.ndarray],
    bits_list: Sequence[int],
    group_sizes: Sequence[int],
    dtype_names: Sequence[str],
) -> Table:
    """Stored-field mismatches and read error of the affine codec (AFF-5, AFF-6)."""
    table = Table(
        "affine (AFF): reference vs accelerated",
        [
            "array",
            "bits",
            "group",
            "dtype",
            "words",
            "scales",
            "biases",
            "max read err",
            "err/bound",
            "bits/value",
        ],
    )
    for name, array in arrays.items():
        rows = array.reshape(-1, array.shape[-1]) if array.ndim < 2 else array
        for dtype_name in dtype_names:
            w = rows.astype(np.float32).astype(FLOAT_DTYPES[dtype_name])
            for bits in bits_list:
                for group_size in group_sizes:
                    if w.shape[-1] % group_size:
                        continue
                    expected = reference_affine.quantize(w, group_size, bits)
                    stored = accelerated_affine.quantize(from_numpy(w), group_size, bits)
                    actual = [to_numpy(a) for a in stored]
                    counts = [mismatches(a, e) for a, e in zip(actual, expected, strict=True)]
                    read = to_numpy(accelerated_affine.dequantize(*stored, group_size, bits))
                    error = np.abs(read.astype(np.float64) - w.astype(np.float64))
                    bound = affine_read_bound(w, expected[1], bits, group_size)
                    stored_bits = 8 * sum(e.nbytes for e in expected) / w.size
                    table.add(
                        [name, str(bits), str(group_size), dtype_name]
                        + [str(c) for c in counts]
                        + [f"{error.max():.3g}", f"{np.max(error / bound):.3f}"]
                        + [f"{stored_bits:.3f}"],
                        any(counts),
                    )
    return table


def _relative_mse(read: np.ndarray, exact: np.ndarray) -> float:
    exact64 = exact.astype(np.float64)
    return float(np.sum((read.astype(np.float64) - exact64) ** 2) / np.sum(exact64**2))


def turboquant_pairs(arrays: dict[str, np.ndarray]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(keys, values) [B, H, L, D] to encode: a file's "keys" and "values" as one pair,
    and any other 4-D array with a supported head_dim (a "keys" without "values" too) as
    both (TQ-1)."""
    pairs = {}
    paired = "keys" in arrays and "values" in arrays
    if paired:
        pairs["keys/values"] = (arrays["keys"], arrays["values"])
    for name, array in arrays.items():
        if paired and name in ("keys", "values"):
            continue
        if array.ndim == 4 and array.shape[-1] in reference_turboquant.HEAD_DIMS:
            pairs[name] = (array, array)
    return pairs


def turboquant_workload(
    seed: int, head_dims: Sequence[int]
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Gaussian keys and values [1, 4, 64, D] per head_dim, four outlier channels 20x."""
    rng = np.random.default_rng(seed)
    pairs = {}
    for head_dim in head_dims:
        pair = []
        for _ in ("keys", "values"):
            array = rng.standard_normal((1, 4, 64, head_dim)).astype(np.float32)
            array[..., rng.choice(head_dim, 4, replace=False)] *= 20.0
            pair.append(array)
        pairs[f"random D={head_dim}"] = (pair[0], pair[1])
    return pairs


def turboquant_table(
    pairs: dict[str, tuple[np.ndarray, np.ndarray]],
    k_bits_list: Sequence[int],
    v_bits_list: Sequence[int],
    dtype_names: Sequence[str],
) -> Table:
    """Stored-field mismatches, read error and size of TurboQuant (TQ-10, TQ-11)."""
    table = Table(
        "turboquant (TQ): reference vs accelerated",
        [
            *("pair", "k_bits", "v_bits", "head_dim", "dtype"),
            *TURBOQUANT_FIELDS,
            *("key rel MSE", "value rel MSE", "bits/value"),
        ],
    )
    for name, (keys, values) in pairs.items():
        head_dim = keys.shape[-1]
        for dtype_name in dtype_names:
            k = keys.astype(np.float32).astype(FLOAT_DTYPES[dtype_name])
            v = values.astype(np.float32).astype(FLOAT_DTYPES[dtype_name])
            for k_bits in k_bits_list:
                for v_bits in v_bits_list:
                    expected = reference_turboquant.encode(k, v, k_bits, v_bits)
                    stored = accelerated_turboquant.encode(
                        from_numpy(k), from_numpy(v), k_bits, v_bits
                    )
                    counts = [
                        mismatches(to_numpy(getattr(stored, f)), getattr(expected, f))
                        for f in TURBOQUANT_FIELDS
                    ]
                    read_k, read_v = accelerated_turboquant.decode(stored, k.shape[2], head_dim)
                    stored_bits = 8 * sum(getattr(expected, f).nbytes for f in TURBOQUANT_FIELDS)
                    table.add(
                        [name, str(k_bits), str(v_bits), str(head_dim), dtype_name]
                        + [str(c) for c in counts]
                        + [f"{_relative_mse(to_numpy(read_k), k):.4g}"]
                        + [f"{_relative_mse(to_numpy(read_v), v):.4g}"]
                        + [f"{stored_bits / (k.size + v.size):.3f}"],
                        any(counts),
                    )
    return table


DEFAULT_SCHEMES = (
    "bf16",
    "affine:4:64",
    "affine:8:32:start=40",
    "turbo:k8v4",
    "turbo:k8v4:deferred",
)

#: The scripted session: prefill 37 positions, 6 decodes, trim 3, 28 decodes. The start of
#: 40 above falls on a decode; the 64-position window wraps in the last decodes.
SESSION = (("window", 37), *(("decode", 1),) * 6, ("trim", 3), *(("decode", 1),) * 28)
SLIDING_WINDOW = 64


def state_divergence(expected: reference_caches.Cache, actual: accelerated_caches.Cache) -> str:
    """ "" when both caches hold the same state bit for bit (CACHE-8), else the first
    difference: signature, offset, ring index, or array, index and both values."""
    want, got = expected.state(), actual.state()
    for what in ("signature", "offset", "ring_index", "minimum_reusable_offset"):
        if getattr(got, what) != getattr(want, what):
            return f"{what} {getattr(want, what)} != {getattr(got, what)}"
    names = slot_names(want.signature)
    for name, e, a in zip(names, want.arrays, got.arrays, strict=True):
        a = to_numpy(a)
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"{name}: {e.dtype}{list(e.shape)} != {a.dtype}{list(a.shape)}"
        differ = np.argwhere(bit_view(a) != bit_view(e))
        if differ.size:
            index = tuple(int(i) for i in differ[0])
            return f"{name}{list(index)}: {e[index]!r} != {a[index]!r}"
    return ""


def cache_session_row(
    scheme_text: str, layer: str, session: Sequence[tuple[str, int]], seed: int
) -> tuple[list[str], bool]:
    """Run `session` on the reference and the MLX cache `scheme_text` names for a `layer`
    ("full" or "sliding") layer; the row and whether a stored field diverged."""
    scheme = reference_caches.parse_scheme(scheme_text)
    if layer == "full":
        ref = reference_caches.composed_full_attention_cache(scheme, 0)
        got = accelerated_caches.composed_full_attention_cache(scheme, 0)
    else:
        ref = reference_caches.composed_sliding_attention_cache(scheme, 0, SLIDING_WINDOW)
        got = accelerated_caches.composed_sliding_attention_cache(scheme, 0, SLIDING_WINDOW)
    rng = np.random.default_rng(seed)
    divergence, worst = "none", 0.0
    for step, (op, length) in enumerate(session):
        if op == "trim":
            ref.trim(length)
            got.trim(length)
        else:
            k, v, q = (
                rng.standard_normal((1, heads, length, 128)).astype(BFLOAT16) for heads in (2, 2, 4)
            )
            method = "append_window" if op == "window" else "append_decode"
            expected = getattr(ref, method)(k, v)
            actual = getattr(got, method)(from_numpy(k), from_numpy(v))
            scale = 128**-0.5
            want = expected.attend(q, scale).astype(np.float64)
            error = read_error(to_numpy(actual.attend(from_numpy(q), scale)), want, expected)
            worst = max(worst, float(np.max(error / read_bound(q, expected, scale))))
        difference = state_divergence(ref, got)
        if difference:
            divergence = f"step {step} ({op}): {difference}"
            break
    row = [scheme_text, layer, ref.signature(), str(ref.offset), str(ref.bytes_per_token())]
    return [*row, f"{worst:.3f}", divergence], divergence != "none"


def cache_table(schemes: Sequence[str], seed: int) -> Table:
    """The scripted session per scheme and layer kind on both backends (CACHE-8, READ-1,
    B16F-2, TQC-4); turbo has no sliding row (its sliding layers are plain, SCHEME-4)."""
    table = Table(
        "caches: scripted session, reference vs accelerated",
        [
            *("scheme", "layer", "signature", "offset", "bytes/token"),
            *("read err/bound", "first stored divergence"),
        ],
    )
    for scheme_text in schemes:
        turbo = isinstance(reference_caches.parse_scheme(scheme_text), reference_caches.TurboScheme)
        for layer in ("full",) if turbo else ("full", "sliding"):
            row, diverged = cache_session_row(scheme_text, layer, SESSION, seed)
            table.add(row, diverged)
    return table


def summary_table(tables: Sequence[Table]) -> Table:
    """One row per table: configurations compared, how many differ, the verdict."""
    summary = Table("summary", ["table", "configurations", "differing", "verdict"])
    for table in tables:
        verdict = "DIFFERS" if table.differs else "same bits"
        name = table.title.split(":")[0]
        summary.rows.append([name, str(len(table.rows)), str(table.differing_rows), verdict])
    return summary


def _scheme(text: str) -> str:
    """argparse type of --schemes: the text, once SCHEME-2 accepts it."""
    try:
        reference_caches.parse_scheme(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def _widths(option: str, choices: Sequence[int], help_text: str) -> dict:
    return {"type": int, "nargs": "+", "choices": choices, "default": list(choices)} | {
        "help": help_text,
        "metavar": option,
    }


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", type=Path, help=".npy or .safetensors file of arrays to encode")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the default workload and the cache sessions"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead")
    parser.add_argument(
        "--bits", **_widths("BITS", reference_affine.SUPPORTED_BITS, "affine widths (AFF-1)")
    )
    parser.add_argument(
        "--group-sizes",
        **_widths("GROUP", reference_affine.SUPPORTED_GROUP_SIZES, "affine group sizes (AFF-1)"),
    )
    parser.add_argument(
        "--k-bits", **_widths("K_BITS", reference_turboquant.KEY_BITS, "key widths (TQ-1)")
    )
    parser.add_argument(
        "--v-bits", **_widths("V_BITS", reference_turboquant.VALUE_BITS, "value widths (TQ-1)")
    )
    parser.add_argument(
        "--head-dims",
        **_widths(
            "D", reference_turboquant.HEAD_DIMS, "head dims of the default TurboQuant workload"
        ),
    )
    parser.add_argument(
        "--dtypes",
        nargs="+",
        choices=sorted(FLOAT_DTYPES),
        default=["float32", "float16", "bfloat16"],
    )
    parser.add_argument(
        "--schemes",
        nargs="+",
        type=_scheme,
        default=list(DEFAULT_SCHEMES),
        help="KV schemes of the cache session (SCHEME-2 strings)",
    )
    return parser, parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """0 when every stored field matches, 1 when one differs, 2 on bad usage."""
    try:
        parser, args = parse_args(argv)
    except SystemExit as exit_:  # argparse has printed the usage error
        return int(exit_.code or 0)
    try:
        arrays = load_arrays(args.input) if args.input else default_workload(args.seed)
    except (OSError, ValueError) as error:
        parser.print_usage(sys.stderr)
        print(f"compare.py: error: cannot read --input: {error}", file=sys.stderr)
        return 2
    if args.input:
        pairs = turboquant_pairs(arrays)
    else:
        pairs = turboquant_workload(args.seed, args.head_dims)
    tables = [
        affine_table(arrays, args.bits, args.group_sizes, args.dtypes),
        turboquant_table(pairs, args.k_bits, args.v_bits, args.dtypes),
        cache_table(args.schemes, args.seed),
    ]
    differs = [table.title for table in tables if table.differs]
    status = 1 if differs else 0
    summary = summary_table(tables)
    if args.json:
        document = {
            "device": str(mx.default_device()),
            "mlx": mx.__version__,
            "seed": args.seed,
            "input": str(args.input) if args.input else None,
            "tables": [table.as_json() for table in tables],
            "summary": summary.as_json()["rows"],
            "status": status,
        }
        print(json.dumps(document, indent=1))
        return status
    print(f"device: {mx.default_device()}  mlx {mx.__version__}  seed {args.seed}")
    for table in [*tables, summary]:
        print()
        print(table.render())
    print()
    print(
        "stored fields differ in: " + ", ".join(differs) if differs else "no stored field differs"
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
