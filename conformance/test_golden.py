"""Golden vectors (docs/vectors): valid against the schema, laid out as schema.json says,
equal to a fresh generation from the reference, within the size budget, and reproduced
bit for bit by the backend under test."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvspec.conformance.cache_scenarios import expected_outcome, play
from kvspec.conformance.compare import assert_same_bits, rank_of
from kvspec.conformance.vectors import (
    BUILDERS,
    CODEC_FILES,
    DEFERRED_TURBOQUANT_FIELDS,
    VECTORS_DIR,
    array_fields,
    field_array,
    load_schema,
    render,
    vector_path,
)
from kvspec.reference import turboquant as reference_turboquant
from kvspec.reference.dtypes import FLOAT_DTYPES

if not VECTORS_DIR.exists():
    pytest.skip("docs/vectors is not beside this checkout", allow_module_level=True)

MAX_TOTAL_BYTES = 5 * 2**20

#: An invalid affine test's deferred fields, in quantize_deferred's order (DEFER-1).
DEFERRED_AFFINE_FIELDS = ("deferredWq", "deferredScales", "deferredBiases")


def _load(name: str) -> dict:
    return json.loads(vector_path(name).read_text())


def _tests(name: str):
    for group in _load(name)["testGroups"]:
        for test in group["tests"]:
            yield group, test


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_file_follows_the_schema(name: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    vectors = _load(name)
    jsonschema.validate(vectors, load_schema())
    flags = {flag for group in vectors["testGroups"] for t in group["tests"] for flag in t["flags"]}
    assert flags <= set(vectors["notes"]), "every flag is defined in notes"
    ids = [t["tcId"] for group in vectors["testGroups"] for t in group["tests"]]
    assert len(ids) == len(set(ids)) == vectors["numberOfTests"]


@pytest.mark.parametrize("name", CODEC_FILES)
def test_every_array_has_its_schema_layout(name: str) -> None:
    """Each hex field holds exactly the bytes of the dtype and shape schema.json derives
    from the test's shape and its group's parameters; the shape agrees with the group."""
    schema = load_schema()
    for group, test in _tests(name):
        *_, D = test["shape"]
        if name == "turboquant":
            assert group["headDim"] == D, f"tcId {test['tcId']}: D {D} in a group of {group}"
        else:
            assert D % group["groupSize"] == 0, f"tcId {test['tcId']}"
        for field in array_fields(schema, name):
            if field in test:
                array = field_array(schema, name, group, test, field)
                assert array.nbytes * 2 == len(test[field]), f"tcId {test['tcId']} {field}"


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_file_equals_a_fresh_generation(name: str) -> None:
    """The vectors cannot drift from the reference: run tools/golden.py after a change."""
    assert vector_path(name).read_text() == render(BUILDERS[name]())


def test_vectors_fit_the_size_budget() -> None:
    total = sum(path.stat().st_size for path in VECTORS_DIR.rglob("*") if path.is_file())
    assert total <= MAX_TOTAL_BYTES, f"docs/vectors holds {total} bytes"


def test_every_centroid_of_every_codebook_is_used() -> None:
    schema = load_schema()
    used: dict[int, set[int]] = {bits: set() for bits in reference_turboquant.VALUE_BITS}
    for group, test in _tests("turboquant"):
        if test["result"] == "valid":
            packed = field_array(schema, "turboquant", group, test, "v_packed")
            codes = reference_turboquant.unpack_bits(packed, group["vBits"], group["headDim"])
            used[group["vBits"]] |= set(np.unique(codes).tolist())
    for bits, codes in used.items():
        assert codes == set(range(2**bits)), f"{bits}-bit centroids never coded"


def test_backend_reproduces_affine_vectors(backend) -> None:
    affine = backend.module("affine")
    schema = load_schema()
    for group, test in _tests("affine"):
        bits, group_size = group["bits"], group["groupSize"]
        w = field_array(schema, "affine", group, test, "w")
        where = f"tcId {test['tcId']} ({', '.join(test['flags'])})"
        if test["result"] == "invalid":
            with pytest.raises(ValueError):
                affine.quantize(backend.from_numpy(w), group_size, bits)
            *stored, failure = affine.quantize_deferred(backend.from_numpy(w), group_size, bits)
            for field, actual in zip(DEFERRED_AFFINE_FIELDS, stored, strict=True):
                expected = field_array(schema, "affine", group, test, field)
                assert_same_bits(backend.to_numpy(actual), expected, f"{where} {field}")
            assert rank_of(backend.to_numpy(failure)) == test["failureRank"], where
            continue
        stored = affine.quantize(backend.from_numpy(w), group_size, bits)
        for field, actual in zip(("wq", "scales", "biases"), stored, strict=True):
            expected = field_array(schema, "affine", group, test, field)
            assert_same_bits(backend.to_numpy(actual), expected, f"{where} {field}")


def test_backend_reproduces_turboquant_vectors(backend) -> None:
    turboquant = backend.module("turboquant")
    schema = load_schema()
    for group, test in _tests("turboquant"):
        k_bits, v_bits = group["kBits"], group["vBits"]
        k = backend.from_numpy(field_array(schema, "turboquant", group, test, "k"))
        v = backend.from_numpy(field_array(schema, "turboquant", group, test, "v"))
        where = f"tcId {test['tcId']} ({', '.join(test['flags'])})"
        if test["result"] == "invalid":
            with pytest.raises(ValueError):
                turboquant.encode(k, v, k_bits, v_bits)
            if "failureRank" in test:
                stored, failure = turboquant.encode_deferred(k, v, k_bits, v_bits)
                for field, name in DEFERRED_TURBOQUANT_FIELDS.items():
                    expected = field_array(schema, "turboquant", group, test, name)
                    actual = backend.to_numpy(getattr(stored, field))
                    assert_same_bits(actual, expected, f"{where} {name}")
                assert rank_of(backend.to_numpy(failure)) == test["failureRank"], where
            continue
        stored = turboquant.encode(k, v, k_bits, v_bits)
        for field in ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales"):
            expected = field_array(schema, "turboquant", group, test, field)
            assert_same_bits(backend.to_numpy(getattr(stored, field)), expected, f"{where} {field}")
        L, D = test["shape"][2], test["shape"][3]
        keys, values = turboquant.decode(stored, L, D)
        _, rotated = turboquant.decode(stored, L, D, defer_v=True)
        for field, read in (("keysRead", keys), ("valuesRead", values), ("valuesRotated", rotated)):
            expected = field_array(schema, "turboquant", group, test, field)
            assert_same_bits(backend.to_numpy(read), expected, f"{where} {field}")


def test_cache_scenario_arrays_hold_their_bytes() -> None:
    for _, test in _tests("caches"):
        for step in test["steps"]:
            for array in step["after"]["arrays"]:
                size = np.dtype(FLOAT_DTYPES.get(array["dtype"], array["dtype"])).itemsize
                expected = 2 * size * int(np.prod(array["shape"]))
                assert len(array["hex"]) == expected, f"tcId {test['tcId']} {array['name']}"


def test_backend_reproduces_cache_scenarios(backend) -> None:
    caches = backend.module("caches")
    for group, test in _tests("caches"):
        steps = test["steps"]
        outcomes = play(caches, backend.from_numpy, backend.to_numpy, group, steps)
        for index, (step, actual) in enumerate(zip(steps, outcomes, strict=True)):
            where = f"tcId {test['tcId']} ({group['cache']}) step {index} ({step['op']})"
            expected = expected_outcome(step)
            for key in ("rejected", "trimmed"):
                assert actual.get(key) == expected.get(key), f"{where}: {key} differs"
            for key, value in expected["after"].items():
                assert actual["after"][key] == value, f"{where}: {key} differs"
