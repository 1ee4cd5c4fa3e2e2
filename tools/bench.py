"""Decode-step, attention and encode timings on MLX's default device, as ratios to bare bf16
attention measured in the same run.

A decode step per layer is `cache.append_decode(k, v).attend(q, scale)`; LAYERS layers, each
with its own cache, are evaluated in one `mx.eval` and the time is divided by LAYERS (one
layer per evaluation would measure MLX's per-evaluation overhead). Beside every kind: bare
`mx.fast.scaled_dot_product_attention` over bf16 keys and values (no append) and an
mlx-lm-style quantized attention (4-bit g64, no append). The same step compiled (spec
COMPILE-6: all layers in one `mx.compile`d graph, replayed) is timed against the eager
step, the two taking turns on the same caches (fastest of the repeats, and least CPU time:
the steadier measure where other processes share the CPU). The eager step is also timed
as a decode loop runs it, each step built while the one before runs (`mx.async_eval`, as
mlx-lm's generate), beside bare SDPA run alike, with the peak memory it holds above the
caches' (the `overlapped` table). Each read's
attention alone is also timed against its byte floor: the bytes it must read over the
plain-read bandwidth measured in this run; on CUDA, beside it, the same read on the kernels'
CUDA-core body where the tensor-core body takes it; over two contexts or more, the time a
read adds from each context to the next gives its stored bytes' rate (the `rate` table),
the kernels' own, without the costs of a call, where both contexts' reads are bound by
their kernels. The `chained` table runs the layers as a model does, each layer's query the
output of the layer before (bare SDPA alike): its kernels cannot overlap another layer's,
as those of independent layers can. Absolute times mean something only on the GPU machine.

    python tools/bench.py                       # the table at 1k .. 128k positions
    python tools/bench.py --contexts 4096 --json rows.json
    python tools/bench.py --quick               # tiny shapes: checks the paths run
    python tools/bench.py --contexts 1024 --compiled-only   # compiled against eager, per kind
    python tools/bench.py --compiled-only --kinds TurboQuant    # only the kinds named so
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from functools import partial
from itertools import pairwise
from typing import Any

import mlx.core as mx

from kvspec.accelerated import affine, attention_kernels, caches, turboquant
from kvspec.accelerated.caches.compiled import compile_decode
from kvspec.accelerated.caches.reads import StoredRead
from kvspec.accelerated.device import fused_kernels_enabled

KV_HEADS = 8
QUERY_HEADS = 32
HEAD_DIM = 128

#: The cache kinds of the step table: a name and a factory of an empty cache of T positions'
#: room from a `caches` module (this package's, or another version's: tools/tree_ab.py).
#: Every encoding cache defers its checks (DEFER-3): a decode step must not wait.
KIND_FACTORIES: dict[str, Callable[[Any, int], caches.Cache]] = {
    "KVCache": lambda c, T: c.KVCache(),
    "RotatingKVCache": lambda c, T: c.RotatingKVCache(T),
    "QuantizedKVCache 4-bit g64": lambda c, T: c.QuantizedKVCache(64, 4, checks="deferred"),
    "QuantizedKVCache 8-bit g64": lambda c, T: c.QuantizedKVCache(64, 8, checks="deferred"),
    "RotatingQuantizedKVCache 4-bit g64": lambda c, T: c.RotatingQuantizedKVCache(
        T, 64, 4, checks="deferred"
    ),
    "TurboQuantKVCache k8v4 dense": lambda c, T: c.TurboQuantKVCache(
        8, 4, "dense", checks="deferred"
    ),
    "TurboQuantKVCache k8v4 deferred": lambda c, T: c.TurboQuantKVCache(
        8, 4, "deferred", checks="deferred"
    ),
    "scheme affine:4:64 (bf16-first)": lambda c, T: c.composed_full_attention_cache(
        c.parse_scheme("affine:4:64"), 0, checks="deferred"
    ),
    "scheme turbo:k8v4 (bf16-first)": lambda c, T: c.composed_full_attention_cache(
        c.parse_scheme("turbo:k8v4"), 0, checks="deferred"
    ),
}
#: The ring kinds: their factory's T is the ring's max_size.
RING_KINDS = ("RotatingKVCache", "RotatingQuantizedKVCache 4-bit g64")
#: The kinds the performance issue's targets name: the tools that time or build a few kinds
#: take these without --kinds.
TARGET_KINDS = (
    "KVCache",
    "QuantizedKVCache 4-bit g64",
    "QuantizedKVCache 8-bit g64",
    "TurboQuantKVCache k8v4 dense",
)
#: The kinds the A/B and host tools (kernel_ab.py, tree_ab.py, host_floor.py) time without
#: --kinds: one of each stored format of the targets but affine 8-bit, for shorter turns.
AB_KINDS = ("TurboQuantKVCache k8v4 dense", "QuantizedKVCache 4-bit g64", "KVCache")
#: The same factories over this package's caches: a name and a factory of T positions' room.
KINDS: dict[str, Callable[[int], caches.Cache]] = {
    name: partial(factory, caches) for name, factory in KIND_FACTORIES.items()
}


@dataclass
class Row:
    """One measurement: per-layer microseconds (one call for encodes), and its ratio to bare
    bf16 SDPA at the same context, timed taking turns with it (compiled steps: to the eager
    step; encodes: copy time / encode time); bytes per token of
    the kind; for reads, the byte floor (the kind's bytes at the plain-read bandwidth) over
    the read's device time (wall time less the host's graph building, `host_us`)."""

    table: str
    what: str
    context: int
    us: float
    ratio: float
    bytes_per_token: int = 0
    floor_fraction: float = 0.0
    host_us: float = 0.0
    #: A kind's step and read rows: bare bf16 SDPA's time per layer in the same turns, the
    #: ratio's denominator (a busy machine slows both alike). Compiled rows: its fastest
    #: turn beside theirs (none with --compiled-only); chained rows: chained alike.
    bare_us: float = 0.0
    #: Compiled rows: the eager step's wall and host time in the same turns (chained rows:
    #: its wall time).
    eager_us: float = 0.0
    eager_host_us: float = 0.0
    #: Compiled rows: the least CPU time of a compiled step over the eager one's.
    cpu_ratio: float = 0.0
    #: Rate rows: the context the added time is measured from.
    from_context: int = 0
    #: Overlapped rows: peak memory above what was held before the steps, per layer (MiB).
    extra_mib: float = 0.0


def median_seconds(run: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    """Median wall time of one evaluated call of `run`, after `warmup` calls."""
    return timed(run, repeats, warmup)[0]


@dataclass
class Samples:
    """One run's measured calls: wall times, times to build the graph on the host, and the
    process's CPU time (all its threads), which other processes on the cores do not add to."""

    times: list[float]
    builds: list[float]
    cpu_times: list[float]


