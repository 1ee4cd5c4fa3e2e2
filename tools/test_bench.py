"""tools/bench.py: the quick mode runs every path on the CPU and reports every row (shapes
only: times mean nothing here)."""

from __future__ import annotations

import argparse
import json
from contextlib import ExitStack
from pathlib import Path

import bench
import mlx.core as mx
import pytest


def test_quick_run_reports_every_kind(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = report["rows"]
    steps = {row["what"] for row in rows if row["table"] == "step"}
    assert set(bench.KINDS) <= steps
    assert {"bare bf16 SDPA (no append)", "mlx-lm quantized attention 4-bit g64"} <= steps
    compiled = [row for row in rows if row["table"] == "compiled"]
    assert {row["what"] for row in compiled} == set(bench.KINDS)
    assert all(row["eager_us"] > 0 for row in compiled)
    # The compiled steps take turns with bare SDPA too.
    assert all(row["bare_us"] > 0 for row in compiled)
    overlapped = [row for row in rows if row["table"] == "overlapped"]
    assert {row["what"] for row in overlapped} == set(bench.KINDS)
    for row in overlapped:
        assert row["bare_us"] > 0
        assert row["ratio"] == pytest.approx(row["us"] / row["bare_us"])
    # The layers chained as a model runs them, bare SDPA chained alike.
    chained = [row for row in rows if row["table"] == "chained"]
    assert {row["what"] for row in chained} == set(bench.KINDS)
    for row in chained:
        assert row["eager_us"] > 0 and row["bare_us"] > 0
        assert row["ratio"] == pytest.approx(row["us"] / row["bare_us"])
    reads = [row for row in rows if row["table"] == "attend"]
    assert {row["what"] for row in reads} == set(bench.KINDS)
    for row in rows:
        assert row["us"] > 0 and row["ratio"] > 0
    for row in reads:
        assert row["bytes_per_token"] > 0 and row["floor_fraction"] > 0
    # A kind's step and read rows are timed taking turns with bare SDPA, their denominator.
    for row in [*reads, *(row for row in rows if row["what"] in bench.KINDS)]:
        if row["table"] in ("step", "attend"):
            assert row["bare_us"] > 0
            assert row["ratio"] == pytest.approx(row["us"] / row["bare_us"])
    assert {row["what"] for row in rows if row["table"] == "encode"} == {
        "turboquant encode_deferred k8v4",
        "affine quantize_deferred 4-bit g64 (k, v)",
    }
    assert "plain read bandwidth" in capsys.readouterr().out


def test_quick_turns_take_tiny_shapes_with_the_kernels_stood_in() -> None:
    """--quick gives the tools that take turns (host_floor.py, padded_batch.py, ...) tiny
    shapes on the CUDA path with stand-in kernels for the time of the stack, and nothing
    stood in without it. (A quick run at the full shapes would not fail on a CPU: it would
    run for hours.)"""
    from kvspec.accelerated import device

    parser = argparse.ArgumentParser()
    bench.add_turn_options(parser, bench.AB_KINDS)
    before = device.fused_kernels_enabled()
    with ExitStack() as stack:
        quick = parser.parse_args(["--quick", "--contexts", "100", "--layers", "3"])
        assert bench.turn_shapes(quick, stack) == ([64], 2, 2)
        assert device.fused_kernels_enabled()
    assert device.fused_kernels_enabled() == before
    with ExitStack() as stack:
        given = parser.parse_args(["--contexts", "100", "200", "--layers", "3", "--turns", "4"])
        assert bench.turn_shapes(given, stack) == ([100, 200], 3, 4)
        assert device.fused_kernels_enabled() == before


def test_read_bandwidth_is_the_rate_of_the_bytes_twice_as_many_add(monkeypatch, capsys) -> None:
    """Each plain read of 1 MiB and 2 MiB taking turns; the rate counts only the added
    bytes over the added time, so that a fixed cost per evaluation is not reading."""
    seconds = iter([(1.0, 1.5), (1.0, 1.25), (2.0, 2.0)])  # one set a plain read

    def timed(runs, repeats, warmup=2):
        assert len(runs) == 2
        smaller, larger = next(seconds)
        return [bench.Samples([smaller], [0.0], [0.0]), bench.Samples([larger], [0.0], [0.0])]

    monkeypatch.setattr(bench, "samples", timed)
    # 1 MiB added in 0.25 s by the second read; the third took no longer: not measured.
    assert bench.read_bandwidth(1, 1) == pytest.approx(2**20 / 0.25)
    assert "not measured" in capsys.readouterr().out
    seconds = iter([(1.0, 1.0)] * 3)
    with pytest.raises(RuntimeError, match="no bandwidth"):
        bench.read_bandwidth(1, 1)


def test_encode_rows_take_turns_with_their_copy(monkeypatch) -> None:
    """The copy and both encoders are timed in one set of turns, so that a busy machine slows
    them alike (timed one after the other, the encoders' ratios moved threefold between runs)."""
    turns = []
    timed = bench.samples

    def recording(runs, repeats, warmup=2):
        turns.append(len(runs))
        return timed(runs, repeats, warmup)

    monkeypatch.setattr(bench, "samples", recording)
    rows = bench.encode_rows(64, 2)
    assert turns == [3]
    assert [row.table for row in rows] == ["encode", "encode"]
    assert all(row.us > 0 and row.ratio > 0 for row in rows)


def test_compiled_only_reports_compiled_against_eager(tmp_path: Path, capsys) -> None:
    out = tmp_path / "rows.json"
    assert bench.main(["--quick", "--compiled-only", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {row["table"] for row in rows} == {"compiled"}  # nothing overlapped either
    assert {row["what"] for row in rows} == set(bench.KINDS)
    for row in rows:
        assert row["us"] > 0 and row["eager_us"] > 0 and row["cpu_ratio"] > 0
        assert row["ratio"] == pytest.approx(row["us"] / row["eager_us"])
        assert row["bare_us"] == 0  # no baselines: nothing to take turns with
    assert "compiled / eager" in capsys.readouterr().out


def test_kinds_picks_kinds_by_name(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    argv = ["--quick", "--compiled-only", "--kinds", "Rotating", "--json", str(out)]
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {row["what"] for row in rows} == {name for name in bench.KINDS if "Rotating" in name}
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--kinds", "no such kind"])


@pytest.mark.parametrize("option", ["--contexts", "--layers", "--repeats", "--encode-positions"])
def test_counts_of_zero_are_refused(option: str, capsys) -> None:
    with pytest.raises(SystemExit):
        bench.main([option, "0"])
    assert "must be 1 or more, got 0" in capsys.readouterr().err


def test_a_whole_name_picks_that_kind_alone() -> None:
    assert [name for name in bench.KINDS if bench.picks("KVCache", name)] == ["KVCache"]
    contained = [name for name in bench.KINDS if bench.picks("QuantizedKVCache 4-bit", name)]
    assert contained == [name for name in bench.KINDS if "QuantizedKVCache 4-bit" in name]
    assert len(contained) > 1


def test_rates_are_the_time_a_read_adds_between_consecutive_contexts(capsys) -> None:
    # 1152 bytes per token over 98304 more positions in 40 µs more: 2.83 TB/s; from 4096 to
    # 32768, 28672 more in 30 µs more: 1.10 TB/s.
    rows = [
        bench.Row("attend", "affine", 131072, 100.0, 2.0, 1152),
        bench.Row("attend", "affine", 4096, 30.0, 1.2, 1152),
        bench.Row("attend", "affine", 32768, 60.0, 1.2, 1152),
        bench.Row("attend", "flat", 32768, 50.0, 1.0, 4096),
        bench.Row("attend", "flat", 131072, 49.0, 1.0, 4096),  # no added time: no rate
        bench.Row("attend", "alone", 4096, 50.0, 1.0, 4096),  # one context: no rate
        bench.Row("step", "affine", 131072, 500.0, 5.0, 1152),
    ]
    rates = bench.rate_rows(rows, bandwidth=2.0e12)
    assert [(row.table, row.what, row.from_context, row.context) for row in rates] == [
        ("rate", "affine", 4096, 32768),
        ("rate", "affine", 32768, 131072),
    ]
    early, late = rates
    assert (early.us, late.us) == (pytest.approx(30.0), pytest.approx(40.0))
    assert early.ratio * 2.0e12 == pytest.approx(1152 * 28672 / 30e-6)
    assert late.ratio * 2.0e12 == pytest.approx(1152 * 98304 / 40e-6)
    bench.print_rates(rates, 2.0e12)
    out = capsys.readouterr().out
    assert "2.83" in out and "1.10" in out


def test_overlapped_steps_count_what_they_hold_above_what_was_held() -> None:
    # Each step makes a 4 MiB array; the last is held until the steps end.
    held = mx.zeros((2**20,))
    mx.eval(held)
    seconds, extra = bench.overlapped(lambda: [held + 1], 3)
    assert seconds > 0
    assert extra >= 4 * 2**20


def test_chained_layers_take_the_layer_befores_output_as_their_query() -> None:
    """`chained`: each layer's query is the output of the layer before, in the first query's
    dtype (a TurboQuant read answers in float32); the last output is the result."""
    q = mx.ones((1, 4, 1, 8), mx.bfloat16)
    keys = mx.ones((1, 4, 3, 8), mx.bfloat16)
    queries, outputs = [], []

    def layer(scale: float):
        def attend(query: mx.array) -> mx.array:
            queries.append(query)
            outputs.append(bench.sdpa(query, keys, keys * scale).astype(mx.float32))
            return outputs[-1]

        return attend

    out = bench.chained(q, [layer(scale) for scale in (1.0, 2.0, 3.0)])
    assert queries[0] is q
    for query, output in zip([*queries[1:], out], outputs, strict=True):
        assert query.dtype == mx.bfloat16 and query.shape == q.shape
        assert mx.array_equal(query, output.astype(mx.bfloat16))
    assert not mx.array_equal(queries[1], queries[2])
