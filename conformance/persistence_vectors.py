"""Golden saved-cache files (PERSIST-1 .. PERSIST-5): one small file per cache kind in
docs/vectors/persistence, written by the reference from fixed input, so a port can check
its reader (and its writer, byte for byte) against them."""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from kvspec.conformance.cache_machine import random_kv
from kvspec.conformance.vectors import VECTORS_DIR
from kvspec.reference import persistence
from kvspec.reference.dtypes import BFLOAT16

PERSISTENCE_DIR = VECTORS_DIR / "persistence"

#: Per file: the cache, built from a backend's caches package, and its head_dim. Appends
#: of 3, 1 and 1 positions wrap the rings and carry the bf16-first caches past their
#: start, but for the one saved before its switch.
GOLDEN_CACHES: dict[str, tuple[Callable[[ModuleType], Any], int]] = {
    "kv": (lambda m: m.KVCache(), 64),
    "affine": (lambda m: m.QuantizedKVCache(32, 4), 64),
    "rotating": (lambda m: m.RotatingKVCache(4, 1), 64),
    "rotating-affine": (lambda m: m.RotatingQuantizedKVCache(3, 64, 3), 64),
    "turboquant": (lambda m: m.TurboQuantKVCache(8, 4, "deferred"), 64),
    "bf16-first-affine": (lambda m: m.Bf16FirstQuantizedKVCache(64, 8, 2), 64),
    "bf16-first-affine-before-switch": (lambda m: m.Bf16FirstQuantizedKVCache(64, 8, 16), 64),
    "bf16-first-rotating-affine": (
        lambda m: m.Bf16FirstRotatingQuantizedKVCache(4, 32, 2, 0, "deferred"),
        64,
    ),
    "bf16-first-kv4-head256": (lambda m: m.Bf16FirstKv4Head256Cache(4), 256),
    "bf16-first-turboquant": (lambda m: m.Bf16FirstTurboQuantKVCache(4, 2, 3), 64),
}
APPENDS = (3, 1, 1)
METADATA = {"kvspec.vectors": "persistence"}
#: Batches of rows of their own lengths (ROWS-10, format version 2): per file, the kind of
#: GOLDEN_CACHES and each row's length, appended at once; the rows merged in order.
PADDED_CACHES: dict[str, tuple[str, tuple[int, ...]]] = {
    "padded-affine": ("affine", (2, 5, 3)),
    "padded-rotating-affine": ("rotating-affine", (5, 2)),
}
#: Every golden file's name.
GOLDEN_FILES = (*GOLDEN_CACHES, *PADDED_CACHES)


def golden_cache(family: ModuleType, name: str, from_numpy: Callable[[Any], Any]) -> Any:
    """The cache of golden file `name` built on `family` after APPENDS of fixed bf16 input,
    or the merged rows of a padded batch."""
    if name in PADDED_CACHES:
        kind, lengths = PADDED_CACHES[name]
        rows = importlib.import_module(family.__name__.rsplit(".", 1)[0] + ".rows")
        return rows.merge([_appended(family, kind, (n,), from_numpy) for n in lengths])
    return _appended(family, name, APPENDS, from_numpy)


def _appended(
    family: ModuleType, kind: str, lengths: tuple[int, ...], from_numpy: Callable[[Any], Any]
) -> Any:
    """A single-row cache of GOLDEN_CACHES' `kind` after appends of `lengths` positions."""
    factory, head_dim = GOLDEN_CACHES[kind]
    cache = factory(family)
    for step, length in enumerate(lengths):
        k, v = random_kv(step, (1, 2, length, head_dim), head_dim, BFLOAT16)
        cache.update_and_fetch(from_numpy(k), from_numpy(v))
    return cache


def golden_path(name: str) -> Path:
    return PERSISTENCE_DIR / f"{name}.safetensors"


def golden_bytes(name: str) -> bytes:
    """The bytes the reference writes for golden file `name`."""
    from kvspec.reference import caches

    cache = golden_cache(caches, name, lambda a: a)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, f"{name}.safetensors")
        persistence.save_caches(path, [cache], METADATA)
        with open(path, "rb") as f:
            return f.read()
