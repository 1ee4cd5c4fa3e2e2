"""Side-by-side timings on MLX's default device, printed as ratios measured in one run.

Each row times kvspec's accelerated path against the MLX path it stands beside
(for the affine encoder, `mx.quantize`, which is fast but not bit-portable: spec
AFF-9). Absolute times mean something only on the GPU machine.

    python tools/bench.py --positions 4096 --repeats 20
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

import mlx.core as mx

from kvspec.accelerated import affine, turboquant


def seconds_per_call(run: Callable[[], object], repeats: int) -> float:
    """Median wall time of one evaluated call, after one warm-up."""
    mx.eval(run())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(run())
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def affine_rows(positions: int, repeats: int) -> list[tuple[str, float, float]]:
    """(what, kvspec seconds, MLX seconds) for encoding and reading KV-shaped arrays."""
    rows = []
    # MLX's CPU kernel on a GPU machine measures a device copy, not an encoder.
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    encoders = [e for e in affine.available_encoders() if on_cpu or e != "mlx_cpu"]
    kv = mx.random.normal((1, 8, positions, 128)).astype(mx.bfloat16)
    mx.eval(kv)
    for bits in (4, 8):
        theirs = seconds_per_call(lambda b=bits: mx.quantize(kv, group_size=64, bits=b), repeats)
        for encoder in encoders:
            ours = seconds_per_call(
                lambda b=bits, e=encoder: affine.quantize(kv, 64, b, encoder=e), repeats
            )
            rows.append((f"affine encode {bits}-bit g64 [{encoder}] vs mx.quantize", ours, theirs))
        stored = affine.quantize(kv, 64, bits)
        ours = seconds_per_call(lambda s=stored, b=bits: affine.dequantize(*s, 64, b), repeats)
        theirs = seconds_per_call(
            lambda s=stored, b=bits: mx.dequantize(*s, group_size=64, bits=b), repeats
        )
        rows.append((f"affine read {bits}-bit g64 vs mx.dequantize", ours, theirs))
    return rows


def turboquant_rows(positions: int, repeats: int) -> list[tuple[str, float, float]]:
    """TurboQuant k8v4 at head_dim 128: encode against the affine encoder, the fused
    decode against the plain one (CUDA only), and a decode read (decode, then one
    query's attention) against attention over the same window in bf16."""
    shape = (1, 8, positions, 128)
    k = mx.random.normal(shape).astype(mx.bfloat16)
    v = mx.random.normal(shape).astype(mx.bfloat16)
    mx.eval(k, v)
    rows = []
    encode = seconds_per_call(lambda: turboquant.encode(k, v, 8, 4), repeats)
    affine_encode = seconds_per_call(
        lambda: (affine.quantize(k, 64, 4), affine.quantize(v, 64, 4)), repeats
    )
    rows.append(("turboquant encode k8v4 vs affine 4-bit g64 (k and v)", encode, affine_encode))
    stored = turboquant.encode(k, v, 8, 4)
    mx.eval(stored.k_idx, stored.k_scales, stored.k_zeros, stored.v_packed, stored.v_scales)
    fields = (stored.k_idx, stored.k_scales, stored.k_zeros, stored.v_packed, stored.v_scales)
    if turboquant.fused_decode_enabled():
        fused = seconds_per_call(lambda: turboquant.decode(stored, positions, 128), repeats)
        plain = seconds_per_call(
            lambda: turboquant.decode_plain(*fields, 8, 4, 128, False), repeats
        )
        rows.append(("turboquant decode k8v4 fused vs plain", fused, plain))
    queries = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    scale = 128**-0.5

    def turbo_read():
        keys, values = turboquant.decode(stored, positions, 128)
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale)

    def bf16_read():
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)

    rows.append(
        (
            "turboquant decode read (decode + sdpa) vs bf16 sdpa",
            seconds_per_call(turbo_read, repeats),
            seconds_per_call(bf16_read, repeats),
        )
    )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    print(f"device: {mx.default_device()}  mlx {mx.__version__}  positions {args.positions}")
    rows = affine_rows(args.positions, args.repeats) + turboquant_rows(args.positions, args.repeats)
    width = max(len(name) for name, _, _ in rows)
    print(f"{'':{width}}  {'kvspec us':>10}  {'baseline us':>11}  {'ratio':>6}")
    for name, ours, theirs in rows:
        print(f"{name:{width}}  {ours * 1e6:10.1f}  {theirs * 1e6:11.1f}  {ours / theirs:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
