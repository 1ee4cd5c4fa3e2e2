"""tools/compare.py: zero mismatches on its default workload, exit 1 on a difference and 2
on bad usage, a summary table, a JSON report, a seeded workload."""

from __future__ import annotations

import json
from pathlib import Path

import compare
import mlx.core as mx
import numpy as np
import pytest

from kvspec.accelerated import caches as accelerated_caches
from kvspec.accelerated.dtypes import from_numpy
from kvspec.reference import caches as reference_caches
from kvspec.reference.dtypes import BFLOAT16


def test_default_workload_has_no_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    assert compare.main(["--bits", "3", "4", "--dtypes", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "no stored field differs" in out
    assert "affine (AFF)" in out


def test_a_differing_word_fails(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    real = compare.accelerated_affine.quantize

    def flipped(w, group_size, bits):
        wq, scales, biases = real(w, group_size, bits)
        return wq ^ 1, scales, biases

    monkeypatch.setattr(compare.accelerated_affine, "quantize", flipped)
    assert compare.main(["--bits", "4", "--group-sizes", "64", "--dtypes", "float32"]) == 1
    assert "stored fields differ in: affine" in capsys.readouterr().out


def test_input_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "kv.npy"
    np.save(path, np.random.default_rng(1).standard_normal((4, 64)).astype(np.float32))
    assert compare.main(["--input", str(path), "--bits", "8", "--group-sizes", "64"]) == 0
    assert "kv" in capsys.readouterr().out


def test_turboquant_rows_on_a_small_workload() -> None:
    pairs = compare.turboquant_workload(0, [64])
    table = compare.turboquant_table(pairs, [4, 8], [3], ["bfloat16"])
    assert not table.differs
    assert len(table.rows) == 2 and all(len(r) == len(table.columns) for r in table.rows)
    for row in table.rows:
        assert row[5:10] == ["0"] * 5
        assert 0 < float(row[11]) < 0.04  # 3-bit values
    assert [r[-1] for r in table.rows] == ["4.250", "6.250"]  # (k_bits + 1 + 3 + 0.5) / 2


def test_cache_sessions_agree() -> None:
    table = compare.cache_table(["bf16", "affine:4:64", "turbo:k4v3:deferred"], seed=1)
    assert not table.differs
    assert [row[:2] for row in table.rows] == [
        ["bf16", "full"],
        ["bf16", "sliding"],
        ["affine:4:64", "full"],
        ["affine:4:64", "sliding"],
        ["turbo:k4v3:deferred", "full"],
    ]
    for row in table.rows:
        assert row[3] == "68" and row[-1] == "none"
        assert float(row[5]) <= 1.0
        if row[0] != "bf16":  # the worst step's error of a lossy read, not the least's
            assert float(row[5]) > 0.01
    # Per position, 2 heads of D = 128: bf16 keys and values (2 * 256 each); 4-bit words
    # (64) and bf16 scales and biases per 64 (8) for each; TurboQuant k4: 64 bytes of codes
    # and 2 float16 per 32 (16), v3: 48 bytes and 1 float16 per 32 (8).
    assert [row[4] for row in table.rows] == ["1024", "1024", "288", "288", "272"]


def test_a_flipped_cache_bit_is_reported_with_its_step(monkeypatch, capsys) -> None:
    """The affine cache with start 40 converts on the third decode (step 3): a flipped bit in
    what the backend's QuantizedKVCache encodes shows there, and compare.py exits 1."""
    cache_class = compare.accelerated_caches.QuantizedKVCache
    real = cache_class._encode

    def flipped(self, k, v):
        *fields, v_biases = real(self, k, v)
        fields[3] = fields[3] ^ 4
        return (*fields, v_biases)

    monkeypatch.setattr(cache_class, "_encode", flipped)
    table = compare.cache_table(["affine:8:32:start=40"], seed=0)
    assert table.differs
    full, sliding = table.rows
    assert full[-1].startswith("step 3 (decode): v_words[0, 0, 0, 0]: ")
    assert sliding[-1] == "none"
    args = ["--bits", "8", "--group-sizes", "32", "--k-bits", "8", "--v-bits", "4"]
    assert compare.main([*args, "--dtypes", "float32", "--schemes", "affine:4:64"]) == 1
    assert "stored fields differ in: caches" in capsys.readouterr().out


def test_a_table_renders_its_columns_right_aligned_to_their_widest_cell() -> None:
    table = compare.Table("title", ["a", "longer header"])
    table.add(["a value wider than its header", "1"], False)
    table.add(["b", "22"], False)
    title, *lines = table.render().splitlines()
    assert title == "title"
    assert lines == [
        "                            a  longer header",
        "a value wider than its header              1",
        "                            b             22",
    ]


def test_a_state_of_another_dtype_alone_is_named_a_divergence() -> None:
    """The first stored difference is named by its field's dtype and shape where either
    differs (here the dtype alone: bfloat16 against float16 of the same shape)."""
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((1, 2, 3, 64)).astype(np.float32) for _ in range(2))
    expected, actual = reference_caches.KVCache(), accelerated_caches.KVCache()
    expected.append_window(k.astype(BFLOAT16), v.astype(BFLOAT16))
    actual.append_window(from_numpy(k.astype(np.float16)), from_numpy(v.astype(np.float16)))
    assert compare.state_divergence(expected, actual) == (
        "keys: bfloat16[1, 2, 3, 64] != float16[1, 2, 3, 64]"
    )


def test_a_safetensors_input_is_encoded_as_its_pairs(tmp_path: Path, capsys) -> None:
    """--input takes a .safetensors file: its "keys" and "values" one TurboQuant pair; a
    "keys" without "values" is encoded as both, as any other 4-D array is."""
    rng = np.random.default_rng(2)
    k, v = (mx.array(rng.standard_normal((1, 2, 8, 64)).astype(np.float32)) for _ in range(2))
    args = ["--bits", "4", "--group-sizes", "64", "--k-bits", "8", "--v-bits", "4"]
    args += ["--dtypes", "float32", "--schemes", "bf16", "--json"]
    for arrays, pairs in (({"keys": k, "values": v}, ["keys/values"]), ({"keys": k}, ["keys"])):
        path = tmp_path / "kv.safetensors"
        mx.save_safetensors(str(path), arrays)
        assert compare.main(["--input", str(path), *args]) == 0
        affine, turboquant, _ = json.loads(capsys.readouterr().out)["tables"]
        assert sorted(row["array"] for row in affine["rows"]) == sorted(arrays)
        assert [row["pair"] for row in turboquant["rows"]] == pairs


SMALL = ["--bits", "4", "--group-sizes", "64", "--k-bits", "8", "--v-bits", "4"]
SMALL += ["--head-dims", "64", "--dtypes", "bfloat16", "--schemes", "affine:4:64"]


def _json_report(capsys, *args: str) -> tuple[int, dict]:
    status = compare.main([*SMALL, "--json", *args])
    return status, json.loads(capsys.readouterr().out)


def test_json_report_and_summary(capsys) -> None:
    status, report = _json_report(capsys, "--seed", "3")
    assert status == report["status"] == 0 and report["seed"] == 3
    titles = [table["title"].split(":")[0] for table in report["tables"]]
    assert titles == ["affine (AFF)", "turboquant (TQ)", "caches"]
    assert report["summary"] == [
        {"table": "affine (AFF)", "configurations": "2", "differing": "0", "verdict": "same bits"},
        {
            "table": "turboquant (TQ)",
            "configurations": "1",
            "differing": "0",
            "verdict": "same bits",
        },
        {"table": "caches", "configurations": "2", "differing": "0", "verdict": "same bits"},
    ]
    assert report["tables"][0]["rows"][0]["words"] == "0"


def test_seed_picks_the_workload(capsys) -> None:
    def read_errors(seed: str) -> list[str]:
        _, report = _json_report(capsys, "--seed", seed)
        return [row["max read err"] for row in report["tables"][0]["rows"]]

    assert read_errors("1") == read_errors("1") != read_errors("2")


def test_summary_counts_differing_configurations(monkeypatch, capsys) -> None:
    real = compare.accelerated_affine.quantize

    def flipped(w, group_size, bits):
        wq, scales, biases = real(w, group_size, bits)
        return wq ^ 1, scales, biases

    monkeypatch.setattr(compare.accelerated_affine, "quantize", flipped)
    status, report = _json_report(capsys)
    assert status == report["status"] == 1
    assert report["summary"][0] == {
        "table": "affine (AFF)",
        "configurations": "2",
        "differing": "2",
        "verdict": "DIFFERS",
    }
    assert compare.main(SMALL) == 1
    assert "DIFFERS" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args",
    [["--bits", "7"], ["--schemes", "affine:4"], ["--input", "missing.npy"], ["--nope"]],
)
def test_bad_usage_exits_2(args: list[str], tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    assert compare.main(args) == 2
    assert "error:" in capsys.readouterr().err
