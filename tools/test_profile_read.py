"""tools/profile_read.py: a read of every bench kind runs and reports its shape (on the CPU
the portable path: what a profiler would time only means something on the GPU machine), and
bad counts are refused before anything runs."""

from __future__ import annotations

import profile_read
import pytest
from bench import KINDS


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_read_of_every_kind_runs(kind: str, capsys) -> None:
    assert profile_read.main([kind, "--context", "40", "--reads", "2"]) == 0
    assert capsys.readouterr().out.strip() == (
        f"{kind}: 2 reads of 41 positions, 8 KV heads, 32 query heads, output (1, 32, 1, 128)"
    )


@pytest.mark.parametrize("counts", [["--context", "0"], ["--reads", "0"]])
def test_bad_counts_are_refused(counts: list[str]) -> None:
    with pytest.raises(SystemExit):
        profile_read.main(["KVCache", *counts])


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(SystemExit):
        profile_read.main(["NoSuchCache"])
