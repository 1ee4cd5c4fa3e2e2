"""Where the accelerated backend's custom kernels run: MLX's CUDA backend, unless
KVSPEC_FUSED_KERNELS=0 selects the portable MLX-ops paths there too (for comparisons and
triage; read once, at the first step of a process). Both paths store the same bits (spec
TQ-14, READ-7)."""

from __future__ import annotations

import os
from functools import cache

import mlx.core as mx

#: Set to "0" to run the portable MLX-ops paths on CUDA too.
FUSED_KERNELS_ENV = "KVSPEC_FUSED_KERNELS"


def fused_kernels_enabled() -> bool:
    """Whether the CUDA kernels run: a CUDA default device, and KVSPEC_FUSED_KERNELS is not
    "0"."""
    return mx.default_device() == mx.gpu and cuda_available() and fused_kernels_allowed()


@cache
def fused_kernels_allowed() -> bool:
    """Whether KVSPEC_FUSED_KERNELS lets the CUDA kernels run: asked once, since a lookup in
    `os.environ` costs about a microsecond of host time and a decode step asks on every
    layer."""
    return os.environ.get(FUSED_KERNELS_ENV, "1") != "0"


@cache
def cuda_available() -> bool:
    """Whether MLX has its CUDA backend here (fixed for the process; asked once)."""
    return mx.cuda.is_available()