def samples(runs: Sequence[Callable[[], object]], repeats: int, warmup: int = 2) -> list[Samples]:
    """Per run: `repeats` evaluated calls after `warmup` calls; the runs take turns, so
    that a busy machine slows them alike."""
    for _ in range(warmup):
        for run in runs:
            mx.eval(run())
    measured = [Samples([], [], []) for _ in runs]
    for _ in range(repeats):
        for run, sample in zip(runs, measured, strict=True):
            cpu = time.process_time()
            start = time.perf_counter()
            graph = run()
            built = time.perf_counter()
            mx.eval(graph)
            sample.times.append(time.perf_counter() - start)
            sample.builds.append(built - start)
            sample.cpu_times.append(time.process_time() - cpu)
    return measured


def overlapped(run: Callable[[], object], steps: int) -> tuple[float, int]:
    """Steps of a decode loop as mlx-lm's generate runs them: each built and handed to MLX
    (`mx.async_eval`) while the one before still runs, so that building a step overlaps
    the device's work on the last. Seconds per step over `steps` steps (after one), and the
    peak memory above what was held before them, in bytes (0 where arrays held before were
    freed and the steps never reached that much again)."""
    mx.eval(run())
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    for _ in range(steps):
        out = run()
        mx.async_eval(out)
    mx.eval(out)
    return (time.perf_counter() - start) / steps, max(0, mx.get_peak_memory() - held)


def overlapped_row(
    name: str,
    context: int,
    step: Callable[[], object],
    bare_run: Callable[[], object],
    layers: int,
    steps: int,
    per_token: int,
) -> Row:
    """A kind's step overlapped (`overlapped`) against bare SDPA overlapped alike, taking
    turns three times: the fastest of each, and the kind's least extra memory."""
    kind, bare = [], []
    for _ in range(3):
        bare.append(overlapped(bare_run, steps))
        kind.append(overlapped(step, steps))
    fastest, bare_fastest = min(t for t, _ in kind), min(t for t, _ in bare)
    return Row(
        "overlapped",
        name,
        context,
        fastest / layers * 1e6,
        fastest / bare_fastest,
        per_token,
        bare_us=bare_fastest / layers * 1e6,
        extra_mib=min(extra for _, extra in kind) / layers / 2**20,
    )


