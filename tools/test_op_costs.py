"""tools/op_costs.py: the quick run prints a host cost for every op it times (the figures
mean something only on the GPU machine)."""

from __future__ import annotations

import mlx.core as mx
import op_costs


def test_quick_run_prints_every_row(capsys) -> None:
    assert op_costs.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.rsplit(None, 1)[0].strip(): float(line.rsplit(None, 1)[1]) for line in lines[2:]}
    expected = {
        "slice a[:, :, :4000]",
        "mx.slice_update",
        "a[:, :, 5:6] = x",
        "eval 1 small ops, per op",
        "eval 32 small ops, per op",
        "eval 128 small ops, per op",
        "eval 32 slice writes in place, per write",
        "eval 32 slice writes at an array start, per write",
        "eval 32 slice views, per view",
        "eval 32 slice views as float16, per view",
    }
    assert expected <= set(rows)
    assert any("cuda_kernel" in name for name in rows) == mx.cuda.is_available()
    assert all(us > 0 for us in rows.values())
