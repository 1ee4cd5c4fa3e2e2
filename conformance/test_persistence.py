"""Saved caches (PERSIST-1 .. PERSIST-9): round trips of every kind within and across
backends, appends after a load, refusals of corrupt, hostile and unexpected files, atomic
saves, and mlx-lm's prompt-cache files read against mlx-lm's own loader."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models import cache as mlx_lm_cache

from kvspec.accelerated.mlx_lm.cache import CacheRecipe, kvspec_cache
from kvspec.conformance.backend import backend_of_side
from kvspec.conformance.cache_machine import assert_same_state, random_kv
from kvspec.conformance.persistence_vectors import (
    GOLDEN_FILES,
    METADATA,
    golden_bytes,
    golden_cache,
    golden_path,
)
from kvspec.reference import caches as reference_caches
from kvspec.reference import persistence as reference
from kvspec.reference.dtypes import FLOAT_DTYPES

#: Every kind (PERSIST-5), by a factory over a backend's caches package, and its head_dim.
KINDS: dict[str, tuple[Callable[[Any], Any], int]] = {
    "kv": (lambda m: m.KVCache(), 64),
    "affine": (lambda m: m.QuantizedKVCache(32, 3, "deferred"), 64),
    "rotating": (lambda m: m.RotatingKVCache(5, 2), 64),
    "rotating-affine": (lambda m: m.RotatingQuantizedKVCache(4, 64, 4, 1), 64),
    "turbo": (lambda m: m.TurboQuantKVCache(4, 3, "deferred"), 64),
    "bf16-first-affine": (lambda m: m.Bf16FirstQuantizedKVCache(64, 8, 4), 64),
    "bf16-first-affine-before-switch": (lambda m: m.Bf16FirstQuantizedKVCache(64, 4, 100), 64),
    "bf16-first-affine-start-0": (lambda m: m.Bf16FirstQuantizedKVCache(32, 2, 0), 64),
    "bf16-first-rotating": (lambda m: m.Bf16FirstRotatingQuantizedKVCache(6, 32, 6, 3), 64),
    "bf16-first-kv4": (lambda m: m.Bf16FirstKv4Head256Cache(2, "deferred"), 256),
    "bf16-first-turbo": (lambda m: m.Bf16FirstTurboQuantKVCache(8, 4, 5, "deferred"), 64),
}


def _filled(backend, kinds: list[str], lengths: list[int], dtype: str, seed: int):
    """Reference caches and the backend's twins after the same appends."""
    ref = [KINDS[kind][0](reference_caches) for kind in kinds]
    twin = [KINDS[kind][0](backend.module("caches")) for kind in kinds]
    for step, length in enumerate(lengths):
        for layer, kind in enumerate(kinds):
            head_dim = KINDS[kind][1]
            k, v = random_kv(seed + 31 * step + layer, (1, 2, length, head_dim), head_dim, dtype)
            ref[layer].update_and_fetch(k, v)
            twin[layer].update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    return ref, twin


@contextmanager
def _folder() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as folder:
        yield folder


def _persistence(backend, name: str):
    return reference if name == "reference" else backend.module("persistence")


@given(
    kinds=st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=3),
    lengths=st.lists(st.integers(1, 5), max_size=4),
    dtype=st.sampled_from(sorted(FLOAT_DTYPES)),
    writer=st.sampled_from(["reference", "backend"]),
    reader=st.sampled_from(["reference", "backend"]),
    metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
    seed=st.integers(0, 2**16),
)
def test_round_trip_then_append(
    backend, kinds, lengths, dtype, writer, reader, metadata, seed
) -> None:
    """PERSIST-1: every stored bit, the state fields and the user metadata survive a save
    and a load, written and read by either backend; appending after the load stores what
    appending to the original does."""
    dtype = FLOAT_DTYPES[dtype]
    ref, twin = _filled(backend, kinds, lengths, dtype, seed)
    saved = ref if writer == "reference" else twin
    with _folder() as folder:
        path = os.path.join(folder, "caches.safetensors")
        _persistence(backend, writer).save_caches(path, saved, metadata)
        loaded, loaded_metadata = _persistence(backend, reader).load_caches(path)
    assert loaded_metadata == metadata
    assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in ref]
    checker = backend_of_side(backend, reader)
    for original, restored in zip(ref, loaded, strict=True):
        assert restored.signature() == original.signature()
        assert restored.checks == original.checks
        assert_same_state(original, restored, checker)
    for layer, (original, restored) in enumerate(zip(ref, loaded, strict=True)):
        head_dim = KINDS[kinds[layer]][1]
        for length in (1, 3):
            k, v = random_kv(seed + layer + length, (1, 2, length, head_dim), head_dim, dtype)
            original.update_and_fetch(k, v)
            restored.update_and_fetch(checker.from_numpy(k), checker.from_numpy(v))
        assert_same_state(original, restored, checker)


