"""Decode steps under two versions of kvspec in one process: this tree's package and another
revision's, its packages renamed (kvspec -> kvspec_NAME) so that both import side by side.
Each version's caches are filled alike; their steps (eager, compiled, or compiled with the
layers chained) take turns; the rows give each version's time per layer and the largest
difference of its outputs from this tree's.

A change of Python (host time, the ops and arrays a step hands MLX) is timed so before it
lands: kernel_ab.py swaps only the CUDA files, and two bench runs minutes apart are not the
same machine's moment. The other version is made here, where git is (`prepare`), and
carried to the GPU machine with the tree:

    python tools/tree_ab.py prepare main .device/trees      # .device/trees/kvspec_main
    python tools/tree_ab.py run .device/trees/kvspec_main --contexts 4096 32768 --kinds Turbo
    python tools/tree_ab.py run DIR --contexts 8192 --ring-window 4096 --kinds Rotating
    python tools/tree_ab.py run DIR --quick                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import subprocess
import sys
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import mlx.core as mx
from bench import (
    AB_KINDS,
    HEAD_DIM,
    KIND_FACTORIES,
    RING_KINDS,
    add_kinds_option,
    at_least_one,
    chained_layer,
    compiled_step,
    median,
    picked_kinds,
    samples,
    write_rows,
)

from kvspec.accelerated import caches as this_caches
from kvspec.accelerated.caches import compiled as this_compiled

#: The packages of a version, by their folders in the tree.
PACKAGES = ("reference", "accelerated", "conformance")
ROOT = Path(__file__).resolve().parent.parent
#: What `run` times: each layer's eager step, the compiled step, the compiled step with each
#: layer's query the output of the one before.
STEPS = ("eager", "compiled", "chained")


def prepare(revision: str, directory: Path) -> Path:
    """The packages of `revision` (git archive) in `directory`/kvspec_NAME, NAME the
    revision's name made an identifier, every `kvspec.` of their Python renamed."""
    name = "kvspec_" + re.sub(r"\W", "_", revision)
    target = directory / name
    if target.exists():
        raise FileExistsError(f"{target} exists: remove it or prepare into another folder")
    done = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", revision, *PACKAGES],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        raise ValueError(f"git archive {revision}: {done.stderr.decode().strip()}")
    archive = done.stdout
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(target, filter="data")
    for path in target.rglob("*.py"):
        path.write_text(re.sub(r"\bkvspec\.", f"{name}.", path.read_text()))
    (target / "__init__.py").write_text(f'"""kvspec at {revision}, renamed (tree_ab.py)."""\n')
    return target


def load(target: Path) -> tuple[str, ModuleType, ModuleType]:
    """A prepared version's name, caches module and compiled-step module."""
    sys.path.insert(0, str(target.resolve().parent))
    caches = importlib.import_module(f"{target.name}.accelerated.caches")
    compiled = importlib.import_module(f"{target.name}.accelerated.caches.compiled")
    return target.name, caches, compiled


def step_run(
    step: str,
    caches: ModuleType,
    compiled: ModuleType,
    kind: str,
    context: int,
    layers: int,
    inputs: tuple[mx.array, mx.array, mx.array],
    ring_window: int | None = None,
) -> Callable[[], list[mx.array]]:
    """One version's step over `layers` caches of `kind` filled with `inputs[0]` as keys and
    values, each step appending `inputs[1]` and attending with `inputs[2]`; a ring holds
    `ring_window` positions where given (it wraps once the context passes them), else room
    for every position."""
    prefill, new, queries = inputs
    room = ring_window if ring_window and kind in RING_KINDS else context + 64
    layer_caches = [KIND_FACTORIES[kind](caches, room) for _ in range(layers)]
    for cache in layer_caches:
        cache.append_window(prefill, prefill)
    mx.eval([cache.state().arrays for cache in layer_caches])
    if step == "eager":
        return lambda: [chained_layer(c, new, new)(queries) for c in layer_caches]
    chain = step == "chained"
    return compiled_step(layer_caches, new, new, queries, chain, compiled.compile_decode)


def rows(
    versions: Sequence[tuple[str, ModuleType, ModuleType]],
    step: str,
    kind: str,
    context: int,
    layers: int,
    turns: int,
    ring_window: int | None = None,
) -> list[dict]:
    """Each version's step at one context, taking turns: µs per layer (median and fastest)
    and the outputs' largest difference from the first version's after as many steps."""
    inputs = (
        mx.random.normal((1, 8, context, HEAD_DIM)).astype(mx.bfloat16),
        mx.random.normal((1, 8, 1, HEAD_DIM)).astype(mx.bfloat16),
        mx.random.normal((1, 32, 1, HEAD_DIM)).astype(mx.bfloat16),
    )
    runs = [
        step_run(step, caches, compiled, kind, context, layers, inputs, ring_window)
        for _, caches, compiled in versions
    ]
    measured = samples(runs, turns)
    outputs = [mx.concatenate(run(), axis=0).astype(mx.float32) for run in runs]
    return [
        {
            "step": step,
            "kind": kind,
            "context": context,
            "ring_window": ring_window if kind in RING_KINDS else None,
            "version": name,
            "us": median(sample.times) / layers * 1e6,
            "fastest_us": min(sample.times) / layers * 1e6,
            "host_us": median(sample.builds) / layers * 1e6,
            "max_diff": mx.abs(output - outputs[0]).max().item(),
        }
        for (name, _, _), sample, output in zip(versions, measured, outputs, strict=True)
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("prepare", help="write a revision's packages, renamed")
    make.add_argument("revision")
    make.add_argument("directory", type=Path)
    run = commands.add_parser("run", help="time this tree's steps beside a prepared version's")
    run.add_argument("other", type=Path, help="a folder `prepare` wrote (…/kvspec_NAME)")
    run.add_argument("--steps", nargs="+", choices=STEPS, default=list(STEPS))
    run.add_argument("--contexts", type=at_least_one, nargs="+", default=[4096, 32768])
    add_kinds_option(run, AB_KINDS)
    run.add_argument(
        "--ring-window",
        type=at_least_one,
        help="rings hold this many positions, and wrap once the context passes them "
        "(default: room for every position)",
    )
    run.add_argument("--layers", type=at_least_one, default=32)
    run.add_argument("--turns", type=at_least_one, default=21)
    run.add_argument("--json", help="write the rows to this file")
    run.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        try:
            print(prepare(args.revision, args.directory))
        except (ValueError, FileExistsError) as error:
            make.error(str(error))
        return 0
    if not (args.other / "accelerated" / "caches" / "compiled.py").is_file():
        parser.error(f"{args.other} is not a version `prepare` wrote")
    kinds = picked_kinds(run, args.kinds, AB_KINDS)
    if args.quick:
        args.contexts, args.layers, args.turns = [64], 2, 2
    versions = [("this", this_caches, this_compiled), load(args.other)]
    print(f"device: {mx.default_device()}  layers {args.layers}  turns {args.turns}")
    print("µs per layer, median (fastest) [host]; diff: largest |output - this tree's|")
    report = []
    for step in args.steps:
        for context in args.contexts:
            for kind in kinds:
                measured = rows(
                    versions, step, kind, context, args.layers, args.turns, args.ring_window
                )
                for row in measured:
                    print(
                        f"{row['step']:8}  {row['context']:7d}  {row['kind']:30s}  "
                        f"{row['version']:16s}  {row['us']:8.1f} ({row['fastest_us']:.1f}) "
                        f"[{row['host_us']:.1f}]  diff {row['max_diff']:.2e}"
                    )
                report += measured
    write_rows(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
