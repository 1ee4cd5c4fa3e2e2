"""Saved caches: a list of caches in one safetensors file (spec PERSIST-1 .. PERSIST-9), in
NumPy.

The steps are array-agnostic and written once here, over `ArrayFiles`, the few things a
backend does with its arrays (write a file, read its tensors, hash an array's bytes). This
module reads and writes the documented layout itself, so a port can follow it byte for
byte; the MLX backend writes and reads through MLX's own safetensors support and shares
every check.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, BinaryIO, NamedTuple

import numpy as np

from kvspec.reference import dtypes
from kvspec.reference.caches.bf16_first import Bf16FirstCache
from kvspec.reference.caches.protocol import Cache, CacheState

#: What the document in a file's metadata names itself (PERSIST-3).
FORMAT = "kvspec-caches"
#: The newest layout version this module writes and reads (PERSIST-3): 2 adds the left
#: padding of rows of their own lengths (ROWS-5); a file without any is written as 1.
FORMAT_VERSION = 2
#: The layout versions this module reads.
READ_VERSIONS = (1, 2)
#: The metadata entries: the document and the header digest (PERSIST-3, PERSIST-4).
DOCUMENT_KEY = "kvspec"
DIGEST_KEY = "kvspec.header_sha256"
#: The digest's digits while the digest is computed (PERSIST-4).
DIGEST_PLACEHOLDER = "0" * 64
#: The largest header a reader accepts: safetensors' own limit (PERSIST-2).
MAX_HEADER_BYTES = 100 * 2**20

#: safetensors dtype codes and the NumPy formats they hold, little-endian (PERSIST-2).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": dtypes.BFLOAT16,
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "I64": np.dtype("<i8"),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
}
DTYPE_SIZES = {code: dtype.itemsize for code, dtype in NUMPY_DTYPES.items()}

#: Each cache kind a file may hold and its constructor's parameters (PERSIST-5).
KIND_PARAMETERS: dict[str, tuple[str, ...]] = {
    "KVCache": ("checks",),
    "QuantizedKVCache": ("group_size", "bits", "checks"),
    "RotatingKVCache": ("max_size", "keep", "checks"),
    "RotatingQuantizedKVCache": ("max_size", "group_size", "bits", "keep", "checks"),
    "TurboQuantKVCache": ("k_bits", "v_bits", "kernels", "checks"),
    "Bf16FirstQuantizedKVCache": ("group_size", "bits", "start", "checks"),
    "Bf16FirstKv4Head256Cache": ("start", "checks"),
    "Bf16FirstRotatingQuantizedKVCache": ("max_size", "group_size", "bits", "start", "checks"),
    "Bf16FirstTurboQuantKVCache": ("k_bits", "v_bits", "start", "kernels", "checks"),
}
#: Parameters held as text; every other one is an integer (PERSIST-5).
TEXT_PARAMETERS = ("checks", "kernels")


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: dtype code, shape, and its bytes [begin, end)
    in the data section (PERSIST-2)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked safetensors header (PERSIST-2).

    tensors: by name. metadata: the `__metadata__` strings. stored: the 8 length bytes and
    the header exactly as the file holds them. data_start: the file offset of the data.
    """

    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]
    stored: bytes
    data_start: int


class LoadedCaches(NamedTuple):
    """What `load_caches` returns (PERSIST-1): the caches in file order and the user
    metadata."""

    caches: list[Any]
    metadata: dict[str, str]


@dataclass(frozen=True)
class Expected:
    """What a caller expects of a file (PERSIST-8): a KV storage scheme in its short form
    (SCHEME-2) that must have composed every cache, a layer count, a head_dim of every
    cache's keys and values. None checks nothing."""

    scheme: str | None = None
    layers: int | None = None
    head_dim: int | None = None


