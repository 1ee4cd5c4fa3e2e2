"""Check a port in any language against the golden vectors, then against the reference on
generated cases, through one command that speaks the JSON lines protocol of
conformance/port_protocol.py (docs/porting.md, section 2).

    python -m kvspec.conformance.port --command "./myport-kvspec"
    python -m kvspec.conformance.port --command "..." --operations affine.quantize --examples 500

It reports the first mismatch (operation, field, index, expected and actual values) and,
for generated cases, the smallest failing request, shrunk by hypothesis. Exit status: 0
when every check passes, 1 at a mismatch, 2 on bad usage or a broken protocol (the
command does not start, exits, gives no answer within --answer-timeout seconds, or
answers out of order or not in JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kvspec.conformance.cache_scenarios import SCENARIOS, expected_outcome, play, script_steps
from kvspec.conformance.compare import bit_view, first_differing
from kvspec.conformance.port_protocol import (
    AFFINE_OUTPUTS,
    OPERATIONS,
    TURBOQUANT_OUTPUTS,
    decode_array,
    encode_array,
)
from kvspec.conformance.strategies import grouped_arrays
from kvspec.conformance.vectors import field_array, load_schema, vector_path
from kvspec.reference import affine, turboquant
from kvspec.reference import caches as reference_caches
from kvspec.reference.dtypes import FLOAT_DTYPES

#: Which operation each vector file's tests exercise.
FILE_OPERATIONS = {
    "affine": "affine.quantize",
    "turboquant": "turboquant.encode",
    "caches": "cache.run",
}

Expected = dict[str, Any] | None  # None: the reference rejects the request


class ProtocolError(Exception):
    """The command broke the protocol: exit status 2."""


class Mismatch(AssertionError):
    """The port's answer differs from what it must be: exit status 1."""


#: Seconds the runner waits for each answer (and for the command to exit at the end).
ANSWER_TIMEOUT = 60.0


