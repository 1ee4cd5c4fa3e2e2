"""tools/tree_ab.py: a revision's packages are written renamed beside this tree's, and the
quick mode times both versions' steps in one process on the CPU (shapes only: times mean
nothing here), their outputs alike where the versions compute alike."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tree_ab


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tree_ab.prepare("HEAD", tmp_path_factory.mktemp("trees"))


def test_a_prepared_version_imports_only_itself(head: Path) -> None:
    assert head.name == "kvspec_HEAD" and (head / "__init__.py").is_file()
    assert (head / "accelerated" / "cuda" / "decode_attention.cuh").is_file()
    for path in head.rglob("*.py"):
        text = path.read_text()
        assert "kvspec." not in text.replace("kvspec_HEAD.", ""), path


def test_quick_run_times_both_versions_with_equal_outputs(head: Path, tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["run", str(head), "--quick", "--kinds", "KVCache", "--json", str(out)]
    assert tree_ab.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {(row["step"], row["version"]) for row in rows} == {
        (step, version) for step in tree_ab.STEPS for version in ("this", "kvspec_HEAD")
    }
    for row in rows:
        assert 0 < row["fastest_us"] <= row["us"]
        assert row["max_diff"] == 0  # the same code, caches filled alike


def test_rings_of_a_window_wrap_in_both_versions(head: Path, tmp_path: Path) -> None:
    """--ring-window: rings hold that many positions (here 16 of a context of 64, so every
    step reads a wrapped ring) in both versions, their outputs alike."""
    out = tmp_path / "rows.json"
    argv = ["run", str(head), "--quick", "--kinds", "Rotating", "KVCache", "--ring-window"]
    assert tree_ab.main([*argv, "16", "--steps", "eager", "compiled", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    windows = {row["kind"]: row["ring_window"] for row in rows}
    assert windows == {
        "KVCache": None,
        "RotatingKVCache": 16,
        "RotatingQuantizedKVCache 4-bit g64": 16,
    }
    assert all(row["max_diff"] == 0 for row in rows)


def test_what_cannot_be_prepared_or_run_is_refused(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tree_ab.main(["prepare", "no-such-revision", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "git archive no-such-revision" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        tree_ab.main(["run", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "is not a version `prepare` wrote" in capsys.readouterr().err
