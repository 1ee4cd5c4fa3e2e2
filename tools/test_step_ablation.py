"""tools/step_ablation.py: the quick mode runs every variant on the CUDA path with stand-in
kernels (shapes only: times mean nothing here), and each variant leaves out exactly the ops
it names, for the time of its block only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import step_ablation


def test_quick_run_times_bare_sdpa_and_every_variant(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    kinds = ["KVCache", "TurboQuantKVCache k8v4 dense"]
    argv = ["--quick", "--steps", "eager", "compiled", "--kinds", *kinds, "--json", str(out)]
    assert step_ablation.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    names = ["bare SDPA", *step_ablation.VARIANTS]
    assert [(row["step"], row["kind"], row["variant"]) for row in rows] == [
        (step, kind, name) for step in ("eager", "compiled") for kind in kinds for name in names
    ]
    assert all(row["context"] == 64 and row["us"] > 0 and row["host_us"] > 0 for row in rows)


@pytest.mark.parametrize("variant", list(step_ablation.VARIANTS))
def test_a_variant_leaves_out_its_ops_and_only_in_its_block(variant: str) -> None:
    import mlx.core as mx
    from bench import HEAD_DIM, KINDS, random_kv

    from kvspec.conformance.stand_ins import cuda_path

    parts = step_ablation.VARIANTS[variant]
    with cuda_path() as launches:
        cache = KINDS["QuantizedKVCache 4-bit g64"](64)
        prefill, _ = random_kv(16)
        cache.append_window(prefill, prefill)
        new, _ = random_kv(1)
        queries = mx.zeros((1, 32, 1, HEAD_DIM), mx.bfloat16)

        def launched(prefix: str) -> int:
            return sum(n for name, n in launches.items() if name.startswith(prefix))

        def step() -> tuple[mx.array, mx.array]:
            before = cache._record
            launches.clear()
            return before, cache.append_decode(new, new).attend(queries, HEAD_DIM**-0.5)

        rows: list[mx.array] = []
        with step_ablation.leaving_out(parts, rows):
            before, output = step()
        assert (cache._record is before) == ("write" in parts)
        assert len(rows) == ("write" in parts and "encode" not in parts)
        assert launched("kvspec_decode_attention") == 1
        assert launched("kvspec_decode_merge") == ("merge" not in parts)
        # An unmerged read answers pass 1's partial sums [B Hq, splits, DV + 2].
        merged_shape = (1, 32, 1, HEAD_DIM)
        assert (output.shape == merged_shape) == ("merge" not in parts)
        assert output.shape[::2] == ((32, HEAD_DIM + 2) if "merge" in parts else (1, 1))

        before, output = step()
        assert cache._record is not before and output.shape == merged_shape
        assert launched("kvspec_decode_merge") == 1
