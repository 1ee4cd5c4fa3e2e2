"""tools/kernel_times.py: `run` on the CUDA path with stand-in kernels opens a span before
each evaluation; `table` reads ncu's CSV log into spans, medians and floors."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import kernel_times
import mlx.core as mx
import pytest

from kvspec.conformance.stand_ins import cuda_path


def ncu_line(index: int, name: str, ns: str) -> str:
    fields = [str(index), "1", "python3.12", "127.0.0.1", name, "1", "7", "(1, 1, 1)"]
    fields += ["(1, 1, 1)", "0", "9.0", "Command line profiler metrics"]
    fields += ["gpu__time_duration.sum", "ns", ns]
    return ",".join(f'"{field}"' for field in fields)


HEADER = ",".join(
    f'"{name}"'
    for name in [
        "ID",
        "Process ID",
        "Process Name",
        "Host Name",
        "Kernel Name",
        "Context",
        "Stream",
        "Block Size",
        "Grid Size",
        "Device",
        "CC",
        "Section Name",
        "Metric Name",
        "Metric Unit",
        "Metric Value",
    ]
)


def test_run_opens_a_span_before_every_evaluation(tmp_path: Path) -> None:
    spans_file = tmp_path / "spans.json"
    kinds = ["KVCache", "QuantizedKVCache 4-bit g64"]
    argv = ["run", str(spans_file), "--contexts", "64", "--kinds", *kinds]
    with (
        cuda_path() as launches,
        mock.patch.object(mx.cuda, "is_available", lambda: True),
        mock.patch.object(kernel_times, "PLAIN_READ_ELEMENTS", 2**24),
    ):
        assert kernel_times.main(argv) == 0
    spans = json.loads(spans_file.read_text())
    steps = [(span["step"], span["what"]) for span in spans if span["step"] != "setup"]
    repeats = kernel_times.REPEATS
    reads = [("plain read", name) for name in kernel_times.PLAIN_READS for _ in range(repeats)]
    expected = reads + [("bare SDPA", "bare bf16 SDPA")] * repeats
    for kind in kinds:
        expected += [("eager", kind)] * repeats + [("compiled", kind)] * repeats
    assert steps == expected
    markers = [name for name in launches if name.startswith("marker")]
    assert markers == [f"marker{i}" for i in range(len(spans))]
    assert all(launches[name] == 1 for name in markers)
    # Setup opens a span before the plain reads, each context, each kind, and after all.
    setups = [i for i, span in enumerate(spans) if span["step"] == "setup"]
    assert len(setups) == 2 + 1 + len(kinds) + 1 and setups[-1] == len(spans) - 1
    # A kind's floor counts its stored bytes at the context.
    assert {span["bytes"] for span in spans if span["what"] == "KVCache"} == {64 * 4096}


def test_run_refuses_without_cuda(tmp_path: Path, capsys) -> None:
    if mx.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(SystemExit):
        kernel_times.main(["run", str(tmp_path / "spans.json")])
    assert "needs MLX's CUDA backend" in capsys.readouterr().err


def test_table_takes_medians_after_the_first_repeat_and_floors_pass_1(tmp_path: Path) -> None:
    spans = [kernel_times.Span("plain read", "max of all", 0, 10**9)] * 4
    spans += [kernel_times.Span("bare SDPA", "bare bf16 SDPA", 64, 0)] * 4
    spans += [kernel_times.Span("eager", "KVCache", 64, 2 * 10**6)] * 4
    # Per span: its kernels (name, ns); each kind's first repeat is left out.
    launched = [[("reduce_all", ns)] for ns in ("9,000,000", "500,000", "1,000,000", "750,000")]
    bare_ns = ("900,000", "20,000", "30,000", "20,000")
    launched += [[("cudnn_generated_fort_native_sdpa", ns)] for ns in bare_ns]
    for ns in ("99,000", "8,000", "7,000", "9,000"):
        launched.append(
            [
                ("custom_kernel_kvspec_decode_attention_mma_counted", ns),
                ("custom_kernel_kvspec_decode_merge_128", "3,000"),
            ]
        )
    lines = ["==PROF== Connected to process 1", HEADER]
    for marker, kernels in enumerate(launched):
        lines.append(ncu_line(len(lines), f"mlx::custom_kernel_marker{marker}(float *)", "3,000"))
        lines += [ncu_line(len(lines), name, ns) for name, ns in kernels]
    log, spans_file, out = tmp_path / "k.csv", tmp_path / "s.json", tmp_path / "rows.json"
    log.write_text("\n".join(lines) + "\n")
    spans_file.write_text(json.dumps([vars(span) for span in spans]))
    assert kernel_times.main(["table", str(log), str(spans_file), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # The plain read: 1 GB in 750 µs, the median of its last three repeats.
    assert result["bandwidth"] == pytest.approx(10**9 / 750e-6)
    rows = {row["step"]: row for row in result["rows"]}
    assert rows["eager"]["kernels"] == [["pass 1", 8.0], ["merge", 3.0]]
    # 2 MB at 1.33 TB/s is 1.5 µs, against pass 1's 8.
    assert rows["eager"]["floor_fraction"] == pytest.approx(1.5 / 8.0)
    # Bare SDPA's median after its first repeat: 20 µs; the step's 11 over it.
    assert rows["eager"]["bare_ratio"] == pytest.approx(11 / 20)


def test_a_span_whose_repeats_launch_other_kernels_is_an_error() -> None:
    spans = [kernel_times.Span("eager", "KVCache", 64, 1)] * 3
    kernels = [
        ("marker0", 1.0),
        ("decode_attention", 5.0),
        ("marker1", 1.0),
        ("decode_attention", 5.0),
        ("marker2", 1.0),
        ("decode_attention", 5.0),
        ("copy_gg_nd", 2.0),
    ]
    with pytest.raises(ValueError, match="launched other kernels"):
        kernel_times.span_rows(kernels, spans)


def test_an_unknown_unit_is_an_error() -> None:
    line = ncu_line(0, "k", "1").replace('"ns"', '"cycle"')
    with pytest.raises(ValueError, match="unknown unit"):
        list(kernel_times.ncu_kernels([HEADER, line]))
