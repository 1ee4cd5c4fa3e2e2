"""Golden vectors (docs/vectors): valid against the schema, equal to a fresh generation
from the reference, and reproduced bit for bit by the backend under test."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvspec.conformance.compare import assert_same_bits
from kvspec.conformance.vectors import BUILDERS, VECTORS_DIR, from_hex, render, vector_path
from kvspec.reference.dtypes import FLOAT_DTYPES

if not VECTORS_DIR.exists():
    pytest.skip("docs/vectors is not beside this checkout", allow_module_level=True)


def _load(name: str) -> dict:
    return json.loads(vector_path(name).read_text())


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_file_follows_the_schema(name: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((VECTORS_DIR / "schema.json").read_text())
    vectors = _load(name)
    jsonschema.validate(vectors, schema)
    flags = {flag for group in vectors["testGroups"] for t in group["tests"] for flag in t["flags"]}
    assert flags <= set(vectors["notes"]), "every flag is defined in notes"
    ids = [t["tcId"] for group in vectors["testGroups"] for t in group["tests"]]
    assert len(ids) == len(set(ids)) == vectors["numberOfTests"]


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_file_equals_a_fresh_generation(name: str) -> None:
    """The vectors cannot drift from the reference: run tools/golden.py after a change."""
    assert vector_path(name).read_text() == render(BUILDERS[name]())


def test_backend_reproduces_affine_vectors(backend) -> None:
    affine = backend.module("affine")
    for group in _load("affine")["testGroups"]:
        dtype = FLOAT_DTYPES[group["dtype"]]
        bits, group_size = group["bits"], group["groupSize"]
        for test in group["tests"]:
            w = from_hex(test["w"], dtype, test["shape"])
            where = f"tcId {test['tcId']} ({', '.join(test['flags'])})"
            if test["result"] == "invalid":
                with pytest.raises(ValueError):
                    affine.quantize(backend.from_numpy(w), group_size, bits)
                continue
            stored = affine.quantize(backend.from_numpy(w), group_size, bits)
            rows, D = test["shape"]
            expected = [
                from_hex(test["wq"], np.uint32, [rows, D * bits // 32]),
                from_hex(test["scales"], dtype, [rows, D // group_size]),
                from_hex(test["biases"], dtype, [rows, D // group_size]),
            ]
            for field, a, e in zip(("wq", "scales", "biases"), stored, expected, strict=True):
                assert_same_bits(backend.to_numpy(a), e, f"{where} {field}")


def _turboquant_field_layout(name: str, shape: list[int], k_bits: int, v_bits: int):
    B, H, L, D = shape
    groups = [B, H, L, D // 32]
    return {
        "k_idx": (np.int8, shape) if k_bits == 8 else (np.uint8, [B, H, L, D * k_bits // 8]),
        "k_scales": (np.float16, groups),
        "k_zeros": (np.float16, groups),
        "v_packed": (np.uint8, [B, H, L, D * v_bits // 8]),
        "v_scales": (np.float16, groups),
    }[name]


def test_backend_reproduces_turboquant_vectors(backend) -> None:
    turboquant = backend.module("turboquant")
    for group in _load("turboquant")["testGroups"]:
        dtype = FLOAT_DTYPES[group["dtype"]]
        k_bits, v_bits = group["kBits"], group["vBits"]
        for test in group["tests"]:
            k = backend.from_numpy(from_hex(test["k"], dtype, test["shape"]))
            v = backend.from_numpy(from_hex(test["v"], dtype, test["shape"]))
            where = f"tcId {test['tcId']} ({', '.join(test['flags'])})"
            if test["result"] == "invalid":
                with pytest.raises(ValueError):
                    turboquant.encode(k, v, k_bits, v_bits)
                continue
            stored = turboquant.encode(k, v, k_bits, v_bits)
            for field in ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales"):
                dtype_, shape = _turboquant_field_layout(field, test["shape"], k_bits, v_bits)
                expected = from_hex(test[field], dtype_, shape)
                actual = backend.to_numpy(getattr(stored, field))
                assert_same_bits(actual, expected, f"{where} {field}")
            L, D = test["shape"][2], test["shape"][3]
            keys, values = turboquant.decode(stored, L, D)
            _, rotated = turboquant.decode(stored, L, D, defer_v=True)
            for field, read in (
                ("keysRead", keys),
                ("valuesRead", values),
                ("valuesRotated", rotated),
            ):
                expected = from_hex(test[field], np.float32, test["shape"])
                assert_same_bits(backend.to_numpy(read), expected, f"{where} {field}")
