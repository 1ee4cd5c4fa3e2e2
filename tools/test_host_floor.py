"""tools/host_floor.py: the quick mode records an eager step's launches on the CUDA path
with stand-in kernels and replays them (shapes only: times mean nothing here)."""

from __future__ import annotations

import json
from pathlib import Path

import host_floor


def test_quick_run_replays_each_kinds_launches(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["--quick", "--kinds", "KVCache", "TurboQuantKVCache k8v4 dense", "--json", str(out)]
    assert host_floor.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    # Per layer: pass 1 and its merge; a coded kind's encode besides (test_step_ops.py).
    assert {row["kind"]: row["launches"] for row in rows} == {
        "KVCache": 2.0,
        "TurboQuantKVCache k8v4 dense": 3.0,
    }
    for row in rows:
        assert row["context"] == 64
        times = ("eager_build_us", "replay_build_us", "eager_us", "replay_us", "bare_us")
        assert min(row[time] for time in times) > 0


def test_a_recorder_sees_only_what_is_launched_while_it_records() -> None:
    import mlx.core as mx

    from kvspec.conformance.stand_ins import cuda_path

    with cuda_path(), host_floor.recorded_launches() as recorder:
        kernel = mx.fast.cuda_kernel(name="k", input_names=["a"], output_names=["o"], source="")
        options = {
            "output_shapes": [(1,)],
            "output_dtypes": [mx.float32],
            "grid": (1, 1, 1),
            "threadgroup": (1, 1, 1),
        }
        kernel(inputs=[mx.zeros((1,))], **options)
        recorder.recording = True
        kernel(inputs=[mx.ones((2,))], **options)
    ((_, arguments),) = recorder.calls
    assert arguments["inputs"][0].shape == (2,)
