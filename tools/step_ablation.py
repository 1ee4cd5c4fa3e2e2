"""What each op of a decode step costs: the step taking turns, in one process, with itself
less some of its ops and with bare bf16 SDPA.

    python tools/step_ablation.py --contexts 4096 32768             # on the GPU machine
    python tools/step_ablation.py --steps eager compiled --kinds Turbo KVCache
    python tools/step_ablation.py --quick       # CPU: the CUDA path with stand-in kernels

An eager step hands MLX, per layer, the encode of the new position (coded kinds), its write
into the buffers (KVCache: one a side), the read's pass 1 and its merge. Each variant
(VARIANTS) leaves some of them out while its turn runs:

- "write": the one-position write is not built (`written_rows` hands back the buffers as
  they were). Its rows are evaluated with the outputs, so the encode still runs.
- "encode": with the write left out, its rows are not evaluated either: nothing reads the
  encode's output, so MLX never runs it (its building stays).
- "merge": the read returns pass 1's partial sums unmerged.

The compiled step's graph is traced under its variant's patches, so a compiled variant
leaves the merge out of the graph and the write out of the commits (the encode stays: the
graph hands its rows out, and the step evaluates them). A variant's outputs
and stored rows are wrong by design: the rows are diagnostics, never checked results.
Every variant has its own caches, filled alike (as tools/tree_ab.py fills them, with room
for 64 steps: no buffer grows during the default turns). Per kind and context, µs per
layer (median of the turns) of the whole evaluated call, and of building it on the host
in brackets. (Making and undoing a variant's patches costs its turn up to 9 µs on a CPU:
under 0.3 µs a layer of 32.)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import mlx.core as mx
from bench import (
    AB_KINDS,
    HEAD_DIM,
    QUERY_HEADS,
    add_turn_options,
    median,
    picked_kinds,
    random_kv,
    samples,
    sdpa,
    turn_shapes,
    write_rows,
)
from tree_ab import step_run

from kvspec.accelerated import attention_kernels, caches
from kvspec.accelerated.caches import compiled, reads, records

#: The variants, by name: the ops each leaves out of the step.
VARIANTS: dict[str, frozenset[str]] = {
    "step": frozenset(),
    "no write": frozenset({"write"}),
    "no write, encode": frozenset({"write", "encode"}),
    "no merge": frozenset({"merge"}),
    "pass 1 only": frozenset({"write", "encode", "merge"}),
}
#: The steps a run times (--steps): each layer's eager step, or the compiled step.
STEPS = ("eager", "compiled")


def _unmerged(inputs: list[mx.array], **_: object) -> list[mx.array]:
    """A merge left out: pass 1's partial sums as the read's output."""
    return inputs


@contextmanager
def leaving_out(parts: frozenset[str], rows: list[mx.array]) -> Iterator[None]:
    """For the time of the block, the step's ops named in `parts` are not made; with the
    write left out, the rows it would have written are added to `rows` (unless the encode
    is left out too)."""
    with ExitStack() as patches:
        if "write" in parts:
            write = reads.written_rows

            def unwritten(fields: Any, start: int, new: Any) -> Any:
                if new[0].shape[2] != 1:
                    return write(fields, start, new)
                if "encode" not in parts:
                    rows.extend(new)
                return fields

            for module in (reads, records):
                patches.enter_context(mock.patch.object(module, "written_rows", unwritten))
        if "merge" in parts:
            read = attention_kernels.ReadLaunch.__call__
            # Each launch once with its merge left out (a NamedTuple's _replace at every
            # read would add its own host time to the variant), by id: the value holds the
            # launch too, so no other object takes its id while the block runs.
            unmerged: dict[int, tuple[Any, Any]] = {}

            def partial_only(launch: Any, *arguments: Any) -> mx.array:
                known = unmerged.get(id(launch))
                if known is None:
                    known = unmerged[id(launch)] = (launch, launch._replace(merge=_unmerged))
                return read(known[1], *arguments)

            patches.enter_context(
                mock.patch.object(attention_kernels.ReadLaunch, "__call__", partial_only)
            )
        yield


def variant_run(
    step: str,
    parts: frozenset[str],
    kind: str,
    context: int,
    layers: int,
    inputs: tuple[mx.array, mx.array, mx.array],
) -> Callable[[], list[mx.array]]:
    """One variant's step over its own `layers` caches of `kind` (tree_ab.step_run: filled
    with `inputs[0]`, each step appending `inputs[1]` and attending with `inputs[2]`), its
    ops in `parts` left out."""
    run = step_run(step, caches, compiled, kind, context, layers, inputs)

    def left_out() -> list[mx.array]:
        rows: list[mx.array] = []
        with leaving_out(parts, rows):
            return run() + rows

    return left_out


def ablation_rows(
    step: str, kind: str, context: int, layers: int, turns: int
) -> list[dict[str, Any]]:
    """Bare SDPA and every variant of `kind`'s step at `context`, taking turns."""
    prefill, _ = random_kv(context)
    new, _ = random_kv(1)
    queries = mx.random.normal((1, QUERY_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
    bare_kv = [random_kv(context) for _ in range(layers)]

    def bare() -> list[mx.array]:
        return [sdpa(queries, k, v) for k, v in bare_kv]

    runs = [
        variant_run(step, parts, kind, context, layers, (prefill, new, queries))
        for parts in VARIANTS.values()
    ]
    names = ["bare SDPA", *VARIANTS]
    return [
        {
            "step": step,
            "kind": kind,
            "context": context,
            "variant": name,
            "us": median(sample.times) / layers * 1e6,
            "host_us": median(sample.builds) / layers * 1e6,
        }
        for name, sample in zip(names, samples([bare, *runs], turns), strict=True)
    ]


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    names = ["bare SDPA", *VARIANTS]
    print("µs per layer, median of the turns [building the graph]")
    print(f"{'step':9}{'context':>8}  {'kind':32}" + "".join(f"{name:>20}" for name in names))
    for at in range(0, len(rows), len(names)):
        row = rows[at]
        cells = "".join(
            f"{cell['us']:>12.1f} [{cell['host_us']:5.1f}]" for cell in rows[at : at + len(names)]
        )
        print(f"{row['step']:9}{row['context']:>8}  {row['kind']:32}{cells}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", nargs="+", choices=STEPS, default=["eager"])
    add_turn_options(parser, AB_KINDS)
    args = parser.parse_args(argv)
    kinds = picked_kinds(parser, args.kinds, AB_KINDS)
    with ExitStack() as stack:
        contexts, layers, turns = turn_shapes(args, stack)
        print(f"device: {mx.default_device()}  layers {layers}  turns {turns}")
        rows = [
            row
            for step in args.steps
            for context in contexts
            for kind in kinds
            for row in ablation_rows(step, kind, context, layers, turns)
        ]
    print_rows(rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
