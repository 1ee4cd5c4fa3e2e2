"""The affine encoder as one CUDA kernel (spec AFF-2 .. AFF-5), for MLX's CUDA backend.

A group of GROUP elements takes GROUP / 8 threads, each holding 8 consecutive elements:
min and max by shuffles among them, then scale and bias, then the codes, packed into the
group's own words (a group of 32, 64 or 128 codes fills whole words at every width): at
2, 4 and 8 bits in registers, at other widths through shared memory. Every float step is
an explicitly rounded IEEE intrinsic (`__fsub_rn`, `__fdiv_rn`, `rintf`), so neither
compiler flags nor contraction can change a bit.
The kernel also ranks input the format cannot hold (AFF-1, AFF-7) as DEFER-2 does: 2 for
NaN or inf, 1 for a range or edge / scale that overflows float32; such a group is stored as
DEFER-1 says (codes 0, bias 0, a quiet NaN scale). Each block folds its groups' largest
rank into a prior one (DEFER-3), so a cache's running rank costs no launch of its own.
Keys and values of one shape take one launch, which can write their six fields as one
record per position (accelerated/records.py), as the MLX affine cache stores them.
The code is accelerated/cuda/affine.cuh (quantize_groups); the kernels handed to MLX
include it and call into it (cuda_source.included).
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from typing import Any, NamedTuple

import mlx.core as mx

from kvspec.accelerated.cuda_source import KERNELS_MADE, Constant, cuda_kernel, included
from kvspec.accelerated.dtypes import dtype_name
from kvspec.accelerated.records import RecordLayout
from kvspec.reference.dtypes import QUIET_NAN_BITS

#: Elements per thread, as in affine.cuh. Groups that 1024 threads hold (a decode step's)
#: take one block, so their failure needs no fold; more take blocks of 256 threads, whose
#: 35 to 39 registers a thread let six blocks share an SM where two of 1024 would not fit.
_ONE_BLOCK_THREADS = 1024
_BLOCK_THREADS = 256
_PER_THREAD = 8

#: The kernel's code (cuda_source.included): the source MLX builds at every call is a call.
_INCLUDE = included("affine.cuh")
_FIELDS = "0, 0, 0, 0, 0, 0, 0"  # ROW_BYTES 0: the fields apart, no record
_ONE_TENSOR_CALL = (
    f"kvspec_affine::quantize_groups<false, T, GROUP, BITS, NAN_BITS, {_FIELDS}>(w, w_shape, "
    "w_ndim, nullptr, prior, wq, scales, biases, nullptr, nullptr, nullptr, nullptr, total);"
)
_PAIR_CALL = (
    f"kvspec_affine::quantize_groups<true, T, GROUP, BITS, NAN_BITS, {_FIELDS}>(w, w_shape, "
    "w_ndim, v, prior, wq, scales, biases, v_wq, v_scales, v_biases, nullptr, total);"
)
_RECORD_CALL = (
    "kvspec_affine::quantize_groups<true, T, GROUP, BITS, NAN_BITS, ROW_BYTES, OFF_KW, OFF_KS, "
    "OFF_KB, OFF_VW, OFF_VS, OFF_VB>(w, w_shape, w_ndim, v, prior, nullptr, nullptr, nullptr, "
    "nullptr, nullptr, nullptr, record, total);"
)


def _constants(dtype: mx.Dtype, group_size: int, bits: int) -> tuple[Constant, ...]:
    return (
        ("T", dtype),
        ("GROUP", group_size),
        ("BITS", bits),
        ("NAN_BITS", QUIET_NAN_BITS[dtype_name(dtype)]),
    )


@cache
def _kernel(dtype: mx.Dtype, group_size: int, bits: int) -> object:
    return cuda_kernel(
        "kvspec_affine_quantize",
        _ONE_TENSOR_CALL,
        _constants(dtype, group_size, bits),
        input_names=["w", "prior"],
        output_names=["wq", "scales", "biases", "total"],
        header=_INCLUDE,
    )


@cache
def _pair_kernel(dtype: mx.Dtype, group_size: int, bits: int) -> object:
    return cuda_kernel(
        "kvspec_affine_quantize_pair",
        _PAIR_CALL,
        _constants(dtype, group_size, bits),
        input_names=["w", "v", "prior"],
        output_names=["wq", "scales", "biases", "v_wq", "v_scales", "v_biases", "total"],
        header=_INCLUDE,
    )


@cache
def _record_kernel(dtype: mx.Dtype, group_size: int, bits: int, layout: RecordLayout) -> object:
    names = ("OFF_KW", "OFF_KS", "OFF_KB", "OFF_VW", "OFF_VS", "OFF_VB")
    offsets = zip(names, layout.offsets, strict=True)
    return cuda_kernel(
        "kvspec_affine_quantize_record",
        _RECORD_CALL,
        (*_constants(dtype, group_size, bits), ("ROW_BYTES", layout.row_bytes), *offsets),
        input_names=["w", "v", "prior"],
        output_names=["record", "total"],
        header=_INCLUDE,
    )


@cache
def no_failure() -> mx.array:
    """The rank of no failure (DEFER-2), uint32 [1]: the prior of a first encode."""
    return mx.zeros((1,), mx.uint32)


def quantize_groups(
    w: mx.array, group_size: int, bits: int, prior: mx.array | None = None
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(wq, scales, biases, failure) of `w` [..., D]: failure (uint32 [1]) is the largest
    DEFER-2 rank of any group and of `prior` (uint32 [1]). One launch when the groups fit one
    block (a decode step's do); else the blocks' ranks are folded by one more op."""
    launch = _encode_launch(_ONE, tuple(w.shape), w.dtype, group_size, bits, None)
    wq, scales, biases, failure = launch(w, prior=prior)
    return wq, scales, biases, failure


