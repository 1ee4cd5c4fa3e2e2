"""tools/compare.py: zero mismatches on its default workload, exit 1 on a difference."""

from __future__ import annotations

from pathlib import Path

import compare
import numpy as np
import pytest


def test_default_workload_has_no_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--bits", "3", "4", "--dtypes", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "no stored field differs" in out
    assert "affine (AFF)" in out


def test_a_differing_word_fails(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    real = compare.accelerated_affine.quantize

    def flipped(w, group_size, bits):
        wq, scales, biases = real(w, group_size, bits)
        return wq ^ 1, scales, biases

    monkeypatch.setattr(compare.accelerated_affine, "quantize", flipped)
    assert compare.main(["--bits", "4", "--group-sizes", "64", "--dtypes", "float32"]) == 1
    assert "stored fields differ in: affine" in capsys.readouterr().out


def test_input_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "kv.npy"
    np.save(path, np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32))
    assert compare.main(["--input", str(path), "--bits", "8", "--group-sizes", "64"]) == 0
    assert "kv" in capsys.readouterr().out


def test_turboquant_rows_on_a_small_workload() -> None:
    pairs = compare.turboquant_workload(0, [64])
    table = compare.turboquant_table(pairs, [4, 8], [3], ["bfloat16"])
    assert not table.differs
    assert len(table.rows) == 2 and all(len(r) == len(table.columns) for r in table.rows)
    for row in table.rows:
        assert row[5:10] == ["0"] * 5
        assert 0 < float(row[11]) < 0.04  # 3-bit values
    assert [r[-1] for r in table.rows] == ["4.250", "6.250"]  # (k_bits + 1 + 3 + 0.5) / 2
