"""tools/padded_batch.py: the quick mode times both reads of a padded batch in one process
on the CPU (shapes only: times mean nothing here), rings included."""

from __future__ import annotations

import json
from pathlib import Path

import padded_batch


def test_quick_run_times_both_reads_of_each_kind(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["--quick", "--kinds", "KVCache", "4-bit", "--json", str(out)]
    assert padded_batch.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    kinds = ("KVCache", "QuantizedKVCache 4-bit g64", "RotatingQuantizedKVCache 4-bit g64")
    assert [(row["kind"], row["read"]) for row in rows] == [
        (kind, read) for kind in kinds for read in padded_batch.READS
    ]
    for row in rows:
        assert row["us"] > 0 and row["padding"] == [0, 8, 16, 32]
