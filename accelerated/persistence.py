"""Saved caches on MLX (spec PERSIST-1 .. PERSIST-9): the reference's steps and checks,
with the arrays written by `mx.save_safetensors` and read by `mx.load` once the header
has been checked."""

from __future__ import annotations

import os
from collections.abc import Sequence

import mlx.core as mx

from kvspec.accelerated import caches as family
from kvspec.accelerated import dtypes
from kvspec.reference.caches.protocol import Cache
from kvspec.reference.persistence import (
    ArrayFiles,
    Expected,
    LoadedCaches,
    SafetensorsHeader,
    TensorEntry,
    check_expected,
    header_digest,
    kind_of,
    parameters,
    read_caches,
    read_document,
    read_header,
    read_mlx_lm_prompt_cache,
    seal,
    write_atomically,
    write_caches,
)

__all__ = [
    "ArrayFiles",
    "Expected",
    "LoadedCaches",
    "SafetensorsHeader",
    "TensorEntry",
    "check_expected",
    "header_digest",
    "kind_of",
    "load_caches",
    "load_mlx_lm_prompt_cache",
    "parameters",
    "read_caches",
    "read_document",
    "read_header",
    "read_mlx_lm_prompt_cache",
    "read_safetensors",
    "save_caches",
    "seal",
    "write_atomically",
    "write_caches",
    "write_safetensors",
]

#: safetensors dtype codes of MLX's formats (PERSIST-2).
MLX_DTYPE_CODES = {
    mx.float32: "F32",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.uint32: "U32",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.uint8: "U8",
    mx.int8: "I8",
}


def _dtype_code(array: mx.array) -> str:
    code = MLX_DTYPE_CODES.get(array.dtype)
    if code is None:
        raise ValueError(f"dtype {array.dtype} has no safetensors code")
    return code


def _stored_bytes(array: mx.array) -> memoryview:
    # The buffer of an evaluated row-major array: the bytes safetensors stores.
    return memoryview(mx.contiguous(array))


def write_safetensors(path: str, tensors: dict[str, mx.array], metadata: dict[str, str]) -> None:
    """PERSIST-2 through MLX (the path ends in .safetensors, as MLX requires)."""
    mx.save_safetensors(path, tensors, metadata)


def read_safetensors(path: str, header: SafetensorsHeader) -> dict[str, mx.array]:
    """The tensors of a file whose header `read_header` checked (PERSIST-2), through
    `mx.load`."""
    tensors = mx.load(path, format="safetensors")
    assert isinstance(tensors, dict)
    return tensors


def _mlx_files() -> ArrayFiles:
    return ArrayFiles(
        family,
        dtypes.FLOAT_DTYPES,
        write_safetensors,
        read_safetensors,
        _stored_bytes,
        _dtype_code,
    )


def save_caches(
    path: str | os.PathLike[str], caches: Sequence[Cache], metadata: dict[str, str] | None = None
) -> None:
    """PERSIST-1: write `caches` (MLX caches, one per layer, any kinds) and the user
    `metadata` to `path` atomically (PERSIST-6)."""
    write_caches(_mlx_files(), path, caches, metadata)


def load_caches(path: str | os.PathLike[str], expect: Expected | None = None) -> LoadedCaches:
    """PERSIST-1: the MLX caches and user metadata saved at `path` by either backend,
    checked (PERSIST-7) and held against `expect` (PERSIST-8)."""
    return read_caches(_mlx_files(), path, expect)


def load_mlx_lm_prompt_cache(path: str | os.PathLike[str]) -> LoadedCaches:
    """PERSIST-9: the MLX caches and user metadata of an mlx-lm prompt-cache file."""
    return read_mlx_lm_prompt_cache(_mlx_files(), path)
