"""tools/launch_shapes.py: shapes parse as WARPS/BLOCKS/SPLITS, and where MLX has no CUDA
device the tool refuses (the kernels it times run on CUDA only)."""

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
