"""A pytest plugin for tools/gpu_suite.py: logs every test's start and outcome as JSON
lines as they happen (so a run killed at its deadline still says what ran), stops
starting tests past a deadline, and caps hypothesis's examples.

Configured through the environment, so it can be named with `-p gpu_budget`:
KVSPEC_GPU_LOG (the log's path), KVSPEC_GPU_STOP_AT (a time.time() after which no test
starts), KVSPEC_GPU_EXAMPLES (the most examples per property; unset leaves the profile's),
KVSPEC_GPU_PART (K/N: keep the K-th of N consecutive slices of the collected tests),
KVSPEC_GPU_FINISHED (a file of test ids, one a line, to leave out before the slicing: what
earlier runs finished).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest

LOG_ENV = "KVSPEC_GPU_LOG"
STOP_AT_ENV = "KVSPEC_GPU_STOP_AT"
EXAMPLES_ENV = "KVSPEC_GPU_EXAMPLES"
PART_ENV = "KVSPEC_GPU_PART"
FINISHED_ENV = "KVSPEC_GPU_FINISHED"
#: The reason pytest prints when the budget stops the session.
STOPPED = "the time budget is spent"


def _log(event: dict[str, Any]) -> None:
    with open(os.environ[LOG_ENV], "a", encoding="utf-8") as log:
        log.write(json.dumps(event) + "\n")
        log.flush()


def pytest_configure(config: pytest.Config) -> None:
    """Log what the tests run on; cap the loaded profile's examples (the suite's conftest
    has loaded it by now)."""
    import hypothesis
    import mlx.core as mx

    from kvspec.accelerated.device import fused_kernels_enabled

    _log(
        {
            "event": "platform",
            "mlx": mx.__version__,
            "hypothesis": hypothesis.__version__,
            "device": str(mx.device_info().get("device_name", "unknown")),
            "default_device": str(mx.default_device()),
            "fused_kernels": fused_kernels_enabled(),
        }
    )
    examples = os.environ.get(EXAMPLES_ENV)
    if examples:
        current = hypothesis.settings.default
        capped = min(current.max_examples, int(examples))
        hypothesis.settings.register_profile("gpu-suite", parent=current, max_examples=capped)
        hypothesis.settings.load_profile("gpu-suite")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _log({"event": "collect-error", "id": report.nodeid, "message": _message(report)})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the tests earlier runs finished, then keep the part's slice of the rest."""
    finished_file = os.environ.get(FINISHED_ENV)
    if finished_file:
        with open(finished_file, encoding="utf-8") as listed:
            finished = set(listed.read().splitlines())
        left_out = [item for item in items if item.nodeid in finished]
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if item.nodeid not in finished]
        _log({"event": "left-out", "count": len(left_out)})
    k, _, n = os.environ.get(PART_ENV, "1/1").partition("/")
    start, end = len(items) * (int(k) - 1) // int(n), len(items) * int(k) // int(n)
    config.hook.pytest_deselected(items=items[:start] + items[end:])
    items[:] = items[start:end]


def pytest_collection_finish(session: pytest.Session) -> None:
    _log({"event": "collected", "ids": [item.nodeid for item in session.items]})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    """Past the deadline, run nothing more: the test is left out and the session stops."""
    if time.time() > float(os.environ.get(STOP_AT_ENV, "inf")):
        item.session.shouldstop = STOPPED
        return True
    return None


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _log({"event": "start", "id": nodeid, "time": time.time()})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _log(
        {
            "event": "report",
            "id": report.nodeid,
            "when": report.when,
            "outcome": report.outcome,
            "seconds": report.duration,
            "message": _message(report),
        }
    )


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    """A skip's reason, or a failure's last line."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    if report.failed:
        return " ".join(report.longreprtext.strip().splitlines()[-1:])
    return ""
