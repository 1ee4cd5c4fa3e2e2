"""tools/compare_turboquant.py on a small workload: every stored field agrees, and the
read errors are the codec's."""

from __future__ import annotations

import compare_turboquant


def test_rows_on_a_small_workload() -> None:
    workload = compare_turboquant.default_workload(0, [64])
    rows, differs = compare_turboquant.turboquant_rows(workload, [4, 8], [3], ["bfloat16"])
    assert not differs
    assert len(rows) == 2 and all(len(r) == len(compare_turboquant.COLUMNS) for r in rows)
    for row in rows:
        assert row[4:9] == ["0"] * 5
        assert 0 < float(row[10]) < 0.04  # 3-bit values
    assert [r[-1] for r in rows] == ["4.250", "6.250"]  # (k_bits + 1 + 3 + 0.5) / 2
