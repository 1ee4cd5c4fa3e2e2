"""Run the conformance tests that reach MLX's CUDA paths within a time budget, and write
their summary as JSON and as a Markdown snippet for docs/gpu.md.

    .venv/bin/python tools/gpu_suite.py --budget 540              # on the GPU machine
    .venv/bin/python tools/gpu_suite.py --budget 540 --part 2/3 --out part2
    .venv/bin/python tools/gpu_suite.py --merge part1 part2 part3 --out gpu-suite
    .venv/bin/python tools/gpu_suite.py --budget 540 --rest-of part1 part2 --out part4

One pytest run over GPU_TESTS in their order (the CUDA kernels first, so that a short
budget reaches them), under the quick hypothesis profile with at most --examples examples
per property. No test starts once budget - margin seconds have passed; a test still
running when the budget is spent is stopped with the run and reported as interrupted.
Where MLX has no CUDA device the CUDA-only tests skip and the rest run on the CPU.
`--part K/N` runs the K-th of N consecutive slices of the collected tests (neighbours
share kernel instances, which NVRTC compiles once per process), so several calls can
cover the selection; `--rest-of DIR...` leaves out what earlier runs (their tests.jsonl)
passed or skipped, so that a run cut short by its budget is taken up where it stopped;
`--merge` adds their summaries into one.

Writes OUT/summary.json, OUT/summary.md (the snippet), OUT/tests.jsonl (each test's start
and outcome, as they happened) and OUT/pytest.txt (pytest's output). Exit status: 0 when
every selected test ran and none failed (or `--rest-of` left none), 1 when a test failed,
erred or was interrupted (or pytest could not run), 2 on bad usage, 3 when the budget ran
out first.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import gpu_budget

PROJECT = Path(__file__).resolve().parent.parent

#: (test file, what of the CUDA backend it reaches), in the order they run.
GPU_TESTS = (
    (
        "conformance/test_decode_step.py",
        "decode attention over stored fields (READ-7), within the bound at every head dim "
        "the kernels take and exact over one row; fused deferred encodes and checks "
        "(DEFER-1 .. DEFER-3)",
    ),
    (
        "conformance/test_turboquant.py",
        "the fused TurboQuant encode and decode (TQ-14); deferred-V attention (TQC-4)",
    ),
    (
        "conformance/test_records.py",
        "the records the CUDA encoders write and the kernels read (TQC-1, QKV-1)",
    ),
    (
        "conformance/test_counting_table.py",
        "the counts the kernels read (READ-7, COMPILE-3): views of a table in device memory",
    ),
    ("conformance/test_affine.py", "the CUDA affine encoder (AFF-9)"),
    ("conformance/test_edges.py", "ties, constant groups and float16 limits on the encoders"),
    ("conformance/test_compiled_step.py", "the compiled decode step (COMPILE-1 .. COMPILE-6)"),
    (
        "conformance/test_planned_append.py",
        "planned appends: the bits and launches of checked ones, with the CUDA encoders",
    ),
    ("conformance/test_caches_turboquant.py", "TurboQuant caches' state machine on the device"),
    ("conformance/test_caches_kv.py", "growable and affine caches' state machines"),
    ("conformance/test_caches_bf16_first.py", "bf16-first caches' state machines: the switch"),
    ("conformance/test_caches_rotating.py", "rings' state machines"),
)

#: What the log's platform event records (see gpu_budget.py).
PLATFORM = ("mlx", "hypothesis", "device", "default_device", "fused_kernels")
#: pytest's exit statuses for an internal error, bad usage and no tests collected.
USAGE_EXITS = (3, 4, 5)
NOTHING_COLLECTED = 5
#: How a run stopped that `--rest-of` left nothing to run.
NOTHING_LEFT = "nothing left"
#: Outcomes a test can end with here, in the order the summaries list them.
OUTCOMES = ("passed", "failed", "error", "skipped", "interrupted", "not run")


def part(text: str) -> tuple[int, int]:
    """K/N with 1 <= K <= N, for argparse."""
    k, slash, n = text.partition("/")
    if not (slash and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise argparse.ArgumentTypeError(f"a part is K/N with 1 <= K <= N, got {text!r}")
    return int(k), int(n)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, help="seconds the whole run may take")
    parser.add_argument(
        "--margin",
        type=float,
        default=None,
        help="no test starts in the budget's last MARGIN seconds (default: 30, at most a "
        "quarter of the budget)",
    )
    parser.add_argument(
        "--examples", type=int, default=10, help="most hypothesis examples per property"
    )
    parser.add_argument("--profile", default="quick", help="hypothesis profile (default quick)")
    parser.add_argument(
        "--part", type=part, default=(1, 1), help="run slice K of N of the tests (default 1/1)"
    )
    parser.add_argument(
        "--rest-of",
        nargs="+",
        type=Path,
        default=[],
        metavar="DIR",
        help="leave out the tests these earlier runs passed or skipped",
    )
    parser.add_argument(
        "--merge", nargs="+", type=Path, metavar="DIR", help="add up these runs' summaries"
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-suite"), help="summary folder")
    parser.add_argument("tests", nargs="*", help="pytest node ids to run instead of GPU_TESTS")
    args = parser.parse_args(argv)
    if args.merge:
        if args.budget is not None or args.tests or args.rest_of:
            parser.error("--merge takes summary folders only, no --budget, --rest-of or tests")
        return args
    if args.budget is None or args.budget <= 0:
        parser.error("--budget must be given and positive")
    if args.examples < 1:
        parser.error("--examples must be at least 1")
    if args.margin is None:
        args.margin = min(30.0, args.budget / 4)
    if not 0 <= args.margin < args.budget:
        parser.error("--margin must be at least 0 and less than --budget")
    return args


def run_pytest(
    args: argparse.Namespace, tests: Sequence[str], log: Path, done: set[str]
) -> tuple[int, bool]:
    """pytest's exit status, and whether the budget stopped it while a test ran; the tests
    in `done` are left out."""
    began = time.time()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(PROJECT / "tools"), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "HYPOTHESIS_PROFILE": args.profile,
        gpu_budget.LOG_ENV: str(log),
        gpu_budget.STOP_AT_ENV: str(began + args.budget - args.margin),
        gpu_budget.EXAMPLES_ENV: str(args.examples),
        gpu_budget.PART_ENV: "{}/{}".format(*args.part),
    }
    if done:
        listed = args.out / "finished.txt"
        listed.write_text("".join(f"{test_id}\n" for test_id in sorted(done)))
        env[gpu_budget.FINISHED_ENV] = str(listed)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    with open(args.out / "pytest.txt", "w", encoding="utf-8") as output:
        try:
            result = subprocess.run(
                [*command, "-p", "gpu_budget", *tests],
                cwd=PROJECT,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=args.budget - (time.time() - began),
                check=False,
            )
        except subprocess.TimeoutExpired:
            return -1, True
    return result.returncode, False


def outcomes(events: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each collected or started test's outcome, seconds and message, from the log."""
    tests: dict[str, dict[str, Any]] = {}
    for event in events:
        if event["event"] == "collect-error":
            tests[event["id"]] = {"outcome": "error", "seconds": 0.0, "message": event["message"]}
        elif event["event"] == "collected":
            for test_id in event["ids"]:
                tests.setdefault(test_id, {"outcome": "not run", "seconds": 0.0, "message": ""})
        elif event["event"] == "start":
            test = tests.setdefault(event["id"], {"seconds": 0.0, "message": ""})
            test["outcome"] = "interrupted"
        elif event["event"] == "report":
            test = tests[event["id"]]
            test["seconds"] += event["seconds"]
            test["message"] = test["message"] or event["message"]
            outcome, when = event["outcome"], event["when"]
            if outcome == "failed":
                test["outcome"] = "failed" if when == "call" else "error"
            elif when == "teardown" and test["outcome"] == "interrupted":
                test["outcome"] = "passed"
            elif outcome == "skipped":
                test["outcome"] = "skipped"
    return tests


