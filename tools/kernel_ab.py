"""Decode reads under other kernel sources: the CUDA files of each directory taking turns on
the same caches, each read's attention timed per layer (LAYERS layers per evaluation), and
the time each adds from one context to the next (its stored bytes' rate). With --step, the
compiled decode step instead (spec COMPILE-6, which the slot variants of the kernels serve):
each source's own caches, filled alike, its layers independent or chained (each layer's
query the output of the one before, as a model runs them).

A kernel change is timed so before it lands (docs/performance.md): its sources and main's
side by side in one process, on the same caches and the same machine's moment, which two
bench runs minutes apart are not. Outputs are compared too: the largest difference from the
first source's (0 where a change keeps every operation). A source named twice (main's files
under a second name) shows how far the turns alone move a row: a change that moves its rows
less than that has not been measured.

    python tools/kernel_ab.py main=/path/to/main/accelerated/cuda new=accelerated/cuda
    python tools/kernel_ab.py main=DIR new=DIR --contexts 4096 131072 --kinds Quantized
    python tools/kernel_ab.py main=DIR new=DIR --step chained --contexts 4096 32768
    python tools/kernel_ab.py main=DIR new=DIR main2=DIR   # main twice: the turns' spread
    python tools/kernel_ab.py a=accelerated/cuda b=accelerated/cuda --quick   # CPU smoke run

Only the decode-attention kernels' file (`decode_attention.cuh`) matters to the reads timed
(the steps' encode kernels too); each directory must hold all the CUDA files the kernels
include. A step's graph is traced under its source's files once and replayed: every turn's
step must stay within one window step (WINDOW_STEP positions), or a new graph would be
traced under whichever files came last (the run stops with an error if one was).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
from bench import (
    AB_KINDS,
    KINDS,
    Row,
    add_kinds_option,
    at_least_one,
    compiled_step,
    median,
    picked_kinds,
    print_rates,
    rate_rows,
    read_bandwidth,
    samples,
)

from kvspec.accelerated import (
    affine_kernels,
    attention_kernels,
    cuda_source,
    turboquant_kernels,
)
from kvspec.accelerated.caches.compiled import WINDOW_STEP

#: Each kernel module and the file its header includes.
KERNEL_MODULES = (
    (attention_kernels, "decode_attention.cuh"),
    (affine_kernels, "affine.cuh"),
    (turboquant_kernels, "turboquant.cuh"),
)


def use_sources(directory: Path) -> None:
    """Build kernels from the CUDA files of `directory` from now on: the headers that
    include them and every kernel object made so far are dropped (MLX keeps each build,
    keyed by its source, so going back costs no compile)."""
    cuda_source.CUDA_DIR = directory
    cuda_source.included.cache_clear()
    for module, name in KERNEL_MODULES:
        module._INCLUDE = cuda_source.included(name)
        for made in module.KERNEL_CACHES:
            made.cache_clear()


def source(text: str) -> tuple[str, Path]:
    """'NAME=DIR', DIR holding every CUDA file the kernels include."""
    name, sep, directory = text.partition("=")
    if not sep or not name or not directory:
        raise argparse.ArgumentTypeError(f"a source is NAME=DIR, got {text!r}")
    path = Path(directory).resolve()
    missing = [file for _, file in KERNEL_MODULES if not (path / file).is_file()]
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
    layer_caches = [KINDS[kind](context + 8) for _ in range(layers)]
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


#: What --step times: the read's attention alone, or the compiled step's layers independent
#: or chained.
STEPS = ("read", "compiled", "chained")
#: A step A/B's calls besides its turns: the trace, two warm-up calls and the outputs' call.
#: All of them must stay within one window step (COMPILE-3) so that no graph is traced again.
STEP_CALLS = 4


def step_rows(
    kind: str,
    context: int,
    sources: Sequence[tuple[str, Path]],
    layers: int,
    turns: int,
    chain: bool,
) -> list[dict]:
    """One kind at one context: each source's compiled step (traced under its files, on
    caches of its own filled alike), per layer, median and fastest of `turns` with the
    sources taking turns, and its outputs' largest difference from the first source's after
    as many steps."""
    calls = turns + STEP_CALLS
    k = mx.random.normal((1, 8, context, 128)).astype(mx.bfloat16)
    new = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    steps = []
    per_token = 0
    for _, directory in sources:
        layer_caches = [KINDS[kind](context + calls) for _ in range(layers)]
        for cache in layer_caches:
            cache.append_window(k, k)
        per_token = layer_caches[0].bytes_per_token()
        step = compiled_step(layer_caches, new, new, q, chain=chain)
        use_sources(directory)
        mx.eval(step())  # traced under this source's files
        steps.append(step)
    measured = samples(steps, turns)
    outputs = [mx.concatenate(step(), axis=0).astype(mx.float32) for step in steps]
    if any(len(step.func.graphs) != 1 for step in steps):
        raise RuntimeError("a step traced a second graph (under another source's files)")
    return [
        {
            "kind": kind,
            "context": context,
            "source": name,
            "us": median(sample.times) / layers * 1e6,
            "fastest_us": min(sample.times) / layers * 1e6,
            "max_diff": mx.abs(output - outputs[0]).max().item(),
            "bytes_per_token": per_token,
        }
        for (name, _), sample, output in zip(sources, measured, outputs, strict=True)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sources", type=source, nargs="+", metavar="NAME=DIR")
    parser.add_argument("--contexts", type=at_least_one, nargs="+", default=[32768, 131072])
    add_kinds_option(parser, AB_KINDS)
    parser.add_argument(
        "--step",
        choices=STEPS,
        default="read",
        help="read: the read's attention alone (default); compiled: the compiled decode "
        "step, layers independent; chained: the compiled step, each layer's query the "
        "output of the one before",
    )
    parser.add_argument("--layers", type=at_least_one, default=32)
    parser.add_argument("--turns", type=at_least_one, default=9)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    args = parser.parse_args(argv)
    if len({name for name, _ in args.sources}) != len(args.sources):
        parser.error("each source needs a name of its own")
    kinds = picked_kinds(parser, args.kinds, AB_KINDS)
    if args.quick:
        args.contexts, args.layers, args.turns = [64, 96], 2, 2
    if args.step != "read" and (
        any(context % WINDOW_STEP for context in args.contexts)
        or args.turns + STEP_CALLS > WINDOW_STEP
    ):
        parser.error(
            f"--step {args.step} takes contexts that are multiples of {WINDOW_STEP} and at "
            f"most {WINDOW_STEP - STEP_CALLS} turns (a step's graph is traced once)"
        )
    print(f"device: {mx.default_device()}  mlx {mx.__version__}  layers {args.layers}")
    if args.step == "read":
        bandwidth = read_bandwidth(4 if args.quick else 1024, args.turns)
    print(
        f"{args.step}: µs per layer, median (fastest) of the turns; diff: largest |output - "
        "first source's|"
    )
    original = cuda_source.CUDA_DIR
    rows: list[dict] = []
    try:
        for context in args.contexts:
            for kind in kinds:
                if args.step == "read":
                    measured = kind_rows(kind, context, args.sources, args.layers, args.turns)
                else:
                    chain = args.step == "chained"
                    measured = step_rows(
                        kind, context, args.sources, args.layers, args.turns, chain
                    )
                for row in measured:
                    fastest = f" ({row['fastest_us']:.1f})" if "fastest_us" in row else ""
                    print(
                        f"{row['context']:7d}  {row['kind']:30s}  {row['source']:12s}  "
                        f"{row['us']:9.1f}{fastest} µs  diff {row['max_diff']:.2e}"
                    )
                    rows.append(row)
    finally:
        use_sources(original)
    report = {"device": str(mx.default_device()), "step": args.step, "rows": rows}
    if args.step == "read":
        # bench's rate table, a read for each kind and source.
        reads = [
            Row(
                "attend",
                f"{row['kind']} ({row['source']})",
                row["context"],
                row["us"],
                1.0,
                row["bytes_per_token"],
            )
            for row in rows
        ]
        rates = rate_rows(reads, bandwidth)
        if rates:
            print_rates(rates, bandwidth)
        report |= {"bandwidth": bandwidth, "rates": [asdict(rate) for rate in rates]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
