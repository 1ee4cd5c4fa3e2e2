"""What MLX charges the host for one op on the default device: building it (the Python call
that puts it in the graph) and evaluating it (`mx.eval` dispatching it), per op.

A decode step hands MLX a few ops per layer and 32 layers per evaluation; where each op
costs microseconds of host time whatever its size, the count of ops, not the kernels,
sets the step's time (docs/performance.md). On CUDA the custom-kernel rows show what a
call costs with a longer source, more inputs or more template arguments.

    python tools/op_costs.py               # on the GPU machine
    python tools/op_costs.py --quick       # fewer repeats (the test suite runs this)
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from kvspec.accelerated.caches.reads import written_rows

#: A copy kernel's body, and the same body with 12 kB of comment lines after it: MLX
#: hashes the whole source at every evaluation.
SMALL_SOURCE = "out[threadIdx.x] = a0[threadIdx.x];"
LONG_SOURCE = SMALL_SOURCE + "\n" + "\n".join("// " + "x" * 97 for _ in range(120))


def per_call(run: Callable[[], object], calls: int) -> float:
    """Least host µs of one call of `run` over five rounds of `calls` calls."""
    for _ in range(min(calls, 50)):
        run()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        rounds.append((time.perf_counter() - start) / calls)
    return min(rounds) * 1e6


def copy_kernel(source: str, inputs: int) -> Callable[..., list[mx.array]]:
    """A custom kernel copying 32 elements of its first input; `inputs` inputs in all."""
    kernel = mx.fast.cuda_kernel(
        name=f"op_costs_{len(source)}_{inputs}",
        input_names=[f"a{i}" for i in range(inputs)],
        output_names=["out"],
        source=source,
    )

    def call(arrays: list[mx.array], template: list | None = None) -> list[mx.array]:
        return kernel(
            inputs=arrays,
            template=template or [],
            grid=(32, 1, 1),
            threadgroup=(32, 1, 1),
            output_shapes=[(32,)],
            output_dtypes=[arrays[0].dtype],
        )

    return call


def build_rows(calls: int) -> list[tuple[str, float]]:
    """Host µs of building one op of each kind."""
    buffer = mx.zeros((1, 8, 4096, 128), mx.bfloat16)
    row = mx.zeros((1, 8, 1, 128), mx.bfloat16)
    mx.eval(buffer, row)
    start = mx.array([0, 0, 5, 0])

    def slice_assign() -> None:
        target = buffer
        target[:, :, 5:6] = row

    rows = [
        ("slice a[:, :, :4000]", per_call(lambda: buffer[:, :, :4000], calls)),
        (
            "mx.slice_update",
            per_call(lambda: mx.slice_update(buffer, row, start, (0, 1, 2, 3)), calls),
        ),
        ("a[:, :, 5:6] = x", per_call(slice_assign, calls)),
    ]
    if mx.cuda.is_available():
        small, long = copy_kernel(SMALL_SOURCE, 1), copy_kernel(LONG_SOURCE, 1)
        many = copy_kernel(SMALL_SOURCE, 12)
        template = [(f"N{i}", i) for i in range(12)] + [(f"T{i}", mx.float16) for i in range(4)]
        rows += [
            ("cuda_kernel call, 1 input", per_call(lambda: small([buffer]), calls)),
            ("cuda_kernel call, 12 kB source", per_call(lambda: long([buffer]), calls)),
            ("cuda_kernel call, 12 inputs", per_call(lambda: many([buffer] * 12), calls)),
            (
                "cuda_kernel call, 16 template arguments",
                per_call(lambda: small([buffer], template), calls),
            ),
        ]
    return rows


def eval_rows(calls: int) -> list[tuple[str, float]]:
    """Host µs per op of evaluating n independent ops in one `mx.eval` (building included)."""
    x = mx.zeros((32,), mx.float32)
    mx.eval(x)
    rounds = max(2, calls // 100)
    rows = []
    for n in (1, 32, 128):
        rows.append(
            (
                f"eval {n} small ops, per op",
                per_call(lambda n=n: mx.eval([x + i for i in range(n)]), rounds) / n,
            )
        )
    if mx.cuda.is_available():
        for label, source in ("small", SMALL_SOURCE), ("12 kB", LONG_SOURCE):
            kernel = copy_kernel(source, 1)
            rows.append(
                (
                    f"eval 128 {label} custom kernels, per kernel",
                    per_call(
                        lambda kernel=kernel: mx.eval([kernel([x])[0] for _ in range(128)]), rounds
                    )
                    / 128,
                )
            )
        # Many arrays in one op: what one launch writing five fields costs against five
        # slice writes (docs/performance-log.md, "A tail of decode rows").
        wide = stand_in("wide", 10, 5)
        inputs = [x + i for i in range(10)]
        mx.eval(inputs)

        def wide_kernels() -> None:
            mx.eval([launch(wide, inputs, [((32,), mx.float32)] * 5) for _ in range(32)])

        rows.append(
            (
                "eval 32 custom kernels of 10 inputs and 5 outputs, per kernel",
                per_call(wide_kernels, rounds) / 32,
            )
        )
    buffers = [mx.zeros((1, 8, 4096, 128), mx.bfloat16) for _ in range(32)]
    row = mx.zeros((1, 8, 1, 128), mx.bfloat16)
    mx.eval(buffers, row)

    def writes() -> None:
        for buffer in buffers:
            buffer[:, :, 7:8] = row
        mx.eval(buffers)

    rows.append(("eval 32 slice writes in place, per write", per_call(writes, rounds) / 32))
    # An array start makes the write MLX's DynamicSliceUpdate, whose CUDA copy runs one
    # thread per element of the whole buffer (docs/performance-log.md).
    start = mx.array([7])

    def dynamic_writes() -> None:
        # Rebound before the evaluation, so each update may write its buffer in place.
        for i, buffer in enumerate(buffers):
            buffers[i] = mx.slice_update(buffer, row, start, (2,))
        mx.eval(buffers)

    rows.append(
        ("eval 32 slice writes at an array start, per write", per_call(dynamic_writes, rounds) / 32)
    )
    # Views: what reading fields out of one packed buffer would add (no kernel, no copy).
    packed = mx.zeros((1, 8, 4096, 64), mx.uint32)
    mx.eval(packed)
    rows.append(
        (
            "eval 32 slice views, per view",
            per_call(lambda: mx.eval([packed[:, :, :4000, 8:40] for _ in range(32)]), rounds) / 32,
        )
    )
    rows.append(
        (
            "eval 32 slice views as float16, per view",
            per_call(
                lambda: mx.eval([packed[:, :, :4000, 8:40].view(mx.float16) for _ in range(32)]),
                rounds,
            )
            / 32,
        )
    )
    return rows


def stand_in(name: str, inputs: int, outputs: int) -> object:
    """A custom kernel of `inputs` inputs and `outputs` outputs that writes one element of
    each output: its host cost is a real kernel's of as many arrays, its GPU time none."""
    return mx.fast.cuda_kernel(
        name=f"op_costs_stand_in_{name}",
        input_names=[f"a{i}" for i in range(inputs)],
        output_names=[f"out{i}" for i in range(outputs)],
        source="".join(f"out{i}[0] = 0;" for i in range(outputs)),
        ensure_row_contiguous=False,
    )