class PortCommand:
    """A running port command: one request line in, one response line out, within
    `answer_timeout` seconds (a command that never answers, or never flushes its answers,
    is a broken protocol, not a hung run)."""

    def __init__(self, command: str, answer_timeout: float = ANSWER_TIMEOUT) -> None:
        self.command = command
        self.answer_timeout = answer_timeout
        self.process = subprocess.Popen(
            command, shell=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.next_id = 0
        # Lines as the command writes them; "" once its output ends.
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_lines, daemon=True).start()

    def _read_lines(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put("")

    def ask(self, op: str, inputs: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.next_id += 1
        request = {"id": self.next_id, "op": op, "inputs": inputs}
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        except BrokenPipeError as error:
            raise ProtocolError(f"{self.command!r} stopped reading: {error}") from error
        try:
            line = self._lines.get(timeout=self.answer_timeout)
        except queue.Empty:
            raise ProtocolError(
                f"{self.command!r} gave no answer to request {self.next_id} within "
                f"{self.answer_timeout:g} s (does it flush its output after each line?)"
            ) from None
        if not line:
            status = self._exit_status()
            raise ProtocolError(f"{self.command!r} exited with status {status} before answering")
        try:
            response = json.loads(line)
        except json.JSONDecodeError as error:
            raise ProtocolError(f"not a JSON line: {line[:200]!r}") from error
        if response.get("id") != self.next_id:
            raise ProtocolError(f"answer {response.get('id')!r} to request {self.next_id}")
        return response

    def close(self) -> None:
        """Close the command's input and wait for it to exit (`_exit_status`)."""
        if self.process.stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # the command has already gone
                self.process.stdin.close()
        self._exit_status()

    def _exit_status(self) -> int:
        """The command's exit status; one still running `answer_timeout` seconds from now
        is killed."""
        try:
            return self.process.wait(timeout=self.answer_timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


def _element(a: np.ndarray, index: tuple[int, ...]) -> str:
    bits = bit_view(a)[index]
    return f"{a[index]!r} (bits 0x{int(bits):0{2 * a.dtype.itemsize}x})"


def array_mismatch(field: str, actual: np.ndarray, expected: np.ndarray) -> str | None:
    """Where two arrays first differ in dtype, shape or bits; None when bit-equal."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        return (
            f"field {field}: expected {expected.dtype} {list(expected.shape)}, "
            f"actual {actual.dtype} {list(actual.shape)}"
        )
    found = first_differing(actual, expected)
    if found is None:
        return None
    index, count = found
    return (
        f"field {field} index {list(index)}: expected {_element(expected, index)}, "
        f"actual {_element(actual, index)} ({count} of {expected.size} elements differ)"
    )


def _outcome_mismatch(step: int, actual: dict[str, Any], expected: dict[str, Any]) -> str | None:
    for key in ("rejected", "trimmed"):
        if actual.get(key) != expected.get(key):
            return f"step {step}: {key} expected {expected.get(key)}, actual {actual.get(key)}"
    want, got = expected["after"], actual["after"]
    for key, value in want.items():
        if key != "arrays" and got.get(key) != value:
            return f"step {step}: {key} expected {value!r}, actual {got.get(key)!r}"
    names = [a["name"] for a in want["arrays"]]
    if [a.get("name") for a in got.get("arrays", [])] != names:
        return f"step {step}: state arrays expected {names}"
    for w, g in zip(want["arrays"], got["arrays"], strict=True):
        difference = array_mismatch(w["name"], decode_array(g), decode_array(w))
        if difference is not None:
            return f"step {step}: {difference}"
    return None


def response_mismatch(op: str, response: dict[str, Any], expected: Expected) -> str | None:
    """What is wrong with a port's response; None when it is the expected one."""
    if response.get("unsupported"):
        return f"{op}: the port does not support this operation"
    if expected is None:
        return None if "error" in response else f"{op}: accepted input the spec rejects"
    if "error" in response:
        return f"{op}: rejected valid input ({response['error']})"
    outputs = response.get("outputs", {})
    if op == "cache.run":
        outcomes = outputs.get("outcomes", [])
        if len(outcomes) != len(expected["outcomes"]):
            return f"{op}: {len(outcomes)} outcomes for {len(expected['outcomes'])} steps"
        for step, (got, want) in enumerate(zip(outcomes, expected["outcomes"], strict=True)):
            difference = _outcome_mismatch(step, got, want)
            if difference is not None:
                return f"{op}: {difference}"
        return None
    for field, want in expected.items():
        if field not in outputs:
            return f"{op}: field {field} missing"
        difference = array_mismatch(field, decode_array(outputs[field]), want)
        if difference is not None:
            return f"{op}: {difference}"
    return None


# Golden vectors


def golden_cases(name: str) -> Iterator[tuple[str, dict[str, Any], Expected]]:
    """(where, inputs, expected) of every test in a vector file."""
    vectors = json.loads(vector_path(name).read_text())
    schema = load_schema()
    for group in vectors["testGroups"]:
        for test in group["tests"]:
            where = f"{name}.json tcId {test['tcId']} ({', '.join(test['flags'])})"
            if name == "caches":
                steps = [
                    {k: v for k, v in step.items() if k not in ("after", "rejected", "trimmed")}
                    for step in test["steps"]
                ]
                inputs = {key: group[key] for key in ("cache", "arguments", "dtype")}
                outcomes = [expected_outcome(step) for step in test["steps"]]
                yield where, inputs | {"steps": steps}, {"outcomes": outcomes}
                continue
            if name == "affine":
                inputs = {"groupSize": group["groupSize"], "bits": group["bits"]}
                names, outputs = ("w",), AFFINE_OUTPUTS
            else:
                inputs = {"kBits": group["kBits"], "vBits": group["vBits"]}
                names, outputs = ("k", "v"), TURBOQUANT_OUTPUTS
            for field in names:
                inputs[field] = encode_array(field_array(schema, name, group, test, field))
            expected = None
            if test["result"] == "valid":
                expected = {f: field_array(schema, name, group, test, f) for f in outputs}
            yield where, inputs, expected


# Generated cases, checked against the reference


def _reference_affine(inputs: dict[str, Any]) -> Expected:
    w = decode_array(inputs["w"])
    try:
        stored = affine.quantize(w, inputs["groupSize"], inputs["bits"])
    except ValueError:
        return None
    return dict(zip(AFFINE_OUTPUTS, stored, strict=True))


def _reference_turboquant(inputs: dict[str, Any]) -> Expected:
    k, v = decode_array(inputs["k"]), decode_array(inputs["v"])
    try:
        with np.errstate(over="ignore"):  # squares of huge values: rejected as an rms
            t = turboquant.encode(k, v, inputs["kBits"], inputs["vBits"])
    except ValueError:
        return None
    _, _, L, D = k.shape
    keys, values = turboquant.decode(t, L, D)
    _, rotated = turboquant.decode(t, L, D, defer_v=True)
    arrays = [*(getattr(t, name) for name in TURBOQUANT_OUTPUTS[:5]), keys, values, rotated]
    return dict(zip(TURBOQUANT_OUTPUTS, arrays, strict=True))


def _reference_cache(inputs: dict[str, Any]) -> Expected:
    def same(a: Any) -> np.ndarray:
        return np.asarray(a)

    return {"outcomes": play(reference_caches, same, same, inputs, inputs["steps"])}


@st.composite
def affine_requests(draw: st.DrawFn) -> dict[str, Any]:
    dtype_name = draw(st.sampled_from(sorted(FLOAT_DTYPES)))
    group_size = draw(st.sampled_from(affine.SUPPORTED_GROUP_SIZES))
    lead = draw(st.tuples(st.integers(1, 3)) | st.tuples(st.integers(1, 2), st.integers(1, 3)))
    last = group_size * draw(st.integers(1, 3))
    w = draw(grouped_arrays(dtype_name, last, group_size, lead))
    bits = draw(st.sampled_from(affine.SUPPORTED_BITS))
    return {"w": encode_array(w), "groupSize": group_size, "bits": bits}


@st.composite
def turboquant_requests(draw: st.DrawFn) -> dict[str, Any]:
    dtype_name = draw(st.sampled_from(sorted(FLOAT_DTYPES)))
    head_dim = draw(st.sampled_from((64, 128)))
    lead = draw(st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 3)))
    k = draw(grouped_arrays(dtype_name, head_dim, turboquant.BLOCK_SIZE, lead))
    v = draw(grouped_arrays(dtype_name, head_dim, turboquant.BLOCK_SIZE, lead))
    return {
        "k": encode_array(k),
        "v": encode_array(v),
        "kBits": draw(st.sampled_from(turboquant.KEY_BITS)),
        "vBits": draw(st.sampled_from(turboquant.VALUE_BITS)),
    }


@st.composite
def cache_requests(draw: st.DrawFn) -> dict[str, Any]:
    _, kind, arguments, dtype_name, _ = draw(st.sampled_from(SCENARIOS))
    operation = st.one_of(
        st.tuples(st.just("append"), st.integers(1, 4)),
        st.tuples(st.just("trim"), st.integers(0, 3)),
        st.tuples(st.just("restore")),
    )
    script = draw(st.lists(operation, min_size=1, max_size=10))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    steps = script_steps(rng, FLOAT_DTYPES[dtype_name], script)
    return {"cache": kind, "arguments": arguments, "dtype": dtype_name, "steps": steps}


GENERATED: dict[str, tuple[st.SearchStrategy, Callable[[dict[str, Any]], Expected]]] = {
    "affine.quantize": (affine_requests(), _reference_affine),
    "turboquant.encode": (turboquant_requests(), _reference_turboquant),
    "cache.run": (cache_requests(), _reference_cache),
}


def check_generated(port: PortCommand, op: str, examples: int, random_seed: int) -> None:
    """Hypothesis cases of `op` against the reference; raises Mismatch with the smallest
    failing request."""
    strategy, reference = GENERATED[op]

    @seed(random_seed)
    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(strategy)
    def agrees_with_reference(inputs: dict[str, Any]) -> None:
        difference = response_mismatch(op, port.ask(op, inputs), reference(inputs))
        if difference is not None:
            request = json.dumps({"op": op, "inputs": inputs})
            raise Mismatch(f"{difference}\n  smallest failing request: {request}")

    agrees_with_reference()


def run_checks(
    port: PortCommand, files: Sequence[str], operations: Sequence[str], examples: int, seed_: int
) -> None:
    """Every golden test of `files`, then `examples` generated cases per operation; raises
    Mismatch at the first difference."""
    for name in files:
        op = FILE_OPERATIONS[name]
        if op not in operations:
            continue
        count = 0
        for where, inputs, expected in golden_cases(name):
            difference = response_mismatch(op, port.ask(op, inputs), expected)
            if difference is not None:
                raise Mismatch(f"golden {where}: {difference}")
            count += 1
        print(f"golden {name}.json: {count} tests pass")
    for op in operations:
        if examples:
            check_generated(port, op, examples, seed_)
            print(f"generated {op}: {examples} cases agree with the reference")


def _positive_seconds(text: str) -> float:
    """argparse type of --answer-timeout: a number of seconds above 0."""
    seconds = float(text)
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{text}: not a number of seconds above 0")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--command", required=True, help="the port's command (run by a shell)")
    parser.add_argument(
        "--files",
        nargs="*",
        choices=list(FILE_OPERATIONS),
        default=list(FILE_OPERATIONS),
        help="golden vector files to check (none: only generated cases)",
    )
    parser.add_argument("--operations", nargs="+", choices=OPERATIONS, default=list(OPERATIONS))
    parser.add_argument("--examples", type=int, default=100, help="generated cases per operation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated cases")
    parser.add_argument(
        "--answer-timeout",
        type=_positive_seconds,
        default=ANSWER_TIMEOUT,
        help="seconds to wait for each answer (default %(default)g)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    port = PortCommand(args.command, args.answer_timeout)
    try:
        run_checks(port, args.files, args.operations, args.examples, args.seed)
    except Mismatch as mismatch:
        print(f"MISMATCH {mismatch}")
        return 1
    except ProtocolError as error:
        print(f"protocol error: {error}", file=sys.stderr)
        return 2
    finally:
        port.close()
    print("the port agrees with every check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
