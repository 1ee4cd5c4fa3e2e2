"""tools/mutant_sweep.py: the faults a sweep makes of a module, each one swap on one code
line that occurs once, and none of its docstrings, comments, imports, signatures,
assertions or raises."""

from __future__ import annotations

import re
from pathlib import Path

import mutant_sweep
import mutants
import pytest

SOURCE = '''"""A module whose docstring says a < b and x == y."""

import os  # not swapped: a < b


def pick(a: int, b: int, strict: bool = False) -> int:
    """True when a <= b."""
    assert a is not None
    if a <= b and not strict:
        return min(a, b + 1)
    total = 0
    total = 0
    if a is None:
        raise ValueError(
            "a > b and not"
            f"{a} < {b}"
        )
    note = "x == y"
    return max(a, b)  # a == b
'''


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "module.py").write_text(SOURCE)
    monkeypatch.setattr(mutant_sweep, "PROJECT", tmp_path)
    return tmp_path


def test_a_sweep_swaps_each_operator_of_each_code_line(project: Path) -> None:
    made = mutant_sweep.faults("pkg/module.py", ["tests"])
    swapped = [(mutant.before.strip(), mutant.after.strip()) for mutant in made]
    line = "if a <= b and not strict:"
    assert swapped == [
        (line, "if a < b and not strict:"),
        (line, "if a <= b or not strict:"),
        (line, "if a <= b and strict:"),
        ("return min(a, b + 1)", "return max(a, b + 1)"),
        ("return min(a, b + 1)", "return min(a, b - 1)"),
        ("if a is None:", "if a is not None:"),
        ("return max(a, b)  # a == b", "return min(a, b)  # a == b"),
    ]
    assert [mutant.name for mutant in made][:2] == ["pkg.module.py-L9-1", "pkg.module.py-L9-6"]
    assert all(re.fullmatch(r"[\w.-]+", mutant.name) for mutant in made)
    for mutant in made:
        # Each applies as the catalogue's faults do: its line, once.
        assert SOURCE.count(mutant.before) == 1
        assert mutant.tests == ("tests",)
        assert isinstance(mutant, mutants.Mutant)


def test_a_sweep_takes_files_of_the_project_alone(project: Path) -> None:
    assert mutant_sweep.project_path("pkg/module.py") == "pkg/module.py"
    assert mutant_sweep.project_path(str(project / "pkg" / "module.py")) == "pkg/module.py"
    with pytest.raises(ValueError, match="not a Python file of the project"):
        mutant_sweep.project_path("pkg/absent.py")
    (project.parent / "outside.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="not a Python file of the project"):
        mutant_sweep.project_path(str(project.parent / "outside.py"))


def test_listing_the_faults_of_a_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert mutant_sweep.main(["accelerated/caches/rotating.py", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert listed and all(line.startswith("accelerated.caches.rotating.py-L") for line in listed)


def test_a_fault_runs_in_a_copy_of_its_own() -> None:
    """A fault's name names its copy's directory, which goes on the import path: the copy
    must be what its run imports (a name with a colon once cut that path, and every fault
    of a sweep read as an error)."""
    split_test = "conformance/test_read_launches.py::test_a_read_is_split_as_the_spec_says"
    fault = mutant_sweep.faults("accelerated/caches/rotating.py", [split_test])[0]
    # The ring's flag is no concern of the split count: the run must get to say so.
    assert mutants.run_tests(fault, "quick", 300)[0] == "missed"
