"""CUDA source as the custom kernels hand it to MLX: without comments or indentation.

MLX builds a custom kernel's whole source string at every call and hashes it again at
every evaluation (MLX 0.32, `mx.fast.cuda_kernel`), so the length of the source is host
time spent on every decode step. The commented source stays in the modules, for reading.
"""

from __future__ import annotations


def compact(source: str) -> str:
    """`source` without `//` comments, leading and trailing blanks and empty lines. Lines
    stay lines, so preprocessor directives and `#pragma unroll` keep theirs. The kernels'
    sources hold no `//` inside a string literal, which this would cut."""
    lines = (line.split("//", 1)[0].strip() for line in source.splitlines())
    return "".join(line + "\n" for line in lines if line)
