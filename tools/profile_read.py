"""One decode read of one cache, evaluated a few times over, for a profiler to time its
kernels: Nsight Compute on the GPU machine, where MLX runs the read's pass-1 kernel and its
merge once per evaluation (docs/performance-log.md, "What bounds the quantized reads").

    ncu --kernel-name regex:decode_attention --launch-skip 2 --launch-count 1 \\
        --section WarpStateStats --section SchedulerStats --section Occupancy \\
        python tools/profile_read.py "TurboQuantKVCache k8v4 dense" --context 131072

The kind is one of bench's (tools/bench.py); the cache holds `--context` positions and one
decode position, as bench's step table fills it, and is read with bench's query shape.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import mlx.core as mx
from bench import HEAD_DIM, KINDS, KV_HEADS, QUERY_HEADS, random_kv


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(KINDS), metavar="KIND")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--reads", type=int, default=3, help="evaluations of the read")
    args = parser.parse_args(argv)
    if args.context < 1 or args.reads < 1:
        parser.error("--context and --reads take positive counts")
    keys, values = random_kv(args.context)
    new_key, new_value = random_kv(1)
    query = mx.random.normal((1, QUERY_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
    cache = KINDS[args.kind](args.context + 1)
    cache.append_window(keys, values)
    read = cache.append_decode(new_key, new_value)
    mx.eval(cache.state().arrays)
    for _ in range(args.reads):
        out = read.attend(query, HEAD_DIM**-0.5)
        mx.eval(out)
    print(
        f"{args.kind}: {args.reads} reads of {args.context + 1} positions, "
        f"{KV_HEADS} KV heads, {QUERY_HEADS} query heads, output {tuple(out.shape)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