@pytest.fixture(scope="module")
def saved_file(backend) -> Iterator[tuple[str, bytes]]:
    """A file of every kind, written by the backend under test: its path and bytes."""
    _, twin = _filled(backend, list(KINDS), [3, 1, 4, 1], FLOAT_DTYPES["bfloat16"], 7)
    with _folder() as folder:
        path = os.path.join(folder, "every-kind.safetensors")
        backend.module("persistence").save_caches(path, twin, {"model": "test"})
        with open(path, "rb") as f:
            yield path, f.read()


def _refused(backend, data: bytes, match: str | None = None) -> str:
    """Write `data` to a file and assert both backends refuse it; the backend's message."""
    with _folder() as folder:
        path = os.path.join(folder, "broken.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        with pytest.raises(ValueError, match=match):
            reference.load_caches(path)
        with pytest.raises(ValueError, match=match) as refused:
            backend.module("persistence").load_caches(path)
    return str(refused.value)


def test_every_kind_loads(backend, saved_file) -> None:
    """The fixture itself loads, so each refusal below is the corruption's."""
    path, _ = saved_file
    loaded, metadata = backend.module("persistence").load_caches(path)
    assert len(loaded) == len(KINDS) and metadata == {"model": "test"}
    assert any(c.signature().startswith("kv:bf16-first:kv:") for c in loaded)
    assert "kv:bf16-first:kv" in [c.signature() for c in loaded]


@pytest.mark.parametrize("size", [0, 1, 7, 8, 9, 100, -1000, -1])
def test_truncated_or_empty_file_is_refused(backend, saved_file, size: int) -> None:
    """PERSIST-2, PERSIST-7."""
    _, data = saved_file
    _refused(backend, data[:size])


def test_garbage_is_refused(backend) -> None:
    """PERSIST-2: random bytes, and a length that points past the file."""
    rng = np.random.default_rng(3)
    _refused(backend, rng.integers(0, 256, 4096, np.uint8).tobytes(), "not a readable")
    _refused(backend, struct.pack("<Q", 2**63) + b"{}", "exceeds")


def test_a_safetensors_file_of_neither_format_is_named_so(backend) -> None:
    """PERSIST-3, PERSIST-9: a well-formed safetensors file without kvspec's document is not
    a kvspec caches file, and is not called mlx-lm's unless it has mlx-lm's class entries."""
    with _folder() as folder:
        path = os.path.join(folder, "weights.safetensors")
        mx.save_safetensors(path, {"w": mx.zeros((2,))}, {"format": "pt"})
        with open(path, "rb") as f:
            _refused(backend, f.read(), "is not a kvspec caches file")


def _header_length(data: bytes) -> int:
    return 8 + int.from_bytes(data[:8], "little")


@pytest.mark.parametrize("region", ["header", "file"])
@given(where=st.floats(0, 1, exclude_max=True), xor=st.integers(1, 255))
def test_flipped_byte_is_refused(backend, saved_file, region: str, where: float, xor: int) -> None:
    """PERSIST-4: any changed byte, drawn from the length and the header (a third of the
    file) or from the whole file, refused by both backends."""
    _, data = saved_file
    flipped = bytearray(data)
    span = _header_length(data) if region == "header" else len(data)
    flipped[int(where * span)] ^= xor
    _refused(backend, bytes(flipped))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (b'\\"model\\":\\"test\\"', b'\\"model\\":\\"tesT\\"'),
        (b'\\"offset\\":9', b'\\"offset\\":8'),
    ],
    ids=["user-metadata", "offset"],
)
def test_edited_document_is_refused(backend, saved_file, old: bytes, new: bytes) -> None:
    """PERSIST-4: an edit that leaves the header well formed and consistent is refused by
    the header digest."""
    _, data = saved_file
    assert old in data
    _refused(backend, data.replace(old, new, 1), "header checksum")


