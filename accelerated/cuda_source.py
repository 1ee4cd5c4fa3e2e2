"""CUDA source as the custom kernels hand it to MLX: a call into an included file.

MLX builds a custom kernel's whole source string at every call and hashes it again at
every evaluation (MLX 0.32, `mx.fast.cuda_kernel`), so the length of the source is host
time spent on every decode step. The kernels' code therefore lives in the files of
`accelerated/cuda/`, which each kernel's header includes (`included`), and the source
MLX builds is one call into it. Its template constants are written into that source
(`cuda_kernel`): MLX would convert and format template arguments at every call.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

#: The CUDA files the kernels include.
CUDA_DIR = Path(__file__).resolve().parent / "cuda"


class KernelGeneration:
    """Counts the clearings of the kernel modules' caches (each module's KERNEL_CACHES holds
    it), so that what a storage keeps made outside them (its reads' launches:
    caches.reads.ReadLaunches; its planned append's encode: caches.planned.PlannedAppend)
    is made anew after one, as the modules' own are: a tool that builds the kernels from
    other sources or shapes, or a test that stands in for them, launches only those."""

    def __init__(self) -> None:
        self.count = 0

    def cache_clear(self) -> None:
        self.count += 1


#: The clearings of the kernel modules' caches so far.
KERNELS_MADE = KernelGeneration()


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


#: A kernel's template constant: its name and an int, bool or dtype value.
Constant = tuple[str, int | bool | mx.Dtype]

#: Per dtype, the CUDA type MLX declares for it and the name it gives it in a kernel's name
#: (mlx/backend/cuda/utils.cpp `dtype_to_cuda_type`, backend/common/compiled.cpp
#: `get_type_string`).
_CUDA_TYPES = {
    mx.bool_: ("bool", "bool"),
    mx.int8: ("int8_t", "int8_t"),
    mx.int32: ("int32_t", "int32_t"),
    mx.uint8: ("uint8_t", "uint8_t"),
    mx.uint16: ("uint16_t", "uint16_t"),
    mx.uint32: ("uint32_t", "uint32_t"),
    mx.float16: ("__half", "float16_t"),
    mx.bfloat16: ("__nv_bfloat16", "bfloat16_t"),
    mx.float32: ("float", "float"),
}


def device_array(name: str, values: np.ndarray) -> str:
    """A kernel header's line declaring `values` (float32) as the namespace-scope array
    `name` in device memory: constants a kernel holds in its source instead of taking them
    as an input, which MLX would hand it at every launch. Each value is written as the
    shortest decimal that reads back as its float64, which a float literal reads back as
    the float32 it is (the two roundings of one exact value)."""
    literals = ", ".join(f"{float(value)!r}f" for value in np.asarray(values, np.float32))
    return f"__device__ const float {name}[{len(values)}] = {{{literals}}};\n"


def cuda_type(dtype: mx.Dtype) -> str:
    """The CUDA type MLX declares for an array of `dtype` in a kernel's signature."""
    return _CUDA_TYPES[dtype][0]


def cuda_kernel(name: str, source: str, constants: Sequence[Constant], **options: Any) -> Any:
    """`mx.fast.cuda_kernel` with its template constants written into the source and the
    name as MLX writes template arguments (custom_kernel.cpp: `build_kernel` declares them
    at the top of the kernel's body, `template_arguments_hash` appends their values to its
    name), so that a call passes none: MLX converts and formats each template argument at
    every call (about 3 µs for 16 on the H200 machine's host). One kernel object per set of
    constants; a negative int is named `n` and its magnitude (a name has no '-')."""
    declarations = []
    suffix = []
    for constant, value in constants:
        if isinstance(value, bool):
            declarations.append(f"  constexpr bool {constant} = {'true' if value else 'false'};\n")
            suffix.append("_t" if value else "_f")
        elif isinstance(value, int):
            declarations.append(f"  constexpr int {constant} = {value};\n")
            suffix.append(f"_{value}" if value >= 0 else f"_n{-value}")
        else:
            declarations.append(f"  using {constant} = {cuda_type(value)};\n")
            suffix.append(f"_{_CUDA_TYPES[value][1]}")
    body = "".join(declarations) + "\n" + source if declarations else source
    return mx.fast.cuda_kernel(name=name + "".join(suffix), source=body, **options)