def median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def timed(run: Callable[[], object], repeats: int, warmup: int = 2) -> tuple[float, float]:
    """Medians of (wall time of one evaluated call, time to build its graph on the host)."""
    (sample,) = samples([run], repeats, warmup)
    return median(sample.times), median(sample.builds)


def taking_turns(
    runs: Sequence[Callable[[], object]], repeats: int, warmup: int = 2
) -> list[tuple[float, float, float]]:
    """Per run, the runs taking turns: the fastest wall time of one evaluated call, the
    median time to build its graph and the least CPU time of a call."""
    return [
        (min(sample.times), median(sample.builds), min(sample.cpu_times))
        for sample in samples(runs, repeats, warmup)
    ]


#: Plain reads of one float32 buffer, reductions whose result is a few bytes. MLX's
#: reduction kernels differ in how close they come to the memory's rate, so the bench
#: takes the fastest as the read bandwidth that floors are measured against.
PLAIN_READS: dict[str, Callable[[mx.array], mx.array]] = {
    "max of all": mx.max,
    "max of each 16k row": lambda x: mx.max(x.reshape(-1, 2**14), axis=1),
    "sum of each 1k column": lambda x: mx.sum(x.reshape(2**10, -1), axis=0),
}


def read_bandwidth(megabytes: int, repeats: int) -> float:
    """Bytes per second that the fastest plain read (PLAIN_READS) streams: the bytes a read
    of twice `megabytes` of float32 adds over a read of `megabytes`, over the time it adds
    (each size's fastest call, the two taking turns), so that an evaluation's fixed cost in
    MLX (about a third of a 1 GiB read's wall time on the H200) does not count as reading.
    Prints each read's rate; a read whose larger call took no longer (noise, on a small
    buffer) is not measured, and none measured is an error."""
    elements = megabytes * 2**18
    smaller = mx.random.uniform(shape=(elements,))
    larger = mx.random.uniform(shape=(2 * elements,))
    mx.eval(smaller, larger)
    rates: dict[str, float | None] = {}
    for name, read in PLAIN_READS.items():
        # The two sizes take turns: a busy moment slows both.
        runs = [lambda x=x, read=read: read(x) for x in (smaller, larger)]
        fastest = [min(sample.times) for sample in samples(runs, repeats)]
        added = fastest[1] - fastest[0]
        rates[name] = (larger.nbytes - smaller.nbytes) / added if added > 0 else None
    print(
        "plain reads, the rate of the bytes a read of twice as many adds: "
        + ", ".join(
            f"{name} " + (f"{rate / 1e12:.2f} TB/s" if rate else "not measured")
            for name, rate in rates.items()
        )
    )
    measured = [rate for rate in rates.values() if rate]
    if not measured:
        raise RuntimeError("no plain read took longer for twice the bytes: no bandwidth")
    return max(measured)


def random_kv(positions: int) -> tuple[mx.array, mx.array]:
    shape = (1, KV_HEADS, positions, HEAD_DIM)
    k = mx.random.normal(shape).astype(mx.bfloat16)
    v = mx.random.normal(shape).astype(mx.bfloat16)
    mx.eval(k, v)
    return k, v


def quantized_attention(q: mx.array, keys: tuple, values: tuple, scale: float) -> mx.array:
    """mlx-lm's quantized SDPA for one query: grouped heads, quantized matmuls, softmax."""
    B, Hq, L, D = q.shape
    groups = Hq // KV_HEADS
    q = (q * scale).reshape(B, KV_HEADS, groups, L, D)
    k_q = tuple(a[:, :, None] for a in keys)
    v_q = tuple(a[:, :, None] for a in values)
    scores = mx.quantized_matmul(q, *k_q, transpose=True, group_size=64, bits=4)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(weights, *v_q, transpose=False, group_size=64, bits=4)
    return out.reshape(B, Hq, L, D)


