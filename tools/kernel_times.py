"""Each kernel of a decode step alone on the device (Nsight Compute), beside its byte floor.

    ncu --metrics gpu__time_duration.sum --clock-control none --csv --log-file kernels.csv \\
        python tools/kernel_times.py run spans.json --contexts 4096 32768 131072
    python tools/kernel_times.py table kernels.csv spans.json [--json rows.json]

`run` evaluates, at each context, MLX's plain reads of 1 GiB (bench.PLAIN_READS), bare bf16
SDPA, and for each kind one layer's eager decode step and its compiled step (COMPILE-6), each
REPEATS times; before each evaluation it launches a marker kernel named after the span's
index, so that the kernels ncu lists fall into spans, and it writes what each span is to
SPANS (setup between them opens a span of its own, which no row shows). `table` takes each
kernel's median over a span's repeats (the first left out: it builds and warms up) and
prints, per kind and step, every kernel's device time, the decode attention's pass 1
against its byte floor (the kind's stored bytes at the fastest plain read's bandwidth in
the same run), and the step's device time against bare SDPA's.

Under ncu each kernel runs alone, caches flushed before it: no launch overlaps another,
so these are the device's times, not a step's wall time (tools/bench.py). Off CUDA `run`
refuses; its test runs it on the CUDA path with stand-in kernels.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

import mlx.core as mx
from bench import (
    HEAD_DIM,
    KINDS,
    PLAIN_READS,
    QUERY_HEADS,
    TARGET_KINDS,
    add_kinds_option,
    at_least_one,
    compiled_step,
    median,
    picked_kinds,
    random_kv,
    sdpa,
)

#: Evaluations of each span; the first is left out of the medians.
REPEATS = 4
#: The plain reads' buffer: 1 GiB of float32.
PLAIN_READ_ELEMENTS = 2**28
#: What each kernel is, by a part of its name (the first that matches).
KERNEL_ROLES = (
    ("decode_attention", "pass 1"),
    ("decode_merge", "merge"),
    ("encode", "encode"),
    ("quantize", "encode"),
    ("sdpa", "cuDNN SDPA"),
    ("cudnn", "cuDNN reduction"),
    ("copy", "copy or write"),
    ("reduce", "reduction"),
)


@dataclass
class Span:
    """What one marker opens: `step` is "plain read", "bare SDPA", "eager" or "compiled";
    `bytes` what a floor counts (the plain read's buffer, the kind's stored bytes)."""

    step: str
    what: str
    context: int
    bytes: int


#: A span of setup (filling buffers and caches), between the timed spans: no row.
SETUP = Span("setup", "", 0, 0)


@dataclass
class Row:
    """One span's kernels, µs each (median of the repeats), in launch order."""

    step: str
    what: str
    context: int
    kernels: list[tuple[str, float]] = field(default_factory=list)
    #: Pass 1's byte floor over its time (steps only).
    floor_fraction: float = 0.0
    #: The step's device time over bare SDPA's at its context (steps only).
    bare_ratio: float = 0.0

    @property
    def total_us(self) -> float:
        return sum(us for _, us in self.kernels)


def role(kernel_name: str) -> str:
    """What a kernel of ncu's list is (KERNEL_ROLES), or its name's first 40 characters."""
    lowered = kernel_name.lower()
    for part, name in KERNEL_ROLES:
        if part in lowered:
            return name
    return kernel_name[:40]


