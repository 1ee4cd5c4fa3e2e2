"""A left-padded batch's decode step (spec ROWS-6), read by READ-7's kernels row by row
against the read they replaced (the padding mask over the decoded window, in MLX ops: the
reference's read), the two taking turns in one process on caches filled alike.

    python tools/padded_batch.py --contexts 4096 --kinds KVCache 4-bit Turbo   # GPU machine
    python tools/padded_batch.py --quick        # CPU: the CUDA path with stand-in kernels

Per kind and context: LAYERS caches (of room for T + 2 positions: a ring never wraps) of a
batch of BATCH rows padded by 0, T/8, T/4 and T/2 of T positions; a step is
`append_decode(k, v).attend(q, scale)` at every layer, evaluated at once, then trimmed back
(so every turn reads the same rows). µs per layer, median of the turns, and the largest
difference between the two reads' outputs (READ-7's arithmetic against MLX's attention:
within READ-1's bound, not equal).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any
from unittest import mock

import mlx.core as mx
from bench import (
    AB_KINDS,
    HEAD_DIM,
    KIND_FACTORIES,
    KV_HEADS,
    QUERY_HEADS,
    add_turn_options,
    median,
    picked_kinds,
    samples,
    turn_shapes,
    write_rows,
)

from kvspec.accelerated import caches
from kvspec.accelerated.caches.reads import ReadMethods
from kvspec.reference.caches import reads

#: Each row's left padding, as a share of the context's positions: the batch's rows.
PADDING_SHARES = (0.0, 0.125, 0.25, 0.5)
BATCH = len(PADDING_SHARES)
#: The reads a run takes turns between: the storages' own (READ-7's kernels), and the
#: reference's read of the decoded window under its padding mask.
READS = {"kernels": ReadMethods.append_and_read, "masked window": reads.ReadMethods.append_and_read}


def padding(context: int) -> list[int]:
    """The rows' left padding at `context` positions (PADDING_SHARES)."""
    return [int(context * share) for share in PADDING_SHARES]


def batch_rows(positions: int) -> mx.array:
    """Random bf16 keys or values of the batch, [BATCH, KV_HEADS, positions, HEAD_DIM]."""
    rows = mx.random.normal((BATCH, KV_HEADS, positions, HEAD_DIM)).astype(mx.bfloat16)
    mx.eval(rows)
    return rows


def read_run(
    kind: str,
    context: int,
    layers: int,
    append_and_read: Callable[..., Any],
    inputs: tuple[mx.array, ...],
) -> Callable[[], list[mx.array]]:
    """One read's decode step over its own `layers` padded caches of `kind`."""
    prefill, new, queries = inputs
    layer_caches = [KIND_FACTORIES[kind](caches, context + 2) for _ in range(layers)]
    for cache in layer_caches:
        cache.prepare(left_padding=padding(context))
        cache.append_window(prefill, prefill)
    mx.eval([array for cache in layer_caches for array in cache.state().arrays])

    def step() -> list[mx.array]:
        with mock.patch.object(ReadMethods, "append_and_read", append_and_read):
            outputs = [
                cache.append_decode(new, new).attend(queries, HEAD_DIM**-0.5)
                for cache in layer_caches
            ]
        for cache in layer_caches:
            cache.trim(1)
        return outputs

    return step


def padded_rows(kind: str, context: int, layers: int, turns: int) -> list[dict[str, Any]]:
    """Both reads of `kind`'s padded batch at `context`, taking turns."""
    inputs = (
        batch_rows(context),
        batch_rows(1),
        mx.random.normal((BATCH, QUERY_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16),
    )
    runs = [read_run(kind, context, layers, read, inputs) for read in READS.values()]
    outputs = [mx.concatenate(run(), axis=0).astype(mx.float32) for run in runs]
    difference = mx.abs(outputs[0] - outputs[1]).max().item()
    return [
        {
            "kind": kind,
            "context": context,
            "padding": padding(context),
            "read": name,
            "us": median(sample.times) / layers * 1e6,
            "max_diff": difference,
        }
        for name, sample in zip(READS, samples(runs, turns), strict=True)
    ]


def print_rows(rows: Sequence[dict[str, Any]]) -> None:
    print(f"µs per layer, median of the turns; a batch of {BATCH} rows padded by 0, T/8, T/4, T/2")
    print(f"{'context':>8}  {'kind':32}{'kernels':>10}{'masked':>10}{'ratio':>8}{'max diff':>11}")
    for at in range(0, len(rows), len(READS)):
        kernels, masked = rows[at : at + len(READS)]
        print(
            f"{kernels['context']:>8}  {kernels['kind']:32}{kernels['us']:>10.1f}"
            f"{masked['us']:>10.1f}{kernels['us'] / masked['us']:>8.2f}"
            f"{kernels['max_diff']:>11.2e}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_turn_options(parser, AB_KINDS)
    args = parser.parse_args(argv)
    kinds = picked_kinds(parser, args.kinds, AB_KINDS)
    with ExitStack() as stack:
        contexts, layers, turns = turn_shapes(args, stack)
        print(f"device: {mx.default_device()}  layers {layers}  turns {turns}")
        rows = [
            row
            for context in contexts
            for kind in kinds
            for row in padded_rows(kind, context, layers, turns)
        ]
    print_rows(rows)
    write_rows(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
