"""tools/kernel_ab.py: the quick mode reads every kind under each source on the CPU (shapes
only: times mean nothing here, and the portable path reads no kernel source), sources are
checked before anything runs, and the kernels' own sources are back in place after."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import kernel_ab
import pytest
from bench import AB_KINDS

from kvspec.accelerated import attention_kernels, cuda_source


def _copy_of_the_sources(tmp_path: Path, name: str) -> Path:
    directory = tmp_path / name
    shutil.copytree(cuda_source.CUDA_DIR, directory)
    return directory


def test_quick_run_reads_every_kind_under_each_source(tmp_path: Path) -> None:
    original = cuda_source.CUDA_DIR
    header = attention_kernels._INCLUDE
    a, b = (_copy_of_the_sources(tmp_path, name) for name in "ab")
    out = tmp_path / "rows.json"
    assert kernel_ab.main(["--quick", f"a={a}", f"b={b}", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert {(row["kind"], row["context"], row["source"]) for row in rows} == {
        (kind, context, name) for kind in AB_KINDS for context in (64, 96) for name in "ab"
    }
    for row in rows:
        assert row["us"] > 0 and row["bytes_per_token"] > 0
        assert row["max_diff"] == 0  # the same sources, the same outputs
    assert report["bandwidth"] > 0
    for rate in report["rates"]:  # bench's rate rows, one per kind and source
        assert rate["table"] == "rate" and rate["context"] == 96 and rate["ratio"] > 0
    assert original == cuda_source.CUDA_DIR
    assert header == attention_kernels._INCLUDE


@pytest.mark.parametrize("spec", ["nameless", "=dir", "a=/no/such/directory"])
def test_a_source_is_a_name_and_a_directory_of_the_kernels_files(spec: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        kernel_ab.main(["--quick", spec])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "a source is NAME=DIR" in error or "lacks decode_attention.cuh" in error


def test_sources_need_names_of_their_own(tmp_path: Path, capsys) -> None:
    a = _copy_of_the_sources(tmp_path, "a")
    with pytest.raises(SystemExit) as exit_info:
        kernel_ab.main(["--quick", f"x={a}", f"x={a}"])
    assert exit_info.value.code == 2
    assert "name of its own" in capsys.readouterr().err


def test_kinds_picks_as_bench_does(tmp_path: Path) -> None:
    a = _copy_of_the_sources(tmp_path, "a")
    out = tmp_path / "rows.json"
    argv = [f"a={a}", "--quick", "--kinds", "KVCache", "Rotating", "--json", str(out)]
    assert kernel_ab.main(argv) == 0
    kinds = {row["kind"] for row in json.loads(out.read_text())["rows"]}
    assert kinds == {"KVCache", "RotatingKVCache", "RotatingQuantizedKVCache 4-bit g64"}


@pytest.mark.parametrize("step", ["compiled", "chained"])
def test_quick_step_run_times_each_sources_compiled_step(tmp_path: Path, step: str) -> None:
    a, b = (_copy_of_the_sources(tmp_path, name) for name in "ab")
    out = tmp_path / "rows.json"
    argv = ["--quick", f"a={a}", f"b={b}", "--step", step, "--kinds", "KVCache", "--json"]
    assert kernel_ab.main([*argv, str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["step"] == step
    rows = report["rows"]
    assert {(row["context"], row["source"]) for row in rows} == {
        (context, name) for context in (64, 96) for name in "ab"
    }
    for row in rows:
        assert 0 < row["fastest_us"] <= row["us"]
        assert row["max_diff"] == 0  # the same sources, caches filled alike: the same outputs


@pytest.mark.parametrize("options", [["--contexts", "100"], ["--contexts", "64", "--turns", "29"]])
def test_a_step_run_stays_within_one_window_step(
    tmp_path: Path, options: list[str], capsys
) -> None:
    a = _copy_of_the_sources(tmp_path, "a")
    with pytest.raises(SystemExit) as exit_info:
        kernel_ab.main([f"a={a}", "--step", "compiled", *options])
    assert exit_info.value.code == 2
    assert "multiples of 32" in capsys.readouterr().err


def test_each_sources_reads_launch_that_sources_kernels(tmp_path: Path) -> None:
    """On the CUDA path (kernels stood in): under each source the reads launch decode
    kernels made from that source's files, not the ones the reads made under the first."""

    from kvspec.conformance.stand_ins import cuda_path, kernels_made_by, zero_outputs

    a, b = (_copy_of_the_sources(tmp_path, name) for name in "ab")
    launched: list[str] = []

    def make(name: str, input_names, output_names, source: str, header: str = "", **_):
        def launch(*, inputs, output_shapes, output_dtypes, **options):
            if name.startswith("kvspec_decode_attention"):
                launched.append(header)
            return zero_outputs(output_shapes, output_dtypes)

        return launch

    original = cuda_source.CUDA_DIR
    try:
        with cuda_path(), kernels_made_by(make):
            kernel_ab.kind_rows("KVCache", 64, [("a", a), ("b", b)], layers=2, turns=2)
    finally:
        kernel_ab.use_sources(original)
    for directory in (a, b):
        assert any(str(directory) in header for header in launched), directory
