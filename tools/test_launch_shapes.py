"""tools/launch_shapes.py: shapes parse as WARPS/BLOCKS/SPLITS, where MLX has no CUDA device
the tool refuses (the kernels it times run on CUDA only), and on the CUDA path (kernels
stood in) the reads it times launch each shape's grid."""

from __future__ import annotations

import argparse

import launch_shapes
import mlx.core as mx
import pytest


def test_shapes_parse() -> None:
    assert launch_shapes.shape("8/264/128") == (8, 264, 128)
    for bad in ("8/264", "8/x/128", "0/264/128", "8/264/128/1"):
        with pytest.raises(argparse.ArgumentTypeError):
            launch_shapes.shape(bad)


@pytest.mark.skipif(mx.cuda.is_available(), reason="times the kernels on CUDA")
def test_refuses_without_cuda(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launch_shapes.main(["--contexts", "64"])
    assert exit_info.value.code == 2
    assert "CUDA only" in capsys.readouterr().err


def test_each_shape_launches_its_own_grid() -> None:
    """On the CUDA path (kernels stood in): the same reads, timed under each shape, launch
    pass 1 with that shape's threads and splits, not with the first shape's."""
    from kvspec.accelerated import attention_kernels
    from kvspec.conformance.stand_ins import cuda_path, kernels_made_by, zero_outputs

    launched: set[tuple[int, int]] = set()

    def make(name: str, input_names, output_names, source: str, header: str = "", **_):
        def launch(*, inputs, output_shapes, output_dtypes, grid, threadgroup, **options):
            if name.startswith("kvspec_decode_attention"):
                threads = threadgroup[0]
                launched.add((threads // 32, grid[0] // threads))
            return zero_outputs(output_shapes, output_dtypes)

        return launch

    shapes = [(4, 528, 128), (8, 264, 128), (2, 66, 4)]
    default = (
        attention_kernels.WARPS,
        attention_kernels.TARGET_BLOCKS,
        attention_kernels.MAX_SPLITS,
    )
    k = mx.zeros((1, 2, 300, 128), mx.bfloat16)
    new = mx.zeros((1, 2, 1, 128), mx.bfloat16)
    q = mx.zeros((1, 4, 1, 128), mx.bfloat16)
    try:
        with cuda_path(), kernels_made_by(make):
            launch_shapes.format_times(launch_shapes.FORMATS["bf16"], k, new, q, shapes, 1)
    finally:
        launch_shapes.use_shape(default)
    # Warps a block and splits a head, planned for the buffers' 512 rows (300 and the room
    # they grew by): 8 splits of MIN_SPLIT 64 where the shape allows them, 4 where it
    # allows no more.
    assert launched == {(4, 8), (8, 8), (2, 4)}