def quantize_pair_groups(
    k: mx.array, v: mx.array, group_size: int, bits: int, prior: mx.array | None = None
) -> tuple[mx.array, ...]:
    """`quantize_groups` of keys and values of one shape and dtype in one launch: their six
    fields (k's wq, scales, biases, then v's) and the failure of both and of `prior`. A
    decode step's encode is then one op."""
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"keys and values of one launch share shape and dtype, got {tuple(k.shape)} "
            f"{k.dtype} and {tuple(v.shape)} {v.dtype}"
        )
    launch = _encode_launch(_PAIR, tuple(k.shape), k.dtype, group_size, bits, None)
    return launch(k, v, prior=prior)


def record_launch(
    shape: tuple[int, ...], dtype: mx.Dtype, group_size: int, bits: int, layout: RecordLayout
) -> EncodeLaunch:
    """`quantize_pair_groups`' six fields of keys and values of `shape` and `dtype` as one
    record uint8 [B, H, L, row_bytes] of `layout` (accelerated/records.py), and the
    failure, in one launch: called with (k, v, prior=), unchecked (the caller checks)."""
    return _encode_launch(_RECORD, shape, dtype, group_size, bits, layout)


class EncodeLaunch(NamedTuple):
    """An encode kernel with its launch options for one shape of input, made once per
    shape (a decode step encodes the same shape at every layer and step). Called with the
    tensors and the prior rank: the kernel's outputs, the last of them the failure of the
    tensors and the prior (DEFER-3), the blocks' ranks folded by one more op where the
    groups take more than one block."""

    kernel: Any
    options: dict[str, Any]
    folded: bool

    def __call__(self, *tensors: mx.array, prior: mx.array | None = None) -> tuple[mx.array, ...]:
        inputs = [*tensors, no_failure() if prior is None else prior]
        *outputs, totals = self.kernel(inputs=inputs, **self.options)
        return (*outputs, mx.max(totals, keepdims=True) if self.folded else totals)


#: What `_encode_launch` launches: one tensor's fields, a pair's, or a pair's record.
_ONE, _PAIR, _RECORD = "one", "pair", "record"


@lru_cache(maxsize=64)
def _encode_launch(
    kind: str,
    shape: tuple[int, ...],
    dtype: mx.Dtype,
    group_size: int,
    bits: int,
    layout: RecordLayout | None,
) -> EncodeLaunch:
    """The kernel of `kind` and its grid, block and outputs for tensors of `shape` and
    `dtype` (a record's with `layout`); a shape of no rows is refused (ValueError)."""
    *lead, D = shape
    if math.prod(shape) == 0:
        raise ValueError(f"an encode of shape {shape} has no rows: nothing to launch")
    count = 1 if kind == _ONE else 2
    n_groups = count * (math.prod(shape) // group_size)
    # Whole warps (the shuffles take every lane; threads past the last group write nothing).
    threads = -(-n_groups * (group_size // _PER_THREAD) // 32) * 32
    block_threads = threads if threads <= _ONE_BLOCK_THREADS else _BLOCK_THREADS
    blocks = -(-threads // block_threads)
    if layout is None:
        kernel = (_kernel if kind == _ONE else _pair_kernel)(dtype, group_size, bits)
        shapes = [(*lead, D * bits // 32), (*lead, D // group_size), (*lead, D // group_size)]
        shapes *= count
        dtypes = [mx.uint32, dtype, dtype] * count
    else:
        kernel = _record_kernel(dtype, group_size, bits, layout)
        shapes = [(*lead[:3], layout.row_bytes)]
        dtypes = [mx.uint8]
    options = {
        "grid": (threads, 1, 1),
        "threadgroup": (block_threads, 1, 1),
        "output_shapes": [*shapes, (blocks,)],
        "output_dtypes": [*dtypes, mx.uint32],
    }
    return EncodeLaunch(kernel, options, blocks > 1)


#: The kernel objects this module keeps made (as attention_kernels.KERNEL_CACHES).
KERNEL_CACHES = (_kernel, _pair_kernel, _record_kernel, _encode_launch, KERNELS_MADE)
