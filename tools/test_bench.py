"""tools/bench.py: the quick mode runs every path on the CPU and reports every row (shapes
only: times mean nothing here)."""

from __future__ import annotations

import json
from pathlib import Path

import bench
import pytest


def test_quick_run_reports_every_kind(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    steps = {row["what"] for row in rows if row["table"] == "step"}
    assert set(bench.KINDS) <= steps
    assert {"bare bf16 SDPA (no append)", "mlx-lm quantized attention 4-bit g64"} <= steps
    compiled = [row for row in rows if row["table"] == "compiled"]
    assert {row["what"] for row in compiled} == set(bench.KINDS)
    assert all(row["eager_us"] > 0 for row in compiled)
    # The compiled steps take turns with bare SDPA too.
    assert all(row["bare_us"] > 0 for row in compiled)
    reads = [row for row in rows if row["table"] == "attend"]
    assert {row["what"] for row in reads} == set(bench.KINDS)
    for row in rows:
        assert row["us"] > 0 and row["ratio"] > 0
    for row in reads:
        assert row["bytes_per_token"] > 0 and row["floor_fraction"] > 0
    # A kind's step and read rows are timed taking turns with bare SDPA, their denominator.
    for row in [*reads, *(row for row in rows if row["what"] in bench.KINDS)]:
        if row["table"] in ("step", "attend"):
            assert row["bare_us"] > 0
            assert row["ratio"] == pytest.approx(row["us"] / row["bare_us"])
    assert {row["what"] for row in rows if row["table"] == "encode"} == {
        "turboquant encode_deferred k8v4",
        "affine quantize_deferred 4-bit g64 (k, v)",
    }
    assert "plain read bandwidth" in capsys.readouterr().out


def test_compiled_only_reports_compiled_against_eager(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert bench.main(["--quick", "--compiled-only", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {row["table"] for row in rows} == {"compiled"}
    assert {row["what"] for row in rows} == set(bench.KINDS)
    for row in rows:
        assert row["us"] > 0 and row["eager_us"] > 0 and row["cpu_ratio"] > 0
        assert row["ratio"] == pytest.approx(row["us"] / row["eager_us"])
        assert row["bare_us"] == 0  # no baselines: nothing to take turns with
    assert "compiled / eager" in capsys.readouterr().out


def test_kinds_picks_kinds_by_name(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["--quick", "--compiled-only", "--kinds", "Rotating", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {row["what"] for row in rows} == {name for name in bench.KINDS if "Rotating" in name}
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--kinds", "no such kind"])


def test_a_whole_name_picks_that_kind_alone() -> None:
    assert [name for name in bench.KINDS if bench.picks("KVCache", name)] == ["KVCache"]
    contained = [name for name in bench.KINDS if bench.picks("QuantizedKVCache 4-bit", name)]
    assert contained == [name for name in bench.KINDS if "QuantizedKVCache 4-bit" in name]
    assert len(contained) > 1
