"""CUDA source as the custom kernels hand it to MLX: short.

MLX builds a custom kernel's whole source string at every call and hashes it again at
every evaluation (MLX 0.32, `mx.fast.cuda_kernel`), so the length of the source is host
time spent on every decode step. Two ways to keep it short:
- `included`: the code lives in a file of `accelerated/cuda/`, which the kernel's header
  includes; the source is a call into it;
- `compact`: the source without comments or indentation (the commented source stays in
  the modules, for reading).
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

#: The CUDA files the kernels include.
CUDA_DIR = Path(__file__).resolve().parent / "cuda"


def compact(source: str) -> str:
    """`source` without `//` comments, leading and trailing blanks and empty lines. Lines
    stay lines, so preprocessor directives and `#pragma unroll` keep theirs. The kernels'
    sources hold no `//` inside a string literal, which this would cut."""
    lines = (line.split("//", 1)[0].strip() for line in source.splitlines())
    return "".join(line + "\n" for line in lines if line)


@cache
def included(name: str) -> str:
    """A kernel header that includes `name` of CUDA_DIR by its absolute path (NVRTC reads
    it from the file system when MLX compiles the kernel). The file's SHA-256 rides along
    in a comment: MLX keys its compiled kernels, in memory and in its PTX cache on disk, by
    a hash of the source it builds, and the file's text is not in that source."""
    path = CUDA_DIR / name
    if '"' in str(path) or "\n" in str(path):
        raise ValueError(f"{path} cannot be named in an #include")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return f'#include "{path}"\n// {name} sha256 {digest}\n'