def finished(folders: Sequence[Path]) -> set[str]:
    """The tests these runs' logs (DIR/tests.jsonl) say passed or were skipped."""
    done: set[str] = set()
    for folder in folders:
        lines = (folder / "tests.jsonl").read_text(encoding="utf-8").splitlines()
        tests = outcomes([json.loads(line) for line in lines if line])
        done.update(i for i, test in tests.items() if test["outcome"] in ("passed", "skipped"))
    return done


def summarize(
    args: argparse.Namespace,
    argv: Sequence[str],
    events: Sequence[dict[str, Any]],
    pytest_exit: int,
    killed: bool,
    elapsed: float,
) -> dict[str, Any]:
    """One run's summary: what ran where, and how each test file fared."""
    tests = outcomes(events)
    platform = next((e for e in events if e["event"] == "platform"), {})
    files: dict[str, Counter] = {}
    for test_id, test in tests.items():
        counts = files.setdefault(test_id.partition("::")[0], Counter())
        counts[test["outcome"]] += 1
        counts["seconds"] += test["seconds"]
    counts = Counter(test["outcome"] for test in tests.values())
    left_out = sum(event["count"] for event in events if event["event"] == "left-out")
    if killed:
        stopped = "killed at the budget"
    elif counts["not run"]:
        stopped = "budget"
    elif left_out and not tests and pytest_exit == NOTHING_COLLECTED:
        stopped = NOTHING_LEFT
    else:
        stopped = "complete"
    run = {
        "command": shlex.join(["python", "tools/gpu_suite.py", *argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "part": "{}/{}".format(*args.part),
        "budget_s": args.budget,
        "elapsed_s": round(elapsed, 1),
        "stopped": stopped,
        "pytest_exit": pytest_exit,
        "left_out": left_out,
    }
    return {
        "date": run["date"],
        **{key: platform.get(key, "unknown") for key in PLATFORM},
        "profile": args.profile,
        "max_examples": args.examples,
        "elapsed_s": run["elapsed_s"],
        "runs": [run],
        "counts": {outcome: counts[outcome] for outcome in OUTCOMES},
        "files": {name: dict(file_counts) for name, file_counts in files.items()},
        "skip_reasons": dict(
            Counter(test["message"] for test in tests.values() if test["outcome"] == "skipped")
        ),
        "problems": {
            test_id: f"{test['outcome']}: {test['message']}"
            for test_id, test in tests.items()
            if test["outcome"] in ("failed", "error", "interrupted")
        },
    }


def merge(summaries: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Several runs' summaries as one; they must share platform, profile and examples."""
    shared = ("mlx", "hypothesis", "device", "default_device", "profile", "max_examples")
    first = summaries[0]
    for summary in summaries[1:]:
        differs = [key for key in shared if summary[key] != first[key]]
        if differs:
            raise ValueError(f"the runs differ in {', '.join(differs)}: not one record")
    files: dict[str, Counter] = {}
    for summary in summaries:
        for name, file_counts in summary["files"].items():
            files.setdefault(name, Counter()).update(file_counts)
    skip_reasons: Counter = Counter()
    for summary in summaries:
        skip_reasons.update(summary["skip_reasons"])
    return {
        **{key: first[key] for key in ("fused_kernels", *shared)},
        "date": max(summary["date"] for summary in summaries),
        "elapsed_s": round(sum(summary["elapsed_s"] for summary in summaries), 1),
        "runs": [run for summary in summaries for run in summary["runs"]],
        "counts": {
            outcome: sum(summary["counts"][outcome] for summary in summaries)
            for outcome in OUTCOMES
        },
        "files": {name: dict(file_counts) for name, file_counts in files.items()},
        "skip_reasons": dict(skip_reasons),
        "problems": {k: v for summary in summaries for k, v in summary["problems"].items()},
    }


def markdown(summary: dict[str, Any]) -> str:
    """The summary as a snippet for docs/gpu.md."""
    counts = ", ".join(f"{n} {outcome}" for outcome, n in summary["counts"].items())
    kernels = {True: "fused kernels on", False: "fused kernels off"}
    runs = "; ".join(
        f"`{run['command']}` ({run['elapsed_s']:.0f} s of {run['budget_s']:.0f}, {run['stopped']}"
        + (f", {run['left_out']} finished before left out" if run.get("left_out") else "")
        + ")"
        for run in summary["runs"]
    )
    lines = [
        f"Result of {runs}, on {summary['date']}: MLX {summary['mlx']} on "
        f"{summary['device']} (default device {summary['default_device']}, "
        f"{kernels.get(summary['fused_kernels'], 'fused kernels unknown')}), hypothesis "
        f"{summary['hypothesis']}, profile {summary['profile']} at most "
        f"{summary['max_examples']} examples per property: {counts}.",
        "",
        "| test file | " + " | ".join(OUTCOMES) + " | seconds |",
        "|---|" + "---|" * (len(OUTCOMES) + 1),
    ]
    for name, file_counts in summary["files"].items():
        cells = " | ".join(str(file_counts.get(outcome, 0)) for outcome in OUTCOMES)
        lines.append(f"| {name} | {cells} | {file_counts.get('seconds', 0):.0f} |")
    for run in summary["runs"]:
        if run["pytest_exit"] in USAGE_EXITS and run["stopped"] != NOTHING_LEFT:
            lines += ["", f"`{run['command']}`: pytest exited with {run['pytest_exit']}."]
    if summary["skip_reasons"]:
        lines.append("")
        lines += [f"- skipped {n}: {reason}" for reason, n in summary["skip_reasons"].items()]
    if summary["problems"]:
        lines.append("")
        lines += [f"- `{test_id}`: {problem}" for test_id, problem in summary["problems"].items()]
    return "\n".join(lines) + "\n"


def exit_status(summary: dict[str, Any]) -> int:
    """0 all ran and passed (or `--rest-of` left none to run), 1 a problem (or pytest could
    not run), 3 the budget ran out."""
    counts = summary["counts"]
    if all(run["stopped"] == NOTHING_LEFT for run in summary["runs"]):
        return 0
    if counts["failed"] or counts["error"] or counts["interrupted"] or not summary["files"]:
        return 1
    if any(
        run["pytest_exit"] in USAGE_EXITS and run["stopped"] != NOTHING_LEFT
        for run in summary["runs"]
    ):
        return 1
    return 3 if counts["not run"] else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        try:
            summary = merge([json.loads((d / "summary.json").read_text()) for d in args.merge])
        except (OSError, ValueError) as error:
            print(f"gpu_suite.py: {error}", file=sys.stderr)
            return 2
    else:
        try:
            done = finished(args.rest_of)
        except (OSError, ValueError) as error:
            print(f"gpu_suite.py: {error}", file=sys.stderr)
            return 2
        log = args.out / "tests.jsonl"
        log.write_text("")
        began = time.monotonic()
        tests = args.tests or [n for n, _ in GPU_TESTS]
        pytest_exit, killed = run_pytest(args, tests, log, done)
        elapsed = time.monotonic() - began
        events = [json.loads(line) for line in log.read_text().splitlines() if line]
        summary = summarize(args, argv, events, pytest_exit, killed, elapsed)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return exit_status(summary)


if __name__ == "__main__":
    sys.exit(main())
