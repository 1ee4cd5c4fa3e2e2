"""The eager decode step's host time beside its floor: the same custom-kernel launches and
slice writes, called again without kvspec's Python.

    python tools/host_floor.py --contexts 4096 32768 --kinds Turbo "4-bit" KVCache
    python tools/host_floor.py --quick        # CPU: the CUDA path with stand-in kernels

Per kind, 32 layers' caches filled alike. One eager step (`append_decode(k, v).attend(q,
scale)` at every layer) is recorded: each launch of a custom kernel with its arguments, and
the stored arrays the step rewrites (a record, or keys and values). The replay calls the
same kernels with the same arrays and writes one row into a buffer of each rewritten
array's shape and dtype, as the step's slice writes do. Eager steps, replays and bare bf16
SDPA over as many layers (bench's baseline) take turns; each row gives µs per layer, median
of the turns, of building the graph and of the whole evaluated call, and the step and the
replay as ratios to bare SDPA. The eager step's building less the replay's is kvspec's
Python: what a cut of Python could still take off the step, the rest being MLX's own; the
replay's ratio is what the step would cost if kvspec's Python cost nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import mlx.core as mx
from bench import (
    AB_KINDS,
    HEAD_DIM,
    KINDS,
    QUERY_HEADS,
    add_turn_options,
    median,
    picked_kinds,
    random_kv,
    samples,
    sdpa,
    turn_shapes,
)

from kvspec.conformance.stand_ins import kernels_made_by


@dataclass
class Row:
    """One kind at one context: µs per layer, median of the turns."""

    kind: str
    context: int
    launches: float
    eager_build_us: float
    replay_build_us: float
    eager_us: float
    replay_us: float
    #: Bare bf16 SDPA over as many layers, taking the same turns.
    bare_us: float

    @property
    def python_us(self) -> float:
        """The eager step's building less its launches' and writes' own."""
        return self.eager_build_us - self.replay_build_us


class Recorder:
    """Each custom-kernel launch made while `recording`: (kernel, its arguments)."""

    def __init__(self) -> None:
        self.recording = False
        self.calls: list[tuple[Any, dict[str, Any]]] = []


@contextmanager
def recorded_launches() -> Iterator[Recorder]:
    """For the time of the block, every custom kernel made is wrapped so that the yielded
    Recorder sees its launches. Every kernel kept made is dropped before and after, so that
    all are made through the wrapper."""
    recorder = Recorder()
    make = mx.fast.cuda_kernel

    def wrapped(*args: Any, **kwargs: Any) -> Callable[..., Any]:
        kernel = make(*args, **kwargs)

        def launch(**arguments: Any) -> Any:
            if recorder.recording:
                recorder.calls.append((kernel, arguments))
            return kernel(**arguments)

        return launch

    with kernels_made_by(wrapped):
        yield recorder


def rewritten(cache: Any) -> list[mx.array]:
    """The arrays a step's slice writes rewrite: a record storage's record, else its
    fields (a bf16-first cache's storage's)."""
    storage = getattr(cache, "storage", cache)
    fields = storage._fields
    return [fields.record] if hasattr(fields, "record") else list(fields)


def floor_row(
    name: str,
    factory: Callable[[int], Any],
    context: int,
    layers: int,
    turns: int,
    recorder: Recorder,
) -> Row:
    """The eager step of `layers` caches of `name` at `context` beside its replay and bare
    SDPA over `layers` buffers of the same keys and values."""
    scale = HEAD_DIM**-0.5
    q = mx.random.normal((1, QUERY_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
    k1, v1 = random_kv(1)
    prefill_k, prefill_v = random_kv(context)
    caches = [factory(context + 2 * turns + 8) for _ in range(layers)]
    for cache in caches:
        cache.append_window(prefill_k, prefill_v)
    mx.eval([cache.state().arrays for cache in caches])

    def eager() -> list[mx.array]:
        return [cache.append_decode(k1, v1).attend(q, scale) for cache in caches]

    mx.eval(eager())
    recorder.recording, recorder.calls = True, []
    mx.eval(eager())
    recorder.recording, recorded = False, recorder.calls
    buffers = [mx.zeros(a.shape, a.dtype) for cache in caches for a in rewritten(cache)]
    rows = [mx.zeros((*a.shape[:2], 1, a.shape[3]), a.dtype) for a in buffers]
    mx.eval(buffers, rows)
    at = context // 2

    def replay() -> list[mx.array]:
        outputs = [out for kernel, arguments in recorded for out in kernel(**arguments)]
        for i, row in enumerate(rows):
            buffers[i][:, :, at : at + 1] = row
        return outputs + buffers

    bare_buffers = [(prefill_k + 0, prefill_v + 0) for _ in range(layers)]
    mx.eval(bare_buffers)

    def bare() -> list[mx.array]:
        return [sdpa(q, k, v) for k, v in bare_buffers]

    step, again, alone = samples([eager, replay, bare], turns)
    return Row(
        name,
        context,
        len(recorded) / layers,
        median(step.builds) / layers * 1e6,
        median(again.builds) / layers * 1e6,
        median(step.times) / layers * 1e6,
        median(again.times) / layers * 1e6,
        median(alone.times) / layers * 1e6,
    )


def print_rows(rows: Sequence[Row]) -> None:
    print(
        "µs per layer, median of the turns: building the graph, and the whole evaluated call; "
        "x bare: of bare bf16 SDPA in the same turns"
    )
    print(
        f"{'kind':<36}{'context':>8}{'launches':>9}{'build':>8}{'replay':>8}"
        f"{'python':>8}{'step':>8}{'replay':>8}{'bare':>8}{'step x':>8}{'replay x':>9}"
    )
    for row in rows:
        print(
            f"{row.kind:<36}{row.context:>8}{row.launches:>9.1f}{row.eager_build_us:>8.1f}"
            f"{row.replay_build_us:>8.1f}{row.python_us:>8.1f}{row.eager_us:>8.1f}"
            f"{row.replay_us:>8.1f}{row.bare_us:>8.1f}{row.eager_us / row.bare_us:>8.2f}"
            f"{row.replay_us / row.bare_us:>9.2f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_turn_options(parser, AB_KINDS)
    args = parser.parse_args(argv)
    kinds = picked_kinds(parser, args.kinds, AB_KINDS)
    with ExitStack() as stack:
        contexts, layers, turns = turn_shapes(args, stack)
        recorder = stack.enter_context(recorded_launches())
        print(f"device: {mx.default_device()}  layers {layers}  turns {turns}")
        rows = [
            floor_row(name, KINDS[name], context, layers, turns, recorder)
            for context in contexts
            for name in kinds
        ]
    print_rows(rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rows": [asdict(row) for row in rows]}, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
