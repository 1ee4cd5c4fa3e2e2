"""Decode-attention launch shapes on CUDA: the same reads timed under each number of warps
per block, blocks in all and largest splits per head (spec READ-7's kernels; the shapes
change no stored bit and no output beyond READ-1's bound, only the time).

Each format's cache is filled to the context on 32 layers, one decode read is taken per
layer, and the reads' attention is evaluated together; the figure is the fastest of the
repeats less the time to build the graph, per layer (device µs).

    python tools/launch_shapes.py --contexts 32768 131072
    python tools/launch_shapes.py --shapes 4/528/128 8/264/128
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import mlx.core as mx
from bench import at_least_one, samples

from kvspec.accelerated import attention_kernels, caches

LAYERS = 32
FORMATS: dict[str, Callable[[], caches.Cache]] = {
    "bf16": caches.KVCache,
    "affine 4-bit g64": lambda: caches.QuantizedKVCache(64, 4, checks="deferred"),
    "affine 8-bit g64": lambda: caches.QuantizedKVCache(64, 8, checks="deferred"),
    "TurboQuant k8v4": lambda: caches.TurboQuantKVCache(8, 4, "dense", checks="deferred"),
}
DEFAULT_SHAPES = ["4/528/128", "4/264/128", "4/1056/256", "8/264/128", "8/528/256", "2/1056/256"]


def shape(text: str) -> tuple[int, int, int]:
    """'WARPS/BLOCKS/SPLITS' as three positive ints."""
    parts = text.split("/")
    if len(parts) != 3 or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"a shape is WARPS/BLOCKS/SPLITS, got {text!r}")
    warps, blocks, splits = (int(part) for part in parts)
    return warps, blocks, splits


def device_us(run: Callable[[], list[mx.array]], repeats: int) -> float:
    """Fastest evaluated call of `run` less its fastest graph building, µs per layer."""
    (sample,) = samples([run], repeats)
    return (min(sample.times) - min(sample.builds)) / LAYERS * 1e6


def use_shape(launch_shape: tuple[int, int, int]) -> None:
    """Warps per block, blocks in all and splits per head for the kernels made from now on:
    the kernels and read plans made under another shape are dropped."""
    attention_kernels.WARPS, attention_kernels.TARGET_BLOCKS, attention_kernels.MAX_SPLITS = (
        launch_shape
    )
    for made in attention_kernels.KERNEL_CACHES:
        made.cache_clear()


def format_times(
    factory: Callable[[], caches.Cache],
    k: mx.array,
    new: mx.array,
    q: mx.array,
    shapes: Sequence[tuple[int, int, int]],
    repeats: int,
) -> list[float]:
    """Device µs per layer of one format's 32 reads under each launch shape."""
    layer_caches = [factory() for _ in range(LAYERS)]
    for cache in layer_caches:
        cache.append_window(k, k)
    reads = [cache.append_decode(new, new) for cache in layer_caches]
    mx.eval([cache.state().arrays for cache in layer_caches])
    times = []
    for launch_shape in shapes:
        use_shape(launch_shape)
        times.append(device_us(lambda: [read.attend(q, 128**-0.5) for read in reads], repeats))
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=at_least_one, nargs="+", default=[32768, 131072])
    parser.add_argument(
        "--shapes", type=shape, nargs="+", default=[shape(s) for s in DEFAULT_SHAPES]
    )
    parser.add_argument("--repeats", type=at_least_one, default=9)
    args = parser.parse_args(argv)
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        parser.error("the decode-attention kernels run on CUDA only; this device has none")
    default = (
        attention_kernels.WARPS,
        attention_kernels.TARGET_BLOCKS,
        attention_kernels.MAX_SPLITS,
    )
    q = mx.random.normal((1, 32, 1, 128)).astype(mx.bfloat16)
    header = "  ".join(f"{w}/{b}/{s}" for w, b, s in args.shapes)
    try:
        for context in args.contexts:
            k = mx.random.normal((1, 8, context, 128)).astype(mx.bfloat16)
            new = mx.random.normal((1, 8, 1, 128)).astype(mx.bfloat16)
            print(f"\ncontext {context}: device µs per layer under warps/blocks/splits\n  {header}")
            for name, factory in FORMATS.items():
                times = format_times(factory, k, new, q, args.shapes, args.repeats)
                print(f"  {'  '.join(f'{t:9.0f}' for t in times)}  {name}")
    finally:
        use_shape(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