def baseline_rows(
    context: int, layers: int, repeats: int, q: mx.array, kv: tuple[mx.array, mx.array]
) -> tuple[list[Row], Callable[[], list[mx.array]], Callable[[], list[mx.array]]]:
    """Bare bf16 SDPA and mlx-lm's quantized attention over LAYERS buffers of their own; and
    the bare SDPA's runs, which each kind's step and read then take turns with: the layers
    independent, and chained (each layer's query the layer before's output)."""
    scale = HEAD_DIM**-0.5
    buffers = [(kv[0] + 0, kv[1] + 0) for _ in range(layers)]
    quantized = [
        (mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4))
        for k, v in buffers
    ]
    mx.eval(buffers, quantized)

    def bare_run() -> list[mx.array]:
        return [sdpa(q, k, v) for k, v in buffers]

    def bare_chained() -> list[mx.array]:
        return [chained(q, [partial(sdpa, k=k, v=v) for k, v in buffers])]

    def mlx_lm_run() -> list[mx.array]:
        return [quantized_attention(q, k, v, scale) for k, v in quantized]

    bare = median_seconds(bare_run, repeats) / layers
    mlx_lm = median_seconds(mlx_lm_run, repeats) / layers
    rows = [
        Row("step", "bare bf16 SDPA (no append)", context, bare * 1e6, 1.0),
        Row("step", "mlx-lm quantized attention 4-bit g64", context, mlx_lm * 1e6, mlx_lm / bare),
    ]
    return rows, bare_run, bare_chained