class Markers:
    """Marker kernels, one name per span (`marker{index}`), launched on a zero made once."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._input = mx.zeros((1,), mx.float32)
        mx.eval(self._input)

    def open(self, span: Span) -> None:
        kernel = mx.fast.cuda_kernel(
            name=f"marker{len(self.spans)}",
            input_names=["x"],
            output_names=["y"],
            source="y[0] = x[0];",
        )
        self.spans.append(span)
        (marked,) = kernel(
            inputs=[self._input],
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[(1,)],
            output_dtypes=[mx.float32],
        )
        mx.eval(marked)


def run_spans(kinds: Sequence[str], contexts: Sequence[int], markers: Markers) -> None:
    """Every span of `run` (the module's docstring), each evaluated REPEATS times."""
    markers.open(SETUP)
    x = mx.random.uniform(shape=(PLAIN_READ_ELEMENTS,))
    mx.eval(x)
    for name, read in PLAIN_READS.items():
        for _ in range(REPEATS):
            markers.open(Span("plain read", name, 0, x.nbytes))
            mx.eval(read(x))
    markers.open(SETUP)
    del x
    q = mx.random.normal((1, QUERY_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
    scale = HEAD_DIM**-0.5
    for context in contexts:
        markers.open(SETUP)
        k, v = random_kv(context)
        new_k, new_v = random_kv(1)
        for _ in range(REPEATS):
            markers.open(Span("bare SDPA", "bare bf16 SDPA", context, k.nbytes + v.nbytes))
            mx.eval(sdpa(q, k, v))
        for kind in kinds:
            markers.open(SETUP)
            eager, compiled = (KINDS[kind](context + 2 * REPEATS) for _ in range(2))
            for cache in (eager, compiled):
                cache.append_window(k, v)
                mx.eval(cache.state().arrays)
            stored = eager.bytes_per_token() * context
            for _ in range(REPEATS):
                markers.open(Span("eager", kind, context, stored))
                mx.eval(eager.append_decode(new_k, new_v).attend(q, scale))
            step = compiled_step([compiled], new_k, new_v, q)
            for _ in range(REPEATS):
                markers.open(Span("compiled", kind, context, stored))
                mx.eval(step())
    markers.open(SETUP)


def ncu_kernels(lines: Sequence[str]) -> Iterator[tuple[str, float]]:
    """(kernel name, µs) of each kernel in ncu's CSV log (`--csv`, one metric:
    gpu__time_duration.sum), in launch order."""
    units = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    for record in csv.DictReader(line for line in lines if line.startswith('"')):
        if record.get("Metric Name") != "gpu__time_duration.sum":
            continue
        unit = record["Metric Unit"]
        if unit not in units:
            raise ValueError(f"unknown unit {unit!r} in ncu's log")
        yield record["Kernel Name"], float(record["Metric Value"].replace(",", "")) * units[unit]


def span_rows(kernels: Sequence[tuple[str, float]], spans: Sequence[Span]) -> list[Row]:
    """One row per distinct span: its kernels' medians over its repeats after the first."""
    opened: list[tuple[Span, list[tuple[str, float]]]] = []
    for name, us in kernels:
        marker = re.search(r"marker(\d+)\b", name)
        if marker:
            opened.append((spans[int(marker.group(1))], []))
        elif opened:
            opened[-1][1].append((role(name), us))
    repeats: dict[tuple[str, str, int], list[list[tuple[str, float]]]] = {}
    for span, launched in opened:
        if span.step == SETUP.step:
            continue
        repeats.setdefault((span.step, span.what, span.context), []).append(launched)
    rows = []
    for (step, what, context), runs in repeats.items():
        timed = runs[1:] or runs
        if len({tuple(role for role, _ in run) for run in timed}) != 1:
            raise ValueError(f"{step} {what} at {context}: its repeats launched other kernels")
        kernels_here = [
            (role_name, median([run[i][1] for run in timed]))
            for i, (role_name, _) in enumerate(timed[0])
        ]
        rows.append(Row(step, what, context, kernels_here))
    return rows


def with_floors(rows: list[Row], spans: Sequence[Span]) -> float:
    """Sets each step row's floor fraction and ratio to bare SDPA; returns the bandwidth
    (bytes per second) of the fastest plain read."""
    stored = {(span.step, span.what, span.context): span.bytes for span in spans}
    reads = [row for row in rows if row.step == "plain read"]
    if not reads:
        raise ValueError("no plain read in the log: no bandwidth to floor the reads")
    bandwidth = max(stored[(r.step, r.what, r.context)] / (r.total_us * 1e-6) for r in reads)
    bare = {row.context: row.total_us for row in rows if row.step == "bare SDPA"}
    for row in rows:
        if row.step not in ("eager", "compiled"):
            continue
        pass_us = sum(us for name, us in row.kernels if name == "pass 1")
        floor_us = stored[(row.step, row.what, row.context)] / bandwidth * 1e6
        row.floor_fraction = floor_us / pass_us if pass_us else 0.0
        row.bare_ratio = row.total_us / bare[row.context] if row.context in bare else 0.0
    return bandwidth


def print_table(rows: Sequence[Row], bandwidth: float) -> None:
    print(f"fastest plain read under ncu: {bandwidth / 1e12:.2f} TB/s")
    print("| step | context | kernels, µs each | device µs | pass 1 floor fraction | x bare |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        if row.step == "plain read":
            continue
        kernels = ", ".join(f"{name} {us:.1f}" for name, us in row.kernels)
        extra = (
            f"{row.floor_fraction:.2f} | {row.bare_ratio:.2f}"
            if row.step in ("eager", "compiled")
            else " | "
        )
        name = row.what if row.step == "bare SDPA" else f"{row.what}, {row.step}"
        print(f"| {name} | {row.context} | {kernels} | {row.total_us:.1f} | {extra} |")


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not mx.cuda.is_available():
        parser.error("run times CUDA kernels: it needs MLX's CUDA backend")
    markers = Markers()
    run_spans(picked_kinds(parser, args.kinds, TARGET_KINDS), args.contexts, markers)
    with open(args.spans, "w") as f:
        json.dump([asdict(span) for span in markers.spans], f)
    print(f"{len(markers.spans)} spans written to {args.spans}")
    return 0


def table(args: argparse.Namespace) -> int:
    with open(args.spans) as f:
        spans = [Span(**span) for span in json.load(f)]
    with open(args.log) as f:
        kernels = list(ncu_kernels(f.readlines()))
    rows = span_rows(kernels, spans)
    bandwidth = with_floors(rows, spans)
    print_table(rows, bandwidth)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": [asdict(row) for row in rows]}, f)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run_parser = commands.add_parser("run", help="the spans, for ncu to time")
    run_parser.add_argument("spans", help="write what each span is to this JSON file")
    run_parser.add_argument("--contexts", type=at_least_one, nargs="+", default=[4096, 32768])
    add_kinds_option(run_parser, TARGET_KINDS)
    table_parser = commands.add_parser("table", help="ncu's log and the spans as a table")
    table_parser.add_argument("log", help="ncu's --csv --log-file")
    table_parser.add_argument("spans", help="the spans `run` wrote")
    table_parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    return run(args, run_parser) if args.command == "run" else table(args)


if __name__ == "__main__":
    sys.exit(main())
