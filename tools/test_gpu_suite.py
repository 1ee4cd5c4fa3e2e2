"""tools/gpu_suite.py: a run within its budget writes its summary; a budget too short to
start a test says so; parts cover the selection once and merge into one summary; a run
takes up the rest of others; the selection names files that exist and docs/gpu.md lists
them."""

from __future__ import annotations

import json
from pathlib import Path

import gpu_suite
import pytest

#: Two fast tests, one of which skips where MLX has no CUDA device.
TESTS = (
    "conformance/test_masks.py::test_causal_mask_by_hand",
    "conformance/test_turboquant.py::test_fused_decode_equals_plain_decode",
)


def _summary(folder: Path) -> dict:
    return json.loads((folder / "summary.json").read_text())


def test_a_run_writes_its_summary(tmp_path: Path) -> None:
    status = gpu_suite.main(["--budget", "120", "--out", str(tmp_path), *TESTS])
    summary = _summary(tmp_path)
    counts = summary["counts"]
    assert counts["passed"] >= 1
    assert counts["passed"] + counts["skipped"] == 2
    (run,) = summary["runs"]
    assert status == 0 and run["stopped"] == "complete" and run["budget_s"] == 120
    assert summary["mlx"] != "unknown" and summary["device"] != "unknown"
    assert summary["date"].startswith("20") and summary["max_examples"] == 10
    snippet = (tmp_path / "summary.md").read_text()
    assert f"MLX {summary['mlx']} on {summary['device']}" in snippet
    assert "| conformance/test_masks.py | 1 | 0 |" in snippet


def test_a_spent_budget_runs_nothing_and_says_so(tmp_path: Path) -> None:
    """With a margin as long as the budget allows, no test may start."""
    argv = ["--budget", "100", "--margin", "99.9", "--out", str(tmp_path), *TESTS]
    assert gpu_suite.main(argv) == 3
    summary = _summary(tmp_path)
    assert summary["runs"][0]["stopped"] == "budget"
    assert summary["counts"]["not run"] == 2 and summary["counts"]["passed"] == 0


def test_parts_cover_the_tests_once_and_merge(tmp_path: Path) -> None:
    """Two parts run one test each; their merge counts both and lists both runs."""
    folders = [tmp_path / "1", tmp_path / "2"]
    for k, folder in enumerate(folders, start=1):
        argv = ["--budget", "120", "--part", f"{k}/2", "--out", str(folder), *TESTS]
        assert gpu_suite.main(argv) == 0
        assert sum(_summary(folder)["counts"].values()) == 1
    merged = tmp_path / "all"
    argv = ["--merge", *map(str, folders), "--out", str(merged)]
    assert gpu_suite.main(argv) == 0
    summary = _summary(merged)
    assert summary["counts"]["passed"] + summary["counts"]["skipped"] == 2
    assert [run["part"] for run in summary["runs"]] == ["1/2", "2/2"]
    assert set(summary["files"]) == {test.partition("::")[0] for test in TESTS}


def test_a_run_takes_up_the_rest_of_another(tmp_path: Path) -> None:
    """--rest-of leaves out what the runs named passed or skipped: after a run of the first
    half, the rest of it runs the other test alone, and after both nothing is left, which
    is no failure; a folder with no log is bad usage."""
    first, rest = tmp_path / "first", tmp_path / "rest"
    assert gpu_suite.main(["--budget", "120", "--part", "1/2", "--out", str(first), *TESTS]) == 0
    argv = ["--budget", "120", "--rest-of", str(first), "--out", str(rest), *TESTS]
    assert gpu_suite.main(argv) == 0
    assert gpu_suite.finished([first]) == {TESTS[0]}
    assert gpu_suite.finished([rest]) == {TESTS[1]}
    assert gpu_suite.finished([first, rest]) == set(TESTS)
    (run,) = _summary(rest)["runs"]
    assert run["left_out"] == 1 and run["stopped"] == "complete"
    argv = [
        "--budget",
        "120",
        "--rest-of",
        str(first),
        str(rest),
        "--out",
        str(tmp_path / "none_left"),
    ]
    assert gpu_suite.main([*argv, *TESTS]) == 0
    (run,) = _summary(tmp_path / "none_left")["runs"]
    assert run["left_out"] == 2 and run["stopped"] == "nothing left"
    assert "2 finished before left out" in (tmp_path / "none_left" / "summary.md").read_text()
    argv = ["--budget", "120", "--rest-of", str(tmp_path / "none"), "--out", str(rest), *TESTS]
    assert gpu_suite.main(argv) == 2


def test_outcomes_from_the_log() -> None:
    """A test started but never reported (its run killed at the budget) is interrupted; a
    failing setup is an error; a collection error counts as one."""
    ids = ["t.py::ok", "t.py::fails", "t.py::setup_fails", "t.py::killed", "t.py::later"]

    def report(test_id: str, when: str, outcome: str) -> dict:
        return {"event": "report", "id": test_id, "when": when, "outcome": outcome}

    events = [
        {"event": "collected", "ids": ids},
        {"event": "collect-error", "id": "u.py", "message": "SyntaxError"},
        *({"event": "start", "id": test_id} for test_id in ids[:4]),
        report("t.py::ok", "call", "passed"),
        report("t.py::ok", "teardown", "passed"),
        report("t.py::fails", "call", "failed"),
        report("t.py::fails", "teardown", "passed"),
        report("t.py::setup_fails", "setup", "failed"),
        report("t.py::setup_fails", "teardown", "passed"),
        report("t.py::killed", "setup", "passed"),
    ]
    for event in events:
        event.setdefault("seconds", 1.0)
        event.setdefault("message", "")
    got = {test_id: test["outcome"] for test_id, test in gpu_suite.outcomes(events).items()}
    assert got == {
        "u.py": "error",
        "t.py::ok": "passed",
        "t.py::fails": "failed",
        "t.py::setup_fails": "error",
        "t.py::killed": "interrupted",
        "t.py::later": "not run",
    }


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--budget", "0"],
        ["--budget", "10", "--margin", "10"],
        ["--budget", "10", "--examples", "0"],
        ["--budget", "10", "--part", "3/2"],
        ["--merge", "a", "--budget", "10"],
        ["--merge", "a", "--rest-of", "b"],
    ],
)
def test_bad_usage_exits_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_suite.main(argv)
    assert exit_info.value.code == 2


def test_runs_of_other_platforms_do_not_merge(tmp_path: Path) -> None:
    platform = {"mlx": "0.32.4", "hypothesis": "6", "default_device": "gpu", "profile": "quick"}
    for device in ("AMD EPYC", "NVIDIA H200"):
        (tmp_path / device).mkdir()
        summary = {**platform, "device": device, "max_examples": 10}
        (tmp_path / device / "summary.json").write_text(json.dumps(summary))
    folders = [str(tmp_path / "AMD EPYC"), str(tmp_path / "NVIDIA H200")]
    assert gpu_suite.main(["--merge", *folders, "--out", str(tmp_path / "all")]) == 2


def test_every_selected_file_exists_and_is_documented() -> None:
    documented = (gpu_suite.PROJECT / "docs" / "gpu.md").read_text()
    for name, reaches in gpu_suite.GPU_TESTS:
        assert (gpu_suite.PROJECT / name).is_file(), name
        assert f"| `{name}` | {reaches} |" in documented, name