def sdpa(q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    """Bare bf16 SDPA of one layer."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5)


def chained(q: mx.array, layers: Sequence[Callable[[mx.array], mx.array]]) -> mx.array:
    """The layers in order, each attending with the output of the one before as its query
    (an attention output has its query's shape), in the first query's dtype, as a model's
    layers run (a TurboQuant read answers in float32, TQC-2: that is one op more a layer
    there; a conversion to the dtype an array has makes none)."""
    dtype = q.dtype
    for layer in layers:
        q = layer(q).astype(dtype)
    return q


def step_rows(
    context: int,
    kinds: dict[str, Callable[[int], caches.Cache]],
    layers: int,
    repeats: int,
    bandwidth: float,
    compiled_only: bool = False,
) -> list[Row]:
    """The decode-step table at one context: baselines, then each of `kinds`' step, read
    and compiled step; with `compiled_only`, the compiled steps alone."""
    scale = HEAD_DIM**-0.5
    q = mx.random.normal((1, QUERY_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
    k1, v1 = random_kv(1)
    prefill_k, prefill_v = random_kv(context)
    rows: list[Row] = []
    if not compiled_only:
        rows, bare_run, bare_chained = baseline_rows(
            context, layers, repeats, q, (prefill_k, prefill_v)
        )

    for name, factory in kinds.items():
        # Room for every step the tables take (the overlapped ones: three turns of repeats + 1).
        layer_caches = [factory(context + 9 * repeats + 24) for _ in range(layers)]
        for cache in layer_caches:
            cache.append_window(prefill_k, prefill_v)
        mx.eval([cache.state().arrays for cache in layer_caches])

        def eager_step(cs: list = layer_caches) -> list[mx.array]:
            return [c.append_decode(k1, v1).attend(q, scale) for c in cs]

        per_token = layer_caches[0].bytes_per_token()
        if not compiled_only:
            rows += eager_rows(
                name, context, layer_caches, eager_step, q, repeats, bandwidth, bare_run
            )
        # With the baselines, bare SDPA takes turns too: the compiled step's ratio to it.
        turns = taking_turns(
            [eager_step, compiled_step(layer_caches, k1, v1, q)]
            + ([] if compiled_only else [bare_run]),
            repeats,
        )
        (eager, eager_host, eager_cpu), (compiled, compiled_host, compiled_cpu) = turns[:2]
        bare = turns[2][0] / layers * 1e6 if len(turns) > 2 else 0.0
        rows.append(
            Row(
                "compiled",
                name,
                context,
                compiled / layers * 1e6,
                compiled / eager,
                per_token,
                host_us=compiled_host / layers * 1e6,
                eager_us=eager / layers * 1e6,
                eager_host_us=eager_host / layers * 1e6,
                cpu_ratio=compiled_cpu / eager_cpu,
                bare_us=bare,
            )
        )
        if not compiled_only:
            rows.append(
                overlapped_row(name, context, eager_step, bare_run, layers, repeats, per_token)
            )
            rows.append(
                chained_row(name, context, layer_caches, (k1, v1, q), repeats, bare_chained)
            )
        for cache in layer_caches:
            cache.check()
        del layer_caches
    return rows


def eager_rows(
    name: str,
    context: int,
    layer_caches: list[caches.Cache],
    eager_step: Callable[[], list[mx.array]],
    q: mx.array,
    repeats: int,
    bandwidth: float,
    bare_run: Callable[[], list[mx.array]],
) -> list[Row]:
    """A kind's eager step over `layer_caches` (median of `repeats`) and, on the caches it
    leaves, the read's attention alone against its byte floor; each taking turns with
    `bare_run`, bare SDPA over as many layers, its ratio's denominator."""
    scale = HEAD_DIM**-0.5
    layers = len(layer_caches)
    per_token = layer_caches[0].bytes_per_token()
    k1, v1 = random_kv(1)

    def row(table: str, what: str, run: Callable[[], object], floored: bool) -> Row:
        bare, measured = samples([bare_run, run], repeats)
        wall, host = median(measured.times) / layers, median(measured.builds) / layers
        # The kernels' share of a read: its wall time less building the graph on the host.
        floor = per_token * layer_caches[0].offset / bandwidth / max(wall - host, 1e-9)
        return Row(
            table,
            what,
            context,
            wall * 1e6,
            wall / (median(bare.times) / layers),
            per_token,
            floor if floored else 0.0,
            host * 1e6,
            bare_us=median(bare.times) / layers * 1e6,
        )

    rows = [row("step", name, eager_step, False)]
    reads = [c.append_decode(k1, v1) for c in layer_caches]
    rows.append(row("attend", name, lambda: [r.attend(q, scale) for r in reads], True))
    cores = [cuda_core_attend(read, q, scale) for read in reads]
    if all(cores):

        def attend_on_cores() -> list[mx.array]:
            return [attend() for attend in cores]

        rows.append(row("attend", f"{name} on CUDA cores", attend_on_cores, True))
    return rows


def chained_row(
    name: str,
    context: int,
    layer_caches: list[caches.Cache],
    inputs: tuple[mx.array, mx.array, mx.array],
    repeats: int,
    bare_chained: Callable[[], list[mx.array]],
) -> Row:
    """A kind's compiled and eager steps with the layers chained, taking turns with bare
    SDPA chained alike (fastest of the turns): a layer's kernels wait for the layer before,
    as in a model, and cannot overlap another layer's."""
    k, v, q = inputs
    layers = len(layer_caches)

    def eager() -> list[mx.array]:
        return [chained(q, [chained_layer(cache, k, v) for cache in layer_caches])]

    turns = taking_turns(
        [eager, compiled_step(layer_caches, k, v, q, chain=True), bare_chained], repeats
    )
    (eager_s, _, _), (compiled_s, _, _), (bare_s, _, _) = turns
    return Row(
        "chained",
        name,
        context,
        compiled_s / layers * 1e6,
        compiled_s / bare_s,
        layer_caches[0].bytes_per_token(),
        eager_us=eager_s / layers * 1e6,
        bare_us=bare_s / layers * 1e6,
    )


def cuda_core_attend(read: object, q: mx.array, scale: float) -> Callable[[], mx.array] | None:
    """The read's decode attention on the CUDA-core body, where the tensor-core body would
    take it (READ-7 on CUDA); None elsewhere."""
    if not isinstance(read, StoredRead):
        return None
    _, kv_heads, _, keys, values, _ = attention_kernels.stored_formats(read.stored)
    if not (
        attention_kernels.supported(keys, values, kv_heads, q.shape[1])
        and attention_kernels.tensor_core_fit(keys, values)
    ):
        return None
    return lambda: read.attend(q, scale, tensor_cores=False)


def chained_layer(cache: object, k: mx.array, v: mx.array) -> Callable[[mx.array], mx.array]:
    """One layer's decode step as a function of its query; `cache` is a cache or its
    stand-in inside the compiled graph (COMPILE-4)."""
    return lambda query: cache.append_decode(k, v).attend(query, HEAD_DIM**-0.5)


def compiled_step(
    layer_caches: list[caches.Cache],
    k: mx.array,
    v: mx.array,
    q: mx.array,
    chain: bool = False,
    compile_step: Callable[..., Any] = compile_decode,
) -> Callable[[], list[mx.array]]:
    """The same decode step over every layer as one compiled graph (spec COMPILE-6): the
    layers independent, or with `chain` each attending with the output of the one before.
    `compile_step` is a version's `compile_decode` (tools/tree_ab.py: another's)."""

    def step_fn(traces: list, k: mx.array, v: mx.array, q: mx.array) -> list[mx.array]:
        layers = [chained_layer(trace, k, v) for trace in traces]
        return [chained(q, layers)] if chain else [layer(q) for layer in layers]

    # A partial keeps the compiled step in sight (`.func.graphs`: the graphs traced so far).
    return partial(compile_step(step_fn, layer_caches), k, v, q)


def encode_rows(positions: int, repeats: int) -> list[Row]:
    """Prefill encode of `positions` positions (keys and values together) against a copy of
    the same input bytes, the copy and the encoders taking turns (a busy machine slows them
    alike); ratio = copy time / encode time (1 means copy bandwidth)."""
    k, v = random_kv(positions)
    # The caches' encode: on CUDA one record per position (the fields' views would cost
    # a copy each where evaluated), elsewhere the fields.
    if fused_kernels_enabled():
        tq_name, tq_encode = (
            "turboquant encode_record_deferred k8v4",
            turboquant.encode_record_deferred,
        )
    else:
        tq_name, tq_encode = "turboquant encode_deferred k8v4", turboquant.encode_deferred
    encoders = {
        tq_name: lambda: tq_encode(k, v, 8, 4),
        "affine quantize_deferred 4-bit g64 (k, v)": lambda: (
            affine.quantize_deferred(k, 64, 4),
            affine.quantize_deferred(v, 64, 4),
        ),
    }
    runs = [lambda: (k + 0, v + 0)] + [lambda r=run: _arrays(r()) for run in encoders.values()]
    copy, *encoded = (median(sample.times) for sample in samples(runs, repeats))
    return [
        Row("encode", name, positions, seconds * 1e6, copy / seconds)
        for name, seconds in zip(encoders, encoded, strict=True)
    ]


def _arrays(result: object) -> list[mx.array]:
    """Every mx.array inside nested tuples and TurboQuantTensors."""
    if isinstance(result, mx.array):
        return [result]
    if isinstance(result, turboquant.TurboQuantTensor):
        return list(vars(result).values())
    return [a for part in result for a in _arrays(part)]


def rate_rows(rows: list[Row], bandwidth: float) -> list[Row]:
    """Per read and per pair of consecutive contexts, the time the read adds per layer from
    the shorter to the longer and the rate at which that streams its stored bytes, as a
    fraction of the plain read (`ratio`): the kernels' own rate, free of the costs of a call
    that each context's floor counts (graph building aside, MLX's evaluation and the
    launches), where both contexts' reads are bound by their kernels. A short context's read
    is bound by those costs instead, and the time added from it understates what the bytes
    cost (on the H200, 4k: docs/performance-log.md)."""
    reads: dict[str, list[Row]] = {}
    for row in rows:
        if row.table == "attend":
            reads.setdefault(row.what, []).append(row)
    rates = []
    for what, measured in reads.items():
        by_context = sorted(measured, key=lambda row: row.context)
        for shorter, longer in pairwise(by_context):
            added_us = longer.us - shorter.us
            if longer.context == shorter.context or added_us <= 0:
                continue
            streamed = longer.bytes_per_token * (longer.context - shorter.context)
            rate = streamed / (added_us * 1e-6)
            rates.append(
                Row(
                    "rate",
                    what,
                    longer.context,
                    added_us,
                    rate / bandwidth,
                    longer.bytes_per_token,
                    from_context=shorter.context,
                )
            )
    return rates


def print_rates(rows: list[Row], bandwidth: float) -> None:
    """The rate table (`rate_rows`)."""
    width = max(len(row.what) for row in rows)
    print(
        "\nrate: the time a read adds per layer from one context to the next, and its stored "
        "bytes' rate over it (ratio: of the plain read bandwidth; a kernel's rate only where "
        "both contexts' reads are bound by their kernels, not by a call's costs)"
    )
    header = (
        f"{'':{width}}  {'from':>7}  {'context':>7}  {'added us':>8}  {'TB/s':>6}  {'ratio':>6}"
    )
    print(header)
    for row in rows:
        rate = row.ratio * bandwidth / 1e12
        print(
            f"{row.what:{width}}  {row.from_context:7d}  {row.context:7d}  {row.us:8.1f}  "
            f"{rate:6.2f}  {row.ratio:6.2f}"
        )


def print_rows(rows: list[Row]) -> None:
    """The rows, table by table."""
    width = max(len(row.what) for row in rows)
    for table in ("step", "compiled", "overlapped", "chained", "attend", "encode"):
        chosen = [row for row in rows if row.table == table]
        if not chosen:
            continue
        if table == "compiled":
            print_compiled(chosen, width)
            continue
        if table == "overlapped":
            print_overlapped(chosen, width)
            continue
        if table == "chained":
            print_chained(chosen, width)
            continue
        if table == "encode":
            print("\nencode: one call over all positions  (ratio: copy time / encode time)")
        else:
            print(
                f"\n{table}: per layer  (ratio: x bare bf16 SDPA, timed taking turns with it: "
                "bare; floor: byte floor / device)"
            )
        header = (
            f"{'context':>7}  {'us':>8}  {'ratio':>6}  {'B/token':>7}  {'floor':>5}  "
            f"{'host':>5}  {'bare':>6}"
        )
        print(f"{'':{width}}  {header}")
        for row in chosen:
            floor = f"{row.floor_fraction:5.2f}" if row.floor_fraction else ""
            per_token = str(row.bytes_per_token) if row.bytes_per_token else ""
            host = f"{row.host_us:5.1f}" if row.host_us else ""
            bare = f"{row.bare_us:6.1f}" if row.bare_us else ""
            print(
                f"{row.what:{width}}  {row.context:7d}  {row.us:8.1f}  {row.ratio:6.2f}  "
                f"{per_token:>7}  {floor:>5}  {host:>5}  {bare:>6}"
            )


def print_compiled(rows: list[Row], width: int) -> None:
    """The compiled table: each kind's compiled and eager step of the same turns."""
    print(
        "\ncompiled: the step as one compiled graph against the eager step, per layer, "
        "fastest of the turns  (ratio: compiled / eager; cpu: the same of the least CPU "
        "time, steadier where other processes share the CPU; host: eager -> compiled; "
        "x bare: compiled / bare bf16 SDPA taking the same turns)"
    )
    header = (
        f"{'context':>7}  {'compiled':>9}  {'eager':>9}  {'ratio':>6}  {'cpu':>5}  "
        f"{'host us':>15}  {'x bare':>6}"
    )
    print(f"{'':{width}}  {header}")
    for row in rows:
        host = f"{row.eager_host_us:.1f} -> {row.host_us:.1f}"
        bare = f"{row.us / row.bare_us:6.2f}" if row.bare_us else ""
        print(
            f"{row.what:{width}}  {row.context:7d}  {row.us:9.1f}  {row.eager_us:9.1f}  "
            f"{row.ratio:6.2f}  {row.cpu_ratio:5.2f}  {host:>15}  {bare:>6}"
        )


def print_overlapped(rows: list[Row], width: int) -> None:
    """The overlapped table: each kind's eager step as a decode loop overlaps steps."""
    print(
        "\noverlapped: the eager step per layer with each step built while the one before "
        "runs (mx.async_eval, as mlx-lm's generate), fastest of three turns  (ratio: x bare "
        "bf16 SDPA overlapped alike; extra MiB: the least of the turns' peak memory above "
        "the held arrays, per layer: a write MLX cannot make in place while the step before "
        "still reads the buffer copies it)"
    )
    print(f"{'':{width}}  {'context':>7}  {'us':>8}  {'ratio':>6}  {'bare':>6}  {'extra MiB':>9}")
    for row in rows:
        print(
            f"{row.what:{width}}  {row.context:7d}  {row.us:8.1f}  {row.ratio:6.2f}  "
            f"{row.bare_us:6.1f}  {row.extra_mib:9.1f}"
        )


def print_chained(rows: list[Row], width: int) -> None:
    """The chained table: each kind's steps with each layer's query the layer before's
    output, beside bare SDPA chained alike."""
    print(
        "\nchained: the steps per layer with each layer's query the output of the layer "
        "before, as a model runs them, fastest of the turns  (ratio: compiled / bare bf16 "
        "SDPA chained alike; eager x bare: the eager step's)"
    )
    header = (
        f"{'context':>7}  {'compiled':>9}  {'eager':>9}  {'bare':>7}  {'ratio':>6}  "
        f"{'eager x bare':>12}"
    )
    print(f"{'':{width}}  {header}")
    for row in rows:
        print(
            f"{row.what:{width}}  {row.context:7d}  {row.us:9.1f}  {row.eager_us:9.1f}  "
            f"{row.bare_us:7.1f}  {row.ratio:6.2f}  {row.eager_us / row.bare_us:12.2f}"
        )


def picks(text: str, name: str) -> bool:
    """Whether `--kinds` TEXT picks the kind `name`: the kind it names exactly, else every
    kind whose name contains it."""
    return name == text if text in KINDS else text in name


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of 1 or more (contexts, layers, repeats, positions:
    none of them can be 0)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def add_kinds_option(parser: argparse.ArgumentParser, default: Sequence[str]) -> None:
    """The --kinds option of the tools that time or build a few of the bench's kinds."""
    parser.add_argument(
        "--kinds",
        nargs="+",
        metavar="TEXT",
        help="bench's kinds whose names hold a TEXT (a whole name: that kind); by default "
        + ", ".join(default),
    )


def add_turn_options(parser: argparse.ArgumentParser, default_kinds: Sequence[str]) -> None:
    """The options of the tools that time a few of the bench's kinds taking turns at some
    contexts (host_floor.py, step_ablation.py): --contexts, --kinds, --layers, --turns,
    --json and --quick (`turn_shapes`)."""
    parser.add_argument("--contexts", type=at_least_one, nargs="+", default=[4096, 32768])
    add_kinds_option(parser, default_kinds)
    parser.add_argument("--layers", type=at_least_one, default=32)
    parser.add_argument("--turns", type=at_least_one, default=15)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, kernels stood in (CPU smoke run)"
    )


def turn_shapes(args: argparse.Namespace, stack: ExitStack) -> tuple[list[int], int, int]:
    """The contexts, layers and turns of `add_turn_options`' options; with --quick tiny ones,
    and the CUDA path's kernels stood in for the time of `stack`."""
    if not args.quick:
        return args.contexts, args.layers, args.turns
    from kvspec.conformance.stand_ins import cuda_path

    stack.enter_context(cuda_path())
    return [64], 2, 2


def write_rows(path: str | None, rows: Sequence[Any]) -> None:
    """--json: the device and `rows` to `path` (nothing without one)."""
    if path:
        with open(path, "w") as out:
            json.dump({"device": str(mx.default_device()), "rows": list(rows)}, out, indent=1)


def picked_kinds(
    parser: argparse.ArgumentParser, texts: Sequence[str] | None, default: Sequence[str]
) -> list[str]:
    """The bench's kinds that --kinds TEXTs pick (`default`'s without any), in the bench's
    order; a parser error where none is picked."""
    kinds = [kind for kind in KINDS if any(picks(text, kind) for text in texts or default)]
    if not kinds:
        parser.error(f"no kind matches {texts}; kinds: {', '.join(KINDS)}")
    return kinds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--contexts", type=at_least_one, nargs="+", default=[1024, 4096, 16384, 32768, 131072]
    )
    parser.add_argument("--layers", type=at_least_one, default=32)
    parser.add_argument("--repeats", type=at_least_one, default=15)
    parser.add_argument("--encode-positions", type=at_least_one, default=32768)
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (CPU smoke run)")
    parser.add_argument(
        "--compiled-only",
        action="store_true",
        help="only the compiled step against the eager step, per kind",
    )
    parser.add_argument(
        "--kinds",
        nargs="+",
        metavar="TEXT",
        help="only the kinds whose names contain a TEXT (a TEXT that is a whole name: that kind)",
    )
    args = parser.parse_args(argv)
    kinds = {
        name: factory
        for name, factory in KINDS.items()
        if not args.kinds or any(picks(text, name) for text in args.kinds)
    }
    if not kinds:
        parser.error(f"no kind matches {args.kinds}; kinds: {', '.join(KINDS)}")
    if args.quick:
        args.contexts, args.layers, args.repeats, args.encode_positions = [64], 2, 2, 64
    print(f"device: {mx.default_device()}  mlx {mx.__version__}  layers {args.layers}")
    # Only the read table's byte floor needs the bandwidth.
    bandwidth = 0.0
    if not args.compiled_only:
        bandwidth = read_bandwidth(4 if args.quick else 1024, args.repeats)
        print(f"plain read bandwidth: {bandwidth / 1e12:.2f} TB/s")
    rows = []
    # Each context's tables as soon as they are measured: a run cut short keeps them.
    for context in args.contexts:
        measured = step_rows(
            context, kinds, args.layers, args.repeats, bandwidth, args.compiled_only
        )
        print_rows(measured)
        rows += measured
    rates = rate_rows(rows, bandwidth) if not args.compiled_only else []
    if rates:
        print_rates(rates, bandwidth)
        rows += rates
    if not args.compiled_only:
        measured = encode_rows(args.encode_positions, args.repeats)
        print_rows(measured)
        rows += measured
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": str(mx.default_device()),
                    "bandwidth": bandwidth,
                    "rows": [asdict(row) for row in rows],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