def _tampered(
    data: bytes,
    edit: Callable[[dict, dict[str, np.ndarray]], None],
) -> bytes:
    """The file with its document and tensors edited, then every digest made right again,
    so only what `edit` changed can make a loader refuse it."""
    with _folder() as folder:
        path = os.path.join(folder, "tampered.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        header = reference.read_header(path)
        tensors = reference.read_safetensors(path, header)
        document = json.loads(header.metadata[reference.DOCUMENT_KEY])
        edit(document, tensors)
        for layer, record in enumerate(document["caches"]):
            for slot, array in enumerate(record["arrays"] if isinstance(record, dict) else []):
                name = f"{layer}.{slot}"
                if name in tensors and isinstance(array, dict):
                    stored = np.ascontiguousarray(tensors[name]).tobytes()
                    array["sha256"] = hashlib.sha256(stored).hexdigest()
        metadata = {
            reference.DOCUMENT_KEY: json.dumps(document),
            reference.DIGEST_KEY: reference.DIGEST_PLACEHOLDER,
        }
        reference.write_safetensors(path, tensors, metadata)
        with open(path, "r+b") as f:
            reference.seal(f)
        with open(path, "rb") as f:
            return f.read()


def _layer(document: dict, kind: str) -> int:
    return next(i for i, r in enumerate(document["caches"]) if r["kind"] == kind)


def _set_array(document: dict, tensors: dict, name: str, array: np.ndarray) -> None:
    layer, slot = (int(part) for part in name.split("."))
    tensors[name] = array
    record = document["caches"][layer]["arrays"][slot]
    record["dtype"] = reference._numpy_dtype_code(array)
    record["shape"] = list(array.shape)


def _affine_scales_cut(document: dict, tensors: dict) -> None:
    name = f"{_layer(document, 'QuantizedKVCache')}.1"
    _set_array(document, tensors, name, tensors[name][..., :1])


def _affine_words_signed(document: dict, tensors: dict) -> None:
    name = f"{_layer(document, 'QuantizedKVCache')}.0"
    _set_array(document, tensors, name, tensors[name].view(np.int32))


def _plain_values_float16(document: dict, tensors: dict) -> None:
    name = f"{_layer(document, 'KVCache')}.1"
    _set_array(document, tensors, name, tensors[name].astype(np.float16))


def _turbo_scales_float32(document: dict, tensors: dict) -> None:
    name = f"{_layer(document, 'TurboQuantKVCache')}.1"
    _set_array(document, tensors, name, tensors[name].astype(np.float32))


def _set(kind: str, field: str, value: Any) -> Callable[[dict, dict], None]:
    def edit(document: dict, tensors: dict) -> None:
        document["caches"][_layer(document, kind)][field] = value

    return edit


def _set_parameter(kind: str, name: str, value: Any) -> Callable[[dict, dict], None]:
    def edit(document: dict, tensors: dict) -> None:
        document["caches"][_layer(document, kind)]["parameters"][name] = value

    return edit


def _extra_tensor(document: dict, tensors: dict) -> None:
    tensors["99.0"] = np.zeros(4, np.uint8)


def _version(document: dict, tensors: dict) -> None:
    document["version"] = 3


def _padding_in_version_1(document: dict, tensors: dict) -> None:
    document["caches"][_layer(document, "KVCache")]["left_padding"] = [0]


def _padding_of_no_rows(document: dict, tensors: dict) -> None:
    document["version"] = 2
    document["caches"][_layer(document, "KVCache")]["left_padding"] = []


def _record_of_a_number(document: dict, tensors: dict) -> None:
    document["caches"].append(1)


def _array_of_a_string(document: dict, tensors: dict) -> None:
    document["caches"][_layer(document, "KVCache")]["arrays"][0] = "keys"


def _array_record(document: dict, kind: str, slot: int) -> dict:
    return document["caches"][_layer(document, kind)]["arrays"][slot]


def _array_dtype_alone(document: dict, tensors: dict) -> None:
    record = _array_record(document, "KVCache", 0)
    record["dtype"] = "F16" if record["dtype"] != "F16" else "F32"


def _array_shape_alone(document: dict, tensors: dict) -> None:
    _array_record(document, "KVCache", 0)["shape"].append(1)


TAMPERS = {
    "format version 3": (_version, "format version 3"),
    "left padding in a version 1 file": (_padding_in_version_1, "needs format version 2"),
    "affine scales of the wrong width": (_affine_scales_cut, "contradict"),
    "affine words of the wrong dtype": (_affine_words_signed, "contradict"),
    "plain values of another dtype": (_plain_values_float16, "contradict"),
    "TurboQuant scales in float32": (_turbo_scales_float32, "contradict"),
    "offset beyond the rows": (_set("KVCache", "offset", 99), "offset"),
    "ring index beyond the buffer": (_set("RotatingKVCache", "ring_index", 99), "ring index"),
    "growable cache with a ring index": (_set("KVCache", "ring_index", 1), "ring index"),
    "unknown kind": (_set("KVCache", "kind", "PagedCache"), "kind"),
    "signature of other widths": (
        _set("QuantizedKVCache", "signature", "kv:affine:4:32"),
        "makes a",
    ),
    "widths the arrays do not hold": (
        _set_parameter("QuantizedKVCache", "bits", 4),
        "cannot restore",
    ),
    "unsupported parameter": (_set_parameter("QuantizedKVCache", "bits", 7), "bits"),
    "boolean parameter": (_set_parameter("RotatingKVCache", "keep", True), "keep"),
    "tensor of no cache": (_extra_tensor, "belong to no cache"),
    "another format": (lambda document, tensors: document.update(format="other"), "format"),
    "left padding of no rows": (_padding_of_no_rows, "left_padding is \\[\\]"),
    "a record that is not a map": (_record_of_a_number, "not a list of records"),
    "an array that is not a map": (_array_of_a_string, "missing"),
    "an array's dtype alone": (_array_dtype_alone, "the document"),
    "an array's shape alone": (_array_shape_alone, "the document"),
}


@pytest.mark.parametrize("tamper", sorted(TAMPERS))
def test_contradictory_file_is_refused(backend, saved_file, tamper: str) -> None:
    """PERSIST-3, PERSIST-5, PERSIST-7: with every digest right, a file whose arrays or
    fields contradict each other is refused by both backends, naming the problem."""
    edit, match = TAMPERS[tamper]
    _refused(backend, _tampered(saved_file[1], edit), match)


def test_untampered_rewrite_loads(backend, saved_file) -> None:
    """`_tampered` with no edit gives a loadable file: the refusals above are the edits'."""
    data = _tampered(saved_file[1], lambda document, tensors: None)
    with _folder() as folder:
        path = os.path.join(folder, "same.safetensors")
        with open(path, "wb") as f:
            f.write(data)
        assert len(backend.module("persistence").load_caches(path).caches) == len(KINDS)


def _hostile(entries: dict[str, Any], data: bytes = b"") -> bytes:
    text = json.dumps(entries).encode()
    return struct.pack("<Q", len(text)) + text + data


#: A well-formed tensor of the 16 data bytes the hostile headers below are given.
SIXTEEN_BYTES = {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}

#: Headers each wrong in one way, and what the refusal must name.
HOSTILE_HEADERS = {
    "huge-shape": (
        {"0.0": {"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 16]}},
        "0.0",
    ),
    "huge-offsets": ({"0.0": {"dtype": "U8", "shape": [2**62], "data_offsets": [0, 2**62]}}, "0.0"),
    "overlap": (
        {"0.0": SIXTEEN_BYTES, "0.1": {"dtype": "U8", "shape": [16], "data_offsets": [8, 24]}},
        "0.1",
    ),
    "negative": ({"0.0": {"dtype": "U8", "shape": [-16], "data_offsets": [0, 16]}}, "0.0"),
    "unknown-dtype": ({"0.0": {"dtype": "C64", "shape": [2], "data_offsets": [0, 16]}}, "0.0"),
    "gap": ({"0.0": {"dtype": "U8", "shape": [8], "data_offsets": [8, 16]}}, "0.0"),
    # Sizes that add up, each with one field that is not a count or pair of counts.
    "boolean-in-shape": (
        {"0.0": {"dtype": "U8", "shape": [16, True], "data_offsets": [0, 16]}},
        "shape",
    ),
    "three-offsets": (
        {"0.0": {"dtype": "U8", "shape": [16], "data_offsets": [0, 8, 16]}},
        "data_offsets",
    ),
    "metadata-of-a-number": ({"__metadata__": {"n": 1}, "0.0": SIXTEEN_BYTES}, "__metadata__"),
    "metadata-a-list": ({"__metadata__": ["n"], "0.0": SIXTEEN_BYTES}, "__metadata__"),
}


@pytest.mark.parametrize("hostile", sorted(HOSTILE_HEADERS))
def test_hostile_header_is_refused_before_reading(backend, hostile: str) -> None:
    """PERSIST-2: declared sizes and offsets are held against the file's size first, and
    every field has the form it must have: the refusal names what is wrong."""
    entries, named = HOSTILE_HEADERS[hostile]
    message = _refused(backend, _hostile(entries, bytes(16)), "not a readable safetensors")
    assert named in message


@pytest.mark.parametrize("room", [-1, 0])
def test_a_header_is_held_to_the_limit(backend, saved_file, monkeypatch, room: int) -> None:
    """PERSIST-2: N <= min(file size - 8, 100 MiB); here the limit made N + room bytes."""
    path, data = saved_file
    monkeypatch.setattr(reference, "MAX_HEADER_BYTES", _header_length(data) - 8 + room)
    if room < 0:
        _refused(backend, data, "header length")
    else:
        assert len(backend.module("persistence").load_caches(path).caches) == len(KINDS)


def test_a_digest_of_other_characters_is_a_checksum_mismatch(backend, saved_file) -> None:
    """PERSIST-4: the digest is 64 lowercase hex digits. 64 characters of which one is not
    (an "A" written as the JSON escape \\u0041, which the digest's field as a writer writes it
    does not match) are a mismatch like any other, not a header without the field."""
    _, data = saved_file
    field = f'"{reference.DIGEST_KEY}":"'.encode()
    at = data.index(field) + len(field)
    header = data[8:at] + b"\\u0041" + b"0" * 63 + data[at + 64 : _header_length(data)]
    edited = struct.pack("<Q", len(header)) + header + data[_header_length(data) :]
    _refused(backend, edited, "header checksum")


def test_expectations(backend, saved_file) -> None:
    """PERSIST-8: layer count, head_dim and scheme; what a scheme composes passes."""
    load_caches = backend.module("persistence").load_caches
    expected = backend.module("persistence").Expected
    path, _ = saved_file
    with pytest.raises(ValueError, match="holds 11 caches, expected 9"):
        load_caches(path, expected(layers=9))
    with pytest.raises(ValueError, match="head dims"):
        load_caches(path, expected(head_dim=64))
    with pytest.raises(ValueError, match="composes"):
        load_caches(path, expected(scheme="affine:4:64"))
    family = backend.module("caches")
    scheme = family.parse_scheme("affine:4:64:start=2")
    composed = [
        family.composed_full_attention_cache(scheme, 0, "deferred"),
        family.composed_sliding_attention_cache(scheme, 1, 8),
        family.composed_full_attention_cache(scheme, 2),
    ]
    for cache in composed:
        k, v = random_kv(1, (1, 2, 3, 64), 64, FLOAT_DTYPES["float16"])
        cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    with _folder() as folder:
        saved = os.path.join(folder, "scheme.safetensors")
        backend.module("persistence").save_caches(saved, composed)
        loaded = load_caches(saved, expected("affine:4:64:start=2", 3, 64))
        assert len(loaded.caches) == 3
        with pytest.raises(ValueError, match=r"cache 0 .* composes"):
            load_caches(saved, expected("affine:4:64"))
        with pytest.raises(ValueError, match="cache 0"):
            load_caches(saved, expected("turbo:k8v4:start=2"))


def test_save_refuses_what_it_cannot_save(backend) -> None:
    """PERSIST-1: a deferred failure, another backend's cache, metadata not str to str;
    nothing is written."""
    save_caches = backend.module("persistence").save_caches
    family = backend.module("caches")
    failed = family.QuantizedKVCache(64, 4, "deferred")
    k = np.full((1, 1, 1, 64), np.inf, np.float32)
    failed.update_and_fetch(backend.from_numpy(k), backend.from_numpy(k))
    with _folder() as folder:
        path = os.path.join(folder, "never.safetensors")
        with pytest.raises(ValueError, match="NaN or inf"):
            save_caches(path, [family.KVCache(), failed])
        with pytest.raises(ValueError, match="not a cache kind"):
            save_caches(path, [mlx_lm_cache.KVCache()])
        if backend.name != "reference":
            with pytest.raises(ValueError, match="not a cache kind"):
                save_caches(path, [reference_caches.KVCache()])
        with pytest.raises(ValueError, match="metadata"):
            save_caches(path, [family.KVCache()], {"n": 1})
        assert os.listdir(folder) == []


def test_failed_save_leaves_the_previous_file(backend, saved_file, monkeypatch) -> None:
    """PERSIST-6: a write failing or interrupted midway, or a failing rename, leaves the
    previous file whole and no temporary file; a missing folder creates nothing."""
    persistence = backend.module("persistence")
    family = backend.module("caches")
    _, previous = saved_file

    def partial_write(path: str, tensors: dict, metadata: dict) -> None:
        with open(path, "wb") as f:
            f.write(b"partial")
        raise OSError("no space left on device")

    def interrupted_write(path: str, tensors: dict, metadata: dict) -> None:
        with open(path, "wb") as f:
            f.write(b"partial")
        raise KeyboardInterrupt

    with _folder() as folder:
        path = os.path.join(folder, "caches.safetensors")
        with open(path, "wb") as f:
            f.write(previous)
        with monkeypatch.context() as patch:
            patch.setattr(persistence, "write_safetensors", partial_write)
            with pytest.raises(OSError, match="no space"):
                persistence.save_caches(path, [family.KVCache()])
        with monkeypatch.context() as patch:
            patch.setattr(persistence, "write_safetensors", interrupted_write)
            with pytest.raises(KeyboardInterrupt):
                persistence.save_caches(path, [family.KVCache()])
        with monkeypatch.context() as patch:

            def failing_replace(source: str, target: str) -> None:
                raise OSError("interrupted")

            patch.setattr(os, "replace", failing_replace)
            with pytest.raises(OSError, match="interrupted"):
                persistence.save_caches(path, [family.KVCache()])
        assert os.listdir(folder) == ["caches.safetensors"]
        with open(path, "rb") as f:
            assert f.read() == previous
        with pytest.raises(FileNotFoundError):
            persistence.save_caches(os.path.join(folder, "missing", "x"), [family.KVCache()])
        assert os.listdir(folder) == ["caches.safetensors"]


def _mlx_lm_caches() -> list[Any]:
    """mlx-lm caches of the three kinds PERSIST-9 reads, a wrapped ring and an empty one."""
    caches = [
        mlx_lm_cache.KVCache(),
        mlx_lm_cache.RotatingKVCache(6, 1),
        mlx_lm_cache.QuantizedKVCache(32, 4),
        mlx_lm_cache.RotatingKVCache(300),
        mlx_lm_cache.KVCache(),
    ]
    for step, length in enumerate([5, 1, 1, 3, 1, 1]):
        k, v = random_kv(step, (1, 2, length, 64), 64, FLOAT_DTYPES["bfloat16"])
        for cache in caches[:4]:
            cache.update_and_fetch(mx.array(k), mx.array(v))
    return caches


@pytest.mark.parametrize("reader", ["reference", "backend"])
def test_mlx_lm_prompt_cache_files(backend, reader: str) -> None:
    """PERSIST-9: mlx-lm's files load into kvspec caches that, appended to, fetch and store
    what mlx-lm's own loaded caches do; each loader names the other format."""
    persistence = _persistence(backend, reader)
    checker = backend_of_side(backend, reader)
    with _folder() as folder:
        path = os.path.join(folder, "prompt.safetensors")
        mlx_lm_cache.save_prompt_cache(path, _mlx_lm_caches(), {"model": "m"})
        loaded, metadata = persistence.load_mlx_lm_prompt_cache(path)
        theirs = mlx_lm_cache.load_prompt_cache(path)
        with pytest.raises(ValueError, match="load_mlx_lm_prompt_cache"):
            persistence.load_caches(path)
        kvspec_path = os.path.join(folder, "kvspec.safetensors")
        persistence.save_caches(kvspec_path, loaded)
        with pytest.raises(ValueError, match="load_caches"):
            persistence.load_mlx_lm_prompt_cache(kvspec_path)
    assert metadata == {"model": "m"}
    assert [type(c).__name__ for c in loaded] == [type(c).__name__ for c in theirs]
    assert loaded[4].offset == 0 and loaded[4].layout is None
    for step, length in enumerate([1, 4, 1]):
        k, v = random_kv(50 + step, (1, 2, length, 64), 64, FLOAT_DTYPES["bfloat16"])
        for ours, mine in zip(loaded, theirs, strict=True):
            fetched = ours.update_and_fetch(checker.from_numpy(k), checker.from_numpy(v))
            expected = mine.update_and_fetch(mx.array(k), mx.array(v))
            if isinstance(mine, mlx_lm_cache.QuantizedKVCache):
                got = [checker.to_numpy(a) for a in ours.state().arrays]
                want = [*expected[0], *expected[1]]
            else:
                got = [checker.to_numpy(a) for a in fetched]
                want = list(expected)
            for g, w in zip(got, want, strict=True):
                w = np.array(w.view(mx.uint16)) if w.dtype == mx.bfloat16 else np.array(w)
                assert g.view(w.dtype).tobytes() == w.tobytes(), type(mine).__name__


def test_mlx_lm_file_of_other_classes_is_refused(backend) -> None:
    """PERSIST-9: a class without a kvspec counterpart is named; the adapter's files are
    sent to the adapter's loader."""
    with _folder() as folder:
        path = os.path.join(folder, "chunked.safetensors")
        chunked = mlx_lm_cache.ChunkedKVCache(8)
        k = mx.zeros((1, 1, 2, 64))
        chunked.update_and_fetch(k, k)
        mlx_lm_cache.save_prompt_cache(path, [mlx_lm_cache.KVCache(), chunked])
        with pytest.raises(ValueError, match="ChunkedKVCache"):
            backend.module("persistence").load_mlx_lm_prompt_cache(path)
        adapter_path = os.path.join(folder, "adapter.safetensors")
        adapter_cache = kvspec_cache(CacheRecipe("affine:4:64", 0))
        adapter_cache.update_and_fetch(k, k)
        mlx_lm_cache.save_prompt_cache(adapter_path, [adapter_cache])
        with pytest.raises(ValueError, match=r"mlx_lm\.load_prompt_cache"):
            backend.module("persistence").load_mlx_lm_prompt_cache(adapter_path)


@pytest.mark.parametrize("reader", ["reference", "backend"])
def test_an_mlx_lm_integer_is_one_signed_integer(backend, reader: str) -> None:
    """PERSIST-9: an offset of another dtype or size, or none, is refused; an int32 -1 is
    read as -1 (and then refused by the cache's invariants), not as 2^32 - 1."""
    persistence = _persistence(backend, reader)
    cache = mlx_lm_cache.KVCache()
    k = mx.zeros((1, 1, 3, 64))
    cache.update_and_fetch(k, k)
    offsets = [  # a float, a pair, none, minus one
        (mx.array(3.0), "0.2 is not an integer scalar"),
        (mx.array([3, 3], mx.int32), "0.2 is not an integer scalar"),
        (None, "0.2 is not an integer scalar"),
        (mx.array(-1, mx.int32), "offset=-1 "),
    ]
    with _folder() as folder:
        path = os.path.join(folder, "prompt.safetensors")
        mlx_lm_cache.save_prompt_cache(path, [cache])
        arrays, metadata = mx.load(path, return_metadata=True)
        assert arrays["0.2"].dtype == mx.int32 and arrays["0.2"].ndim == 0
        for offset, match in offsets:
            edited = {key: a for key, a in arrays.items() if key != "0.2"}
            if offset is not None:
                edited["0.2"] = offset
            mx.save_safetensors(path, edited, metadata)
            with pytest.raises(ValueError, match=match):
                persistence.load_mlx_lm_prompt_cache(path)


@pytest.mark.parametrize("name", sorted(GOLDEN_FILES))
def test_golden_file(backend, name: str) -> None:
    """docs/vectors/persistence: the reference writes each golden file byte for byte (so
    `tools/golden.py` left none stale), and the backend loads it into the state the
    reference's cache holds."""
    path = golden_path(name)
    assert path.read_bytes() == golden_bytes(name), f"{path} is stale: run tools/golden.py"
    loaded, metadata = backend.module("persistence").load_caches(path)  # a Path: PathLike
    assert metadata == METADATA
    (cache,) = loaded
    assert_same_state(golden_cache(reference_caches, name, lambda a: a), cache, backend)
