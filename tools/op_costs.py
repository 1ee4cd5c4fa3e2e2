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
import sys
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

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
        # slice writes (docs/performance.md, "A tail of decode rows").
        wide = mx.fast.cuda_kernel(
            name="op_costs_wide",
            input_names=[f"a{i}" for i in range(10)],
            output_names=[f"out{i}" for i in range(5)],
            source="".join(f"out{i}[threadIdx.x] = a{i}[threadIdx.x];" for i in range(5)),
        )
        inputs = [x + i for i in range(10)]
        mx.eval(inputs)

        def wide_kernels() -> None:
            mx.eval(
                [
                    wide(
                        inputs=inputs,
                        grid=(32, 1, 1),
                        threadgroup=(32, 1, 1),
                        output_shapes=[(32,)] * 5,
                        output_dtypes=[mx.float32] * 5,
                    )
                    for _ in range(32)
                ]
            )

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
    # thread per element of the whole buffer (docs/performance.md).
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed round")
    parser.add_argument("--quick", action="store_true", help="few calls (CPU smoke run)")
    args = parser.parse_args(argv)
    calls = 20 if args.quick else args.calls
    print(f"device: {mx.default_device()}  mlx {mx.__version__}")
    rows = build_rows(calls) + eval_rows(calls)
    width = max(len(name) for name, _ in rows)
    print(f"{'op':{width}}  host us")
    for name, us in rows:
        print(f"{name:{width}}  {us:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
