"""tools/mutants.py: every catalogued fault still applies to the code, and a fast subset is
caught by the ci profile's examples on a fixed draw (profile mutants-fixed), so a catch in CI
never depends on the run's luck (the whole catalogue: docs/mutants.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mutants
import pytest

#: One fault of each kind whose catching tests run in seconds: rounding in a codec's
#: reference and in the MLX encoder, a shared ring, a ring's mask with keep, a shared
#: trim, a shared state's slot order, and the MLX attention's scale.
FAST_SUBSET = (
    "affine-round-half-away",
    "mlx-turboquant-key-round-half-away",
    "ring-wraps-early",
    "ring-mask-wraps-to-zero",
    "trim-past-offset",
    "affine-state-swaps-scales-biases",
    "mlx-attention-scale",
    "cuda-affine-scaled-weights-half-offset",
)


def test_every_mutant_applies_once() -> None:
    names = [mutant.name for mutant in mutants.CATALOGUE]
    assert len(names) == len(set(names))
    for mutant in mutants.CATALOGUE:
        text = (mutants.PROJECT / mutant.path).read_text()
        assert text.count(mutant.before) == 1, f"{mutant.name} no longer applies"
        if mutant.before.endswith("\n"):
            # A whole-line fault must match whole lines: a re-indented line still contains
            # the old text and would be cut mid-indent.
            assert ("\n" + text).count("\n" + mutant.before) == 1, f"{mutant.name} cuts a line"
        for test in mutant.tests:
            assert (mutants.PROJECT / test.partition("::")[0]).is_file(), test


def test_every_test_a_mutant_names_is_collected() -> None:
    """A node id that names no test (a renamed test, a parametrization's id changed) would
    make a mutant's run exit with pytest's usage error and read as an error, not a catch:
    every named test is collected."""
    tests = sorted({test for mutant in mutants.CATALOGUE for test in mutant.tests})
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *tests],
        cwd=mutants.PROJECT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_the_copy_is_what_imports(tmp_path: Path) -> None:
    project, path = mutants.copy_project(tmp_path)
    assert (path / "kvspec" / "reference").resolve() == (project / "reference").resolve()
    assert (project / "conformance" / "cache_machine.py").is_file()


def test_a_copy_keeps_the_import_path_it_was_given(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A copy's run imports the copy first and still finds what the environment's path
    held (MLX unpacked apart, as on the GPU machine): a run that cannot import MLX would
    fail its tests and read as caught."""
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    env = mutants.copy_environment(tmp_path, "quick")
    assert env["PYTHONPATH"].split(os.pathsep) == [str(tmp_path), "/opt/site"]
    assert env["HYPOTHESIS_PROFILE"] == "quick"
    monkeypatch.delenv("PYTHONPATH")
    assert mutants.copy_environment(tmp_path, "quick")["PYTHONPATH"] == str(tmp_path)


@pytest.mark.parametrize("name", FAST_SUBSET)
def test_fast_subset_is_caught(name: str) -> None:
    (mutant,) = mutants.select([name])
    result, _ = mutants.run_tests(mutant, "mutants-fixed", timeout=300)
    assert result == "caught", f"{name}: {result}"


def test_every_kernel_mutant_names_a_test_of_the_emulated_kernels() -> None:
    """A fault in a CUDA kernel's source is caught anywhere: by the kernels' tests on a GPU,
    by the emulated kernels' elsewhere; or, a fault in how the compiler builds them, which
    the emulator (built without contraction) cannot see, by the offline builds' tests
    (`tools/test_cuda_build.py`, wherever nvcc is)."""
    caught_by = (mutants.EMULATED, "tools/test_cuda_build.py")
    for mutant in mutants.CATALOGUE:
        if mutant.path.endswith(".cuh"):
            assert any(test.startswith(caught_by) for test in mutant.tests), mutant.name