def launch(
    kernel: object,
    inputs: list[mx.array],
    outputs: list[tuple],
    init_value: float | None = None,
) -> list[mx.array]:
    """One launch of a stand-in over `inputs`, making `outputs` ((shape, dtype) each),
    every output first filled with `init_value` where one is given (MLX fills each)."""
    return kernel(
        inputs=inputs,
        grid=(32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[shape for shape, _ in outputs],
        output_dtypes=[dtype for _, dtype in outputs],
        init_value=init_value,
    )


#: The TurboQuant decode steps of step_rows: its fields stored apart (as before the
#: records), in one record per row (as stored now), and in one record with the split merge
#: folded into the attention launch (its last split of a head merging, counted in an
#: output that MLX zeroes: every output of the launch is then filled before it runs; on
#: the H200 that step was slower, and the fold was not kept: docs/performance-log.md).
STEP_VARIANTS = {
    "fields apart": "apart",
    "fields in one record": "record",
    "one record, merge folded into the attention": "folded",
}


def step_rows(calls: int) -> list[tuple[str, float]]:
    """Host µs per layer of a TurboQuant k8v4 decode step's ops over 32 layers (4k rows),
    its kernels stood in by kernels of as many arrays that do no work (STEP_VARIANTS):
    with the fields apart, an encode of 5 inputs and 6 outputs, 5 slice writes, the key
    codes cut, attention of 8 inputs and 2 outputs (partial sums and statistics of 66
    splits, as at 32k), merge of 3 and 1; with one record per row, an encode of 5 inputs
    and 2 outputs, 1 write, the record cut, attention of 3 inputs and 2 outputs, the same
    merge; folded, the same but the attention's outputs are the result and one zeroed
    buffer of the splits' sums and the heads' counters, and there is no merge. What each
    storage or launch saves the host, weighed before it is built."""
    rounds = max(2, calls // 100)
    widths = [(128, mx.int8), (4, mx.float16), (4, mx.float16), (64, mx.uint8), (4, mx.float16)]
    record = (216, mx.uint8)  # the same bytes in one row
    encode_apart, encode_packed = stand_in("enc6", 5, 6), stand_in("enc2", 5, 2)
    attend_apart, attend_packed = stand_in("att8", 8, 2), stand_in("att3", 3, 2)
    merge = stand_in("merge", 3, 1)
    k = mx.zeros((1, 8, 1, 128), mx.bfloat16)
    q = mx.zeros((1, 32, 1, 128), mx.bfloat16)
    small = mx.zeros((16,), mx.float32)
    prior = mx.zeros((1,), mx.uint32)
    mx.eval(k, q, small, prior)
    splits = 66
    result = ((1, 32, 1, 128), mx.bfloat16)
    stats = [((32, splits, 128), mx.float32), ((32, splits, 2), mx.float32)]
    folded = [result, ((32 * splits * 130 + 8,), mx.float32)]

    def step_of(variant: str) -> Callable[[], None]:
        stored = widths if variant == "apart" else [record]
        layers = [[mx.zeros((1, 8, 4096, w), d) for w, d in stored] for _ in range(32)]
        mx.eval(layers)
        positions = itertools.count(100)

        def step() -> None:
            outs = []
            start = next(positions)
            for i, fields in enumerate(layers):
                rows = [((1, 8, 1, w), d) for w, d in stored]
                encode = encode_apart if variant == "apart" else encode_packed
                *new, _ = launch(encode, [k, k, small, small, prior], [*rows, ((1,), mx.uint32)])
                written = written_rows(fields, start, new)  # as the MLX storages write
                layers[i] = written
                cut = written[0][:, :, : start + 1]
                if variant == "folded":
                    out, _ = launch(attend_packed, [q, cut, small], folded, init_value=0.0)
                    outs.append(out)
                    continue
                if variant == "record":
                    partial, sums = launch(attend_packed, [q, cut, small], stats)
                else:
                    apart = [q, cut, *written[1:], small, small]
                    partial, sums = launch(attend_apart, apart, stats)
                outs += launch(merge, [partial, sums, small], [result])
            mx.eval(outs)

        return step

    return [
        (f"stand-in TurboQuant step, {name}, per layer", per_call(step_of(variant), rounds) / 32)
        for name, variant in STEP_VARIANTS.items()
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed round")
    parser.add_argument("--quick", action="store_true", help="few calls (CPU smoke run)")
    args = parser.parse_args(argv)
    calls = 20 if args.quick else args.calls
    print(f"device: {mx.default_device()}  mlx {mx.__version__}")
    rows = build_rows(calls) + eval_rows(calls)
    if mx.cuda.is_available():
        rows += step_rows(calls)
    width = max(len(name) for name, _ in rows)
    print(f"{'op':{width}}  host us")
    for name, us in rows:
        print(f"{name:{width}}  {us:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
