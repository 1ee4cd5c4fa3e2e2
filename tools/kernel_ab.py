"""Decode reads under other kernel sources: the CUDA files of each directory taking turns on
the same caches, each read's attention timed per layer (LAYERS layers per evaluation), and
the time each adds from the first context to the last (its stored bytes' rate).

A kernel change is timed so before it lands (docs/performance.md): its sources and main's
side by side in one process, on the same caches and the same machine's moment, which two
bench runs minutes apart are not. Outputs are compared too: the largest difference from the
first source's (0 where a change keeps every operation).

    python tools/kernel_ab.py main=/path/to/main/accelerated/cuda new=accelerated/cuda
    python tools/kernel_ab.py main=DIR new=DIR --contexts 4096 131072 --kinds Quantized
    python tools/kernel_ab.py a=accelerated/cuda b=accelerated/cuda --quick   # CPU smoke run

Only the decode-attention kernels' file (`decode_attention.cuh`) matters to the reads timed;
each directory must hold all the CUDA files the kernels include.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import mlx.core as mx
from bench import median, samples

from kvspec.accelerated import (
    affine_kernels,
    attention_kernels,
    caches,
    cuda_source,
    turboquant_kernels,
)

#: The kinds read, by name: a growable cache of each stored format the step table times.
KINDS: dict[str, Callable[[], caches.Cache]] = {
    "TurboQuantKVCache k8v4 dense": lambda: caches.TurboQuantKVCache(
        8, 4, "dense", checks="deferred"
    ),
    "QuantizedKVCache 4-bit g64": lambda: caches.QuantizedKVCache(64, 4, checks="deferred"),
    "KVCache": caches.KVCache,
}
#: Each kernel module, the file its header includes, and its caches of kernel objects.
KERNEL_MODULES = (
    (
        attention_kernels,
        "decode_attention.cuh",
        (
            attention_kernels._partial_kernel,
            attention_kernels._merge_kernel,
            attention_kernels._launch,
        ),
    ),
    (
        affine_kernels,
        "affine.cuh",
        (affine_kernels._kernel, affine_kernels._pair_kernel, affine_kernels._record_kernel),
    ),
    (
        turboquant_kernels,
        "turboquant.cuh",
        (turboquant_kernels._kernel, turboquant_kernels._encode_kernel),
    ),
)


def use_sources(directory: Path) -> None:
    """Build kernels from the CUDA files of `directory` from now on: the headers that
    include them and every kernel object made so far are dropped (MLX keeps each build,
    keyed by its source, so going back costs no compile)."""
    cuda_source.CUDA_DIR = directory
    cuda_source.included.cache_clear()
    for module, name, factories in KERNEL_MODULES:
        module._INCLUDE = cuda_source.included(name)
        for factory in factories:
            factory.cache_clear()


def source(text: str) -> tuple[str, Path]:
    """'NAME=DIR', DIR holding every CUDA file the kernels include."""
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"a source is NAME=DIR, got {text!r}")
    path = Path(directory).resolve()
    missing = [file for _, file, _ in KERNEL_MODULES if not (path / file).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"{path} lacks {', '.join(missing)}")
    return name, path


def kind_rows(
    kind: str,
    context: int,
    sources: Sequence[tuple[str, Path]],
    layers: int,
    turns: int,
) -> list[dict]:
    """One kind at one context: each source's read time per layer (median of `turns`, the
    sources taking turns) and its outputs' largest difference from the first source's."""
    k = mx.random.normal((1, 8, context, 128)).astype(mx.bfloat16)
    new = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    layer_caches = [KINDS[kind]() for _ in range(layers)]
    for cache in layer_caches:
        cache.append_window(k, k)
    reads = [cache.append_decode(new, new) for cache in layer_caches]
    mx.eval([cache.state().arrays for cache in layer_caches])
    times: dict[str, list[float]] = {name: [] for name, _ in sources}
    outputs: dict[str, mx.array] = {}
    for _ in range(turns):
        for name, directory in sources:
            use_sources(directory)
            (sample,) = samples([lambda: [read.attend(q, 128**-0.5) for read in reads]], 1, 1)
            times[name].append(sample.times[0] / layers * 1e6)
            outputs[name] = reads[0].attend(q, 128**-0.5).astype(mx.float32)
    first = outputs[sources[0][0]]
    return [
        {
            "kind": kind,
            "context": context,
            "source": name,
            "us": median(times[name]),
            "max_diff": mx.abs(outputs[name] - first).max().item(),
            "bytes_per_token": layer_caches[0].bytes_per_token(),
        }
        for name, _ in sources
    ]


def rate_rows(rows: list[dict]) -> list[dict]:
    """Per kind and source, the time a read adds from the first context to the last and
    the rate at which that streams its stored bytes."""
    rates = []
    for kind in dict.fromkeys(row["kind"] for row in rows):
        for name in dict.fromkeys(row["source"] for row in rows):
            chosen = [row for row in rows if row["kind"] == kind and row["source"] == name]
            first = min(chosen, key=lambda row: row["context"])
            last = max(chosen, key=lambda row: row["context"])
            added = last["us"] - first["us"]
            if last["context"] == first["context"] or added <= 0:
                continue
            streamed = last["bytes_per_token"] * (last["context"] - first["context"])
            rates.append(
                {
                    "kind": kind,
                    "source": name,
                    "added_us": added,
                    "positions": last["context"] - first["context"],
                    "rate": streamed / (added * 1e-6),
                }
            )
    return rates


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", type=source, nargs="+", metavar="NAME=DIR")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument(
        "--kinds", nargs="+", metavar="TEXT", help="kinds whose names hold a TEXT (or are it)"
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--turns", type=int, default=9)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    args = parser.parse_args(argv)
    if len({name for name, _ in args.sources}) != len(args.sources):
        parser.error("each source needs a name of its own")
    # A TEXT that is a whole name picks that kind, else every kind whose name holds it.
    kinds = [
        kind
        for kind in KINDS
        if not args.kinds
        or any(kind == text if text in KINDS else text in kind for text in args.kinds)
    ]
    if not kinds:
        parser.error(f"no kind matches {args.kinds}; kinds: {', '.join(KINDS)}")
    if args.quick:
        args.contexts, args.layers, args.turns = [64, 96], 2, 2
    print(f"device: {mx.default_device()}  mlx {mx.__version__}  layers {args.layers}")
    print("read: µs per layer, median of the turns; diff: largest |output - first source's|")
    original = cuda_source.CUDA_DIR
    rows: list[dict] = []
    try:
        for context in args.contexts:
            for kind in kinds:
                for row in kind_rows(kind, context, args.sources, args.layers, args.turns):
                    print(
                        f"{row['context']:7d}  {row['kind']:30s}  {row['source']:12s}  "
                        f"{row['us']:9.1f} µs  diff {row['max_diff']:.2e}"
                    )
                    rows.append(row)
    finally:
        use_sources(original)
    rates = rate_rows(rows)
    for rate in rates:
        print(
            f"rate  {rate['kind']:30s}  {rate['source']:12s}  {rate['added_us']:9.1f} µs more "
            f"over {rate['positions']} positions: {rate['rate'] / 1e12:.2f} TB/s"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": str(mx.default_device()), "rows": rows, "rates": rates}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
