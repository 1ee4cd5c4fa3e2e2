"""CUDA source as the custom kernels hand it to MLX: a call into an included file.

MLX builds a custom kernel's whole source string at every call and hashes it again at
every evaluation (MLX 0.32, `mx.fast.cuda_kernel`), so the length of the source is host
time spent on every decode step. The kernels' code therefore lives in the files of
`accelerated/cuda/`, which each kernel's header includes (`included`), and the source
MLX builds is one call into it.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

#: The CUDA files the kernels include.
CUDA_DIR = Path(__file__).resolve().parent / "cuda"


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
