"""The port runner (python -m kvspec.conformance.port): a backend wrapped as a command
passes it, every deliberately wrong port is caught, the generated phase shrinks a
failure to a small request, and a broken command or bad usage exits 2."""

from __future__ import annotations

import io
import json
import shlex
import sys
import time

import numpy as np
import pytest

from kvspec.conformance import port, port_server
from kvspec.conformance.port_protocol import decode_array, encode_array
from kvspec.conformance.vector_mutants import FAULTS
from kvspec.conformance.vectors import VECTORS_DIR

if not VECTORS_DIR.exists():
    pytest.skip("docs/vectors is not beside this checkout", allow_module_level=True)

SERVER = f"{shlex.quote(sys.executable)} -m kvspec.conformance.port_server"
CODECS = ["--operations", "affine.quantize", "turboquant.encode"]


def test_accelerated_backend_as_a_command_passes(capsys) -> None:
    assert port.main(["--command", f"{SERVER} accelerated", "--examples", "10"]) == 0
    out = capsys.readouterr().out
    assert "golden caches.json: 16 tests pass" in out
    assert "generated cache.run: 10 cases agree" in out


def test_faithful_spec_port_passes_the_codecs(capsys) -> None:
    args = ["--command", f"{SERVER} mutant", "--files", "affine", "turboquant", *CODECS]
    assert port.main([*args, "--examples", "10"]) == 0


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_wrong_port_is_caught(fault: str, capsys) -> None:
    args = ["--command", f"{SERVER} mutant {fault}", "--files", "affine", "turboquant"]
    assert port.main([*args, *CODECS, "--examples", "0"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("MISMATCH golden ")


def test_generated_cases_report_the_smallest_failing_request(capsys) -> None:
    args = ["--command", f"{SERVER} mutant affine_half_away", "--files"]
    assert port.main([*args, "--operations", "affine.quantize", "--examples", "200"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("MISMATCH affine.quantize: field wq index [")
    assert "expected" in out and "actual" in out and "smallest failing request: {" in out


@pytest.mark.parametrize(
    "command",
    ["exit 0", "echo not-json", "echo '{\"id\": 9}'"],
    ids=["exits", "not-json", "wrong-id"],
)
def test_a_broken_command_exits_2(command: str, capsys) -> None:
    assert port.main(["--command", command, "--examples", "0"]) == 2
    assert "protocol error" in capsys.readouterr().err


#: Commands that never answer: one reads its whole input first, one never flushes its
#: answers (block-buffered, as C's stdout into a pipe is), one reads nothing and does not
#: exit when its input closes.
SILENT = {
    "reads-to-the-end": f"{shlex.quote(sys.executable)} -c 'import sys; sys.stdin.read()'",
    "unflushed": f"{shlex.quote(sys.executable)} -c '"
    "import json, sys\n"
    'out = open(1, "w", buffering=65536, closefd=False)\n'
    'for line in sys.stdin: print(json.dumps(dict(id=json.loads(line)["id"])), file=out)\'',
    "deaf": "exec sleep 60",
}


@pytest.mark.parametrize("command", SILENT.values(), ids=SILENT.keys())
def test_a_command_that_never_answers_exits_2_after_the_timeout(command: str, capsys) -> None:
    started = time.monotonic()
    args = ["--command", command, "--examples", "0", "--answer-timeout", "0.5"]
    assert port.main(args) == 2
    assert time.monotonic() - started < 10  # the answer's wait, then the exit's, then a kill
    err = capsys.readouterr().err
    assert "gave no answer to request 1 within 0.5 s" in err


def test_the_run_ends_when_the_command_exits_at_the_end_of_its_input() -> None:
    """The runner closes the command's input when its checks are done and returns once the
    command exits, not after the answer timeout."""
    started = time.monotonic()
    command = f"{shlex.quote(sys.executable)} -c 'import sys; sys.stdin.read()'"
    args = ["--command", command, "--files", "--examples", "0", "--answer-timeout", "30"]
    assert port.main(args) == 0
    assert time.monotonic() - started < 10


def test_bad_usage_exits_2(capsys) -> None:
    assert port.main(["--command", "true", "--operations", "nope"]) == 2
    assert port.main([]) == 2
    for seconds in ("0", "-1", "nan", "soon"):
        assert port.main(["--command", "true", "--answer-timeout", seconds]) == 2


def test_arrays_round_trip_and_reject_a_wrong_byte_count() -> None:
    a = np.arange(6, dtype=np.float16).reshape(2, 3)
    message = encode_array(a)
    assert message == {"dtype": "float16", "shape": [2, 3], "hex": a.tobytes().hex()}
    assert np.array_equal(decode_array(message), a)
    with pytest.raises(ValueError, match="cannot hold"):
        decode_array(message | {"shape": [2, 4]})


def test_mismatches_name_field_index_and_both_values() -> None:
    expected = np.array([[1.0, 2.0]], np.float32)
    actual = np.array([[1.0, 3.0]], np.float32)
    report = port.array_mismatch("scales", actual, expected)
    assert report == (
        "field scales index [0, 1]: expected np.float32(2.0) (bits 0x40000000), "
        "actual np.float32(3.0) (bits 0x40400000) (1 of 2 elements differ)"
    )
    assert port.response_mismatch("affine.quantize", {"unsupported": True}, None) is not None
    assert port.response_mismatch("affine.quantize", {"outputs": {}}, None) == (
        "affine.quantize: accepted input the spec rejects"
    )
    assert port.response_mismatch("affine.quantize", {"error": "no"}, None) is None


def test_a_field_of_another_dtype_or_shape_alone_is_named_so() -> None:
    """A field differing in dtype alone (the same bytes read as 16-bit integers) or
    in shape alone (the same elements laid out otherwise) is reported as such, not as an
    element that differs."""
    expected = np.array([[1.0, 2.0, 3.0]], np.float16)
    assert port.array_mismatch("scales", expected.view(np.int16), expected) == (
        "field scales: expected float16 [1, 3], actual int16 [1, 3]"
    )
    assert port.array_mismatch("scales", expected.reshape(3, 1), expected) == (
        "field scales: expected float16 [1, 3], actual float16 [3, 1]"
    )


def test_the_server_answers_an_operation_it_lacks_as_unsupported() -> None:
    """The example server (port_server) answers each request in order: an operation it has
    no handler for is `unsupported`, a ValueError of a handler an `error`."""

    def refuses(inputs: dict) -> dict:
        raise ValueError("refused")

    requests = [{"id": 1, "op": "cache.run", "inputs": {}}, {"id": 2, "op": "x", "inputs": {}}]
    responses = io.StringIO()
    lines = io.StringIO("".join(json.dumps(r) + "\n" for r in requests))
    port_server.serve({"x": refuses}, lines, responses)
    assert [json.loads(line) for line in responses.getvalue().splitlines()] == [
        {"id": 1, "unsupported": True},
        {"id": 2, "error": "refused"},
    ]


def test_a_cache_outcome_differing_in_one_count_alone_is_named() -> None:
    """cache.run: an outcome whose arrays all match but one of whose counts (offset,
    minimum reusable offset, bytes per token) does not is a mismatch at that step, named by
    its key."""
    _, _, expected = next(port.golden_cases("caches"))
    after = expected["outcomes"][0]["after"]
    for key in ("offset", "minimumReusableOffset", "bytesPerToken"):
        outcomes = json.loads(json.dumps(expected["outcomes"]))
        outcomes[0]["after"][key] = after[key] + 1
        report = port.response_mismatch("cache.run", {"outputs": {"outcomes": outcomes}}, expected)
        assert report is not None and report.startswith(f"cache.run: step 0: {key} expected ")
    assert port.response_mismatch("cache.run", {"outputs": expected}, expected) is None