@dataclass(frozen=True)
class ArrayFiles:
    """What a backend does with its arrays for persistence.

    family: the backend's caches package. float_dtypes: its float formats by spec name.
    write(path, tensors, metadata): a safetensors file of `tensors` (PERSIST-2).
    read(path, header): the tensors of a file whose header is checked.
    stored_bytes(array): a buffer of the array's elements as little-endian bytes,
        row-major (hashed and written without a copy of its own).
    dtype_code(array): its safetensors dtype code.
    """

    family: ModuleType
    float_dtypes: dict[str, Any]
    write: Callable[[str, dict[str, Any], dict[str, str]], None]
    read: Callable[[str, SafetensorsHeader], dict[str, Any]]
    stored_bytes: Callable[[Any], Any]
    dtype_code: Callable[[Any], str]


def _corrupt(path: str, why: str) -> ValueError:
    return ValueError(f"{path}: not a readable safetensors file: {why}")


def _is_count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def read_header(path: str) -> SafetensorsHeader:
    """PERSIST-2: the header of `path`, checked against the file's size before any tensor
    is read: a length that fits, JSON naming known dtypes, shapes of counts, and tensors
    whose byte ranges match their shapes and tile the data section without gap or overlap."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise _corrupt(path, f"{size} bytes, fewer than the 8 of the header length")
        length = int.from_bytes(prefix, "little")
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise _corrupt(
                path,
                f"header length {length} exceeds the file's {size - 8} bytes or the "
                f"{MAX_HEADER_BYTES}-byte limit",
            )
        text = f.read(length)
    try:
        header = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _corrupt(path, f"header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _corrupt(path, "__metadata__ is not a map of strings to strings")
    data_length = size - 8 - length
    tensors = {
        name: _tensor_entry(path, name, entry, data_length) for name, entry in header.items()
    }
    position = 0
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != position:
            raise _corrupt(path, f"tensor {name!r} starts at {entry.begin}, expected {position}")
        position = entry.end
    if position != data_length:
        raise _corrupt(path, f"tensors cover {position} bytes of a {data_length}-byte data section")
    return SafetensorsHeader(tensors, metadata, prefix + text, 8 + length)


def _tensor_entry(path: str, name: str, entry: object, data_length: int) -> TensorEntry:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _corrupt(path, f"tensor {name!r} is not {{dtype, shape, data_offsets}}")
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if dtype not in DTYPE_SIZES:
        raise _corrupt(path, f"tensor {name!r} has dtype {dtype!r}, not one of {list(DTYPE_SIZES)}")
    if not isinstance(shape, list) or not all(_is_count(n) for n in shape):
        raise _corrupt(path, f"tensor {name!r} has shape {shape!r}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_is_count, offsets)):
        raise _corrupt(path, f"tensor {name!r} has data_offsets {offsets!r}")
    begin, end = offsets
    # Python integers: a hostile shape cannot overflow this product.
    if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise _corrupt(path, f"tensor {name!r}: {end - begin} bytes for shape {shape} {dtype}")
    if end > data_length:
        raise _corrupt(path, f"tensor {name!r} ends at {end}, past the {data_length} data bytes")
    return TensorEntry(dtype, tuple(shape), begin, end)


def _digest_field(digest: str) -> bytes:
    return json.dumps({DIGEST_KEY: digest}, separators=(",", ":"))[1:-1].encode()


def header_digest(stored: bytes, digest: str) -> str:
    """PERSIST-4: SHA-256 of the 8 length bytes and the header, where the header's one
    `"kvspec.header_sha256":"<digest>"` field has its 64 digits written as zeros."""
    field = _digest_field(digest)
    if stored.count(field) != 1:
        raise ValueError(f"the header holds the field {field.decode()} {stored.count(field)} times")
    return hashlib.sha256(stored.replace(field, _digest_field(DIGEST_PLACEHOLDER))).hexdigest()


def seal(f: BinaryIO) -> None:
    """PERSIST-4: write the header digest of a file open for update over its placeholder."""
    prefix = f.read(8)
    stored = prefix + f.read(int.from_bytes(prefix, "little"))
    digest = header_digest(stored, DIGEST_PLACEHOLDER)
    f.seek(stored.index(_digest_field(DIGEST_PLACEHOLDER)))
    f.write(_digest_field(digest))


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """PERSIST-6: `write` a temporary file beside `path`, seal it, flush it to the disk,
    then rename it over `path`; on any failure the temporary file is removed and `path`
    is left as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(
        prefix=f".{os.path.basename(path)}.", suffix=".tmp.safetensors", dir=directory
    )
    os.close(handle)
    try:
        write(temporary)
        with open(temporary, "r+b") as f:
            seal(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    # The rename itself reaches the disk with the folder's entry.
    folder = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def kind_of(cache: object, family: ModuleType) -> str:
    """PERSIST-5: the kind name of `cache`, a cache class of the backend `family` exactly;
    ValueError for anything else (another backend's, a subclass, an adapter)."""
    name = type(cache).__name__
    if name not in KIND_PARAMETERS or getattr(family, name) is not type(cache):
        raise ValueError(
            f"{type(cache).__module__}.{name} is not a cache kind of {family.__name__} "
            f"({', '.join(KIND_PARAMETERS)})"
        )
    return name


def parameters(cache: object, family: ModuleType) -> dict[str, int | str]:
    """PERSIST-5: the constructor parameters that rebuild `cache`, by name."""
    return {name: getattr(cache, name) for name in KIND_PARAMETERS[kind_of(cache, family)]}


def write_caches(
    files: ArrayFiles,
    path: str | os.PathLike[str],
    caches: Sequence[Cache],
    metadata: dict[str, str] | None,
) -> None:
    """PERSIST-1 .. PERSIST-6 over a backend's `files`: check everything, take every
    cache's state (which raises a deferred failure first, DEFER-3), then write atomically."""
    path, caches = os.fspath(path), list(caches)
    user = {} if metadata is None else metadata
    if not isinstance(user, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in user.items()
    ):
        raise ValueError(f"metadata must map str to str, got {metadata!r}")
    records = [(kind_of(cache, files.family), parameters(cache, files.family)) for cache in caches]
    states = [cache.state() for cache in caches]
    tensors: dict[str, Any] = {}
    entries = []
    for layer, (cache, (kind, params), state) in enumerate(
        zip(caches, records, states, strict=True)
    ):
        arrays = []
        for slot, array in enumerate(state.arrays):
            tensors[f"{layer}.{slot}"] = array
            arrays.append(
                {
                    "dtype": files.dtype_code(array),
                    "shape": list(array.shape),
                    "sha256": hashlib.sha256(files.stored_bytes(array)).hexdigest(),
                }
            )
        entry = {
            "kind": kind,
            "parameters": params,
            "signature": cache.signature(),
            "state_signature": state.signature,
            "offset": state.offset,
            "ring_index": state.ring_index,
            "minimum_reusable_offset": state.minimum_reusable_offset,
            "arrays": arrays,
        }
        if state.left_padding:
            entry["left_padding"] = list(state.left_padding)
        entries.append(entry)
    # Version 1 readers read every file without padded rows (PERSIST-3).
    version = FORMAT_VERSION if any("left_padding" in entry for entry in entries) else 1
    document = {"format": FORMAT, "version": version, "caches": entries, "metadata": user}
    header_metadata = {
        DOCUMENT_KEY: json.dumps(document, sort_keys=True, separators=(",", ":")),
        DIGEST_KEY: DIGEST_PLACEHOLDER,
    }
    write_atomically(path, lambda temporary: files.write(temporary, tensors, header_metadata))


def read_document(path: str, header: SafetensorsHeader) -> dict[str, Any]:
    """PERSIST-3, PERSIST-4: the kvspec document of a checked header, its format version
    and header digest checked."""
    text = header.metadata.get(DOCUMENT_KEY)
    if text is None:
        if "1.0" in header.metadata and DIGEST_KEY not in header.metadata:
            raise ValueError(
                f"{path} is an mlx-lm prompt-cache file, not a kvspec caches file: read it "
                "with load_mlx_lm_prompt_cache (PERSIST-9)"
            )
        raise ValueError(f"{path} is not a kvspec caches file: no {DOCUMENT_KEY!r} metadata")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: the kvspec document is not JSON ({error})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise ValueError(f"{path}: the kvspec document does not name the format {FORMAT!r}")
    if document.get("version") not in READ_VERSIONS:
        raise ValueError(
            f"{path}: format version {document.get('version')!r}; this reader reads versions "
            f"{READ_VERSIONS}"
        )
    digest = header.metadata.get(DIGEST_KEY, "")
    if (
        len(digest) != 64
        or any(c not in "0123456789abcdef" for c in digest)
        or header_digest(header.stored, digest) != digest
    ):
        raise ValueError(f"{path}: the header checksum does not match: the header is corrupt")
    return document


def _field(path: str, where: str, record: dict, name: str, check: Callable[[Any], bool]) -> Any:
    value = record.get(name)
    if not check(value):
        raise ValueError(f"{path}: {where}: {name} is {value!r}")
    return value


def _checked_records(path: str, document: dict, header: SafetensorsHeader) -> list[dict]:
    """PERSIST-5, PERSIST-7: every cache record well formed, its arrays those the header
    lists (names, dtypes, shapes), each array [B, H, T, *] with B, H, T shared."""
    records = document.get("caches")
    user = document.get("metadata")
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise ValueError(f"{path}: the kvspec document's caches are not a list of records")
    if not isinstance(user, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in user.items()
    ):
        raise ValueError(f"{path}: the user metadata is not a map of strings to strings")
    names = set()
    for layer, record in enumerate(records):
        where = f"cache {layer}"
        kind = _field(path, where, record, "kind", lambda k: k in KIND_PARAMETERS)
        params = _field(path, where, record, "parameters", lambda p: isinstance(p, dict))
        if set(params) != set(KIND_PARAMETERS[kind]):
            raise ValueError(
                f"{path}: {where}: {kind} takes parameters {KIND_PARAMETERS[kind]}, got "
                f"{sorted(params)}"
            )
        for name, value in params.items():
            wanted = str if name in TEXT_PARAMETERS else int
            if not isinstance(value, wanted) or isinstance(value, bool):
                raise ValueError(f"{path}: {where}: parameter {name} is {value!r}")
        for name in ("signature", "state_signature"):
            _field(path, where, record, name, lambda s: isinstance(s, str))
        for name in ("offset", "minimum_reusable_offset"):
            _field(path, where, record, name, _is_count)
        _field(path, where, record, "ring_index", lambda i: i is None or _is_count(i))
        if "left_padding" in record:
            if document["version"] < 2:
                raise ValueError(f"{path}: {where}: left_padding needs format version 2")
            _field(
                path,
                where,
                record,
                "left_padding",
                lambda p: isinstance(p, list) and bool(p) and all(_is_count(c) for c in p),
            )
        arrays = _field(path, where, record, "arrays", lambda a: isinstance(a, list))
        leading = set()
        for slot, array in enumerate(arrays):
            name = f"{layer}.{slot}"
            entry = header.tensors.get(name)
            if entry is None or not isinstance(array, dict):
                raise ValueError(f"{path}: {where}: tensor {name} is missing")
            if array.get("dtype") != entry.dtype or array.get("shape") != list(entry.shape):
                raise ValueError(
                    f"{path}: {where}: tensor {name} is {entry.dtype} {list(entry.shape)}, the "
                    f"document says {array.get('dtype')} {array.get('shape')}"
                )
            if len(entry.shape) != 4:
                raise ValueError(f"{path}: {where}: tensor {name} is not [B, H, T, *]")
            leading.add(entry.shape[:3])
            names.add(name)
        if len(leading) > 1:
            raise ValueError(f"{path}: {where}: arrays disagree on [B, H, T]: {sorted(leading)}")
    extra = set(header.tensors) - names
    if extra:
        raise ValueError(f"{path}: tensors {sorted(extra)} belong to no cache")
    return records


def _probe_arrays(cache: Cache, files: ArrayFiles) -> tuple[Any, ...]:
    """The arrays a fresh storage of `cache`'s kind holds after one position of its layout:
    the dtypes and the shapes but axis 2 that its state's arrays must have (PERSIST-7)."""
    storage = cache.storage if isinstance(cache, Bf16FirstCache) else cache
    layout = storage.layout
    assert layout is not None
    probe = getattr(files.family, type(storage).__name__)(**parameters(storage, files.family))
    dtype = files.float_dtypes[layout.dtype]
    k = probe.xp.zeros((layout.batch, layout.kv_heads, 1, layout.k_dim), dtype)
    v = probe.xp.zeros((layout.batch, layout.kv_heads, 1, layout.v_dim), dtype)
    probe.update_and_fetch(k, v)
    return probe.state().arrays


def _rebuilt(path: str, layer: int, record: dict, arrays: tuple, files: ArrayFiles) -> Cache:
    """PERSIST-7: a new cache of the record's kind and parameters holding its state; its
    arrays' dtypes and shapes are what its signature stores, its invariants hold."""
    where = f"{path}: cache {layer} ({record['signature']})"
    try:
        cache = getattr(files.family, record["kind"])(**record["parameters"])
        cache.restore_state(
            CacheState(
                record["state_signature"],
                arrays,
                record["offset"],
                record["ring_index"],
                record["minimum_reusable_offset"],
                tuple(record.get("left_padding", ())),
            )
        )
    except (ValueError, IndexError, TypeError) as error:
        raise ValueError(f"{where}: {error}") from None
    if cache.signature() != record["signature"]:
        raise ValueError(f"{where}: the state makes a {cache.signature()!r} cache")
    if arrays:
        expected = _probe_arrays(cache, files)
        got = [(files.dtype_code(a), a.shape[:2] + a.shape[3:]) for a in arrays]
        wanted = [(files.dtype_code(a), a.shape[:2] + a.shape[3:]) for a in expected]
        if got != wanted:
            raise ValueError(
                f"{where}: arrays {got} contradict the signature, which stores {wanted}"
            )
    try:
        cache.check_invariants()
    except AssertionError as error:
        raise ValueError(f"{where}: {error}") from None
    return cache


def check_expected(path: str, caches: list[Cache], expect: Expected, family: ModuleType) -> None:
    """PERSIST-8: ValueError naming the first way the caches differ from `expect`."""
    if expect.layers is not None and len(caches) != expect.layers:
        raise ValueError(f"{path} holds {len(caches)} caches, expected {expect.layers}")
    for layer, cache in enumerate(caches):
        layout = cache.layout
        dims = None if layout is None else (layout.k_dim, layout.v_dim)
        if expect.head_dim is not None and dims not in (None, (expect.head_dim,) * 2):
            raise ValueError(
                f"{path}: cache {layer} holds head dims {dims}, expected {expect.head_dim}"
            )
        if expect.scheme is not None:
            scheme = family.parse_scheme(expect.scheme)
            window = cache.sliding_window
            composed = (
                family.composed_full_attention_cache(scheme, layer)
                if window is None
                else family.composed_sliding_attention_cache(scheme, layer, window)
            )
            held = (type(cache).__name__, parameters(cache, family))
            wanted = (type(composed).__name__, parameters(composed, family))
            # The checks mode is the caller's choice, not the scheme's (DEFER-3).
            held[1].pop("checks")
            wanted[1].pop("checks")
            if held != wanted:
                raise ValueError(
                    f"{path}: cache {layer} is {held[0]}{held[1]}; scheme {expect.scheme!r} "
                    f"composes {wanted[0]}{wanted[1]}"
                )


def read_caches(
    files: ArrayFiles, path: str | os.PathLike[str], expect: Expected | None
) -> LoadedCaches:
    """PERSIST-2 .. PERSIST-8 over a backend's `files`: header, document, digest and records
    checked before any tensor is read; then every array's checksum; then the caches
    rebuilt and held against `expect`. Nothing is returned unless all of it passes."""
    if expect is not None and not isinstance(expect, Expected):
        raise TypeError(f"expect is an Expected or None, got {expect!r}")
    path = os.fspath(path)
    header = read_header(path)
    document = read_document(path, header)
    records = _checked_records(path, document, header)
    tensors = files.read(path, header)
    caches = []
    for layer, record in enumerate(records):
        arrays = tuple(tensors[f"{layer}.{slot}"] for slot in range(len(record["arrays"])))
        for slot, (array, entry) in enumerate(zip(arrays, record["arrays"], strict=True)):
            if hashlib.sha256(files.stored_bytes(array)).hexdigest() != entry.get("sha256"):
                raise ValueError(f"{path}: cache {layer}, array {slot}: checksum does not match")
        caches.append(_rebuilt(path, layer, record, arrays, files))
    if expect is not None:
        check_expected(path, caches, expect, files.family)
    return LoadedCaches(caches, dict(document["metadata"]))


#: What each mlx-lm class's flattened state holds after keys and values (PERSIST-9).
MLX_LM_SCALARS = {
    "KVCache": ("offset",),
    "RotatingKVCache": ("offset", "keep", "max_size", "ring_index"),
    "QuantizedKVCache": ("offset", "group_size", "bits"),
}


def _mlx_lm_scalar(path: str, name: str, tensors: dict[str, Any], files: ArrayFiles) -> int:
    array = tensors.get(name)
    if array is None or files.dtype_code(array) not in ("I32", "I64") or array.size != 1:
        raise ValueError(f"{path}: mlx-lm tensor {name} is not an integer scalar")
    return int.from_bytes(memoryview(files.stored_bytes(array)).tobytes(), "little", signed=True)


def read_mlx_lm_prompt_cache(files: ArrayFiles, path: str | os.PathLike[str]) -> LoadedCaches:
    """PERSIST-9 over a backend's `files`: the caches of an mlx-lm prompt-cache file as
    kvspec caches, the header checked first (PERSIST-2)."""
    path = os.fspath(path)
    header = read_header(path)
    metadata = header.metadata
    if DOCUMENT_KEY in metadata:
        raise ValueError(f"{path} is a kvspec caches file: read it with load_caches")
    classes = []
    while f"1.{len(classes)}" in metadata:
        classes.append(metadata[f"1.{len(classes)}"])
    if metadata.get("2.0") != "":
        raise ValueError(f"{path} is not an mlx-lm 0.32 prompt-cache file")
    empty = {
        metadata[key[: -len(".1")] + ".0"]
        for key, kind in metadata.items()
        if key.startswith("2.") and key.endswith(".1") and kind == "none"
    }
    user = {key[2:]: value for key, value in metadata.items() if key.startswith("0.")}
    tensors = files.read(path, header)
    caches = []
    for layer, name in enumerate(classes):
        if name.startswith("Kvspec"):
            raise ValueError(
                f"{path}: layer {layer} was saved by kvspec's mlx-lm adapter ({name}): read "
                "the file with kvspec.accelerated.mlx_lm.load_prompt_cache"
            )
        if name not in MLX_LM_SCALARS:
            raise ValueError(
                f"{path}: layer {layer} is mlx-lm's {name}; kvspec reads "
                f"{', '.join(MLX_LM_SCALARS)}"
            )
        scalars = {
            field: _mlx_lm_scalar(path, f"{layer}.{2 + i}", tensors, files)
            for i, field in enumerate(MLX_LM_SCALARS[name])
        }
        try:
            caches.append(
                _from_mlx_lm(
                    name, layer, scalars, tensors, layer_empty=f"{layer}.0" in empty, files=files
                )
            )
        except (ValueError, IndexError, TypeError, KeyError) as error:
            raise ValueError(f"{path}: layer {layer} (mlx-lm {name}): {error}") from None
    return LoadedCaches(caches, user)


def _from_mlx_lm(
    name: str,
    layer: int,
    scalars: dict[str, int],
    tensors: dict[str, Any],
    layer_empty: bool,
    files: ArrayFiles,
) -> Cache:
    """One mlx-lm cache's state as the kvspec cache PERSIST-9 names."""
    offset = scalars["offset"]
    if name == "RotatingKVCache":
        cache = files.family.RotatingKVCache(scalars["max_size"], scalars["keep"])
        arrays = () if layer_empty else (tensors[f"{layer}.0"], tensors[f"{layer}.1"])
        ring_index = scalars["ring_index"]
    elif name == "KVCache":
        cache = files.family.KVCache()
        slots = (f"{layer}.0", f"{layer}.1")
        arrays = () if layer_empty else tuple(tensors[s][:, :, :offset] for s in slots)
        ring_index = None
    else:
        cache = files.family.QuantizedKVCache(scalars["group_size"], scalars["bits"])
        slots = [f"{layer}.{side}.{field}" for side in (0, 1) for field in (0, 1, 2)]
        arrays = () if layer_empty else tuple(tensors[s][:, :, :offset] for s in slots)
        ring_index = None
    cache.restore_state(CacheState(cache.signature(), arrays, offset, ring_index))
    try:
        cache.check_invariants()
    except AssertionError as error:
        raise ValueError(str(error)) from None
    return cache


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """PERSIST-2: the 8-byte little-endian header length, the JSON header (tensors in name
    order, their bytes back to back), then the data."""
    header: dict[str, Any] = {"__metadata__": metadata}
    position = 0
    for name in sorted(tensors):
        array = tensors[name]
        size = array.size * array.dtype.itemsize
        header[name] = {
            "dtype": _numpy_dtype_code(array),
            "shape": list(array.shape),
            "data_offsets": [position, position + size],
        }
        position += size
    text = json.dumps(header, separators=(",", ":")).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name in sorted(tensors):
            f.write(_numpy_bytes(tensors[name]))


def read_safetensors(path: str, header: SafetensorsHeader) -> dict[str, np.ndarray]:
    """The tensors of a file whose header `read_header` checked (PERSIST-2), as NumPy
    arrays."""
    tensors = {}
    with open(path, "rb") as f:
        for name, entry in header.tensors.items():
            f.seek(header.data_start + entry.begin)
            data = f.read(entry.end - entry.begin)
            dtype = NUMPY_DTYPES[entry.dtype]
            tensors[name] = np.frombuffer(data, dtype).reshape(entry.shape).copy()
    return tensors


def _numpy_dtype_code(array: np.ndarray) -> str:
    for code, dtype in NUMPY_DTYPES.items():
        if array.dtype == dtype:
            return code
    raise ValueError(f"dtype {array.dtype} has no safetensors code")


def _numpy_bytes(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, NUMPY_DTYPES[_numpy_dtype_code(array)])


def _numpy_files() -> ArrayFiles:
    from kvspec.reference import caches

    return ArrayFiles(
        caches,
        dtypes.FLOAT_DTYPES,
        write_safetensors,
        read_safetensors,
        _numpy_bytes,
        _numpy_dtype_code,
    )


def save_caches(
    path: str | os.PathLike[str], caches: Sequence[Cache], metadata: dict[str, str] | None = None
) -> None:
    """PERSIST-1: write `caches` (reference caches, one per layer, any kinds) and the user
    `metadata` to `path` atomically (PERSIST-6)."""
    write_caches(_numpy_files(), path, caches, metadata)


def load_caches(path: str | os.PathLike[str], expect: Expected | None = None) -> LoadedCaches:
    """PERSIST-1: the reference caches and user metadata saved at `path` by either backend,
    checked (PERSIST-7) and held against `expect` (PERSIST-8)."""
    return read_caches(_numpy_files(), path, expect)


def load_mlx_lm_prompt_cache(path: str | os.PathLike[str]) -> LoadedCaches:
    """PERSIST-9: the reference caches and user metadata of an mlx-lm prompt-cache file."""
    return read_mlx_lm_prompt_cache(_numpy_files(), path)
