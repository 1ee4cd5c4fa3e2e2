"""The golden vectors' power, measured: a faithful port written from the spec reproduces
every vector, and each deliberately wrong port (conformance/vector_mutants.py) fails at
least one."""

from __future__ import annotations

import json

import pytest

from kvspec.conformance.vector_mutants import FAULTS, Port, run_port
from kvspec.conformance.vectors import CODEC_FILES, VECTORS_DIR, load_schema, vector_path

if not VECTORS_DIR.exists():
    pytest.skip("docs/vectors is not beside this checkout", allow_module_level=True)


@pytest.fixture(scope="module")
def vector_files() -> list[dict]:
    return [json.loads(vector_path(name).read_text()) for name in CODEC_FILES]


def _first_failure(port: Port, vector_files: list[dict]) -> str | None:
    schema = load_schema()
    for vectors in vector_files:
        failure = run_port(port, vectors, schema)
        if failure is not None:
            return failure
    return None


def test_faithful_port_reproduces_every_vector(vector_files: list[dict]) -> None:
    assert _first_failure(Port(), vector_files) is None


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_every_wrong_port_fails_a_vector(fault: str, vector_files: list[dict]) -> None:
    failure = _first_failure(Port(fault), vector_files)
    assert failure is not None, f"no vector catches {fault}: {FAULTS[fault]}"
    print(f"{fault}: {failure}")
