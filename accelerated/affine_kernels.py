"""The affine encoder as one CUDA kernel (spec AFF-2 .. AFF-5), for MLX's CUDA backend.

One warp per group: min and max by warp shuffles, then scale and bias, then the codes,
packed into the group's own words (a group of 32, 64 or 128 codes fills whole words
at every width), one word per lane. Every float step is an explicitly rounded IEEE
intrinsic (`__fsub_rn`, `__fdiv_rn`, `rintf`), so neither compiler flags nor
contraction can change a bit.
The kernel also ranks input the format cannot hold (AFF-1, AFF-7) as DEFER-2 does: 2 for
NaN or inf, 1 for a range or edge / scale that overflows float32; such a group is stored as
DEFER-1 says (codes 0, bias 0, a quiet NaN scale). Each block folds its groups' largest
rank into a prior one (DEFER-3), so a cache's running rank costs no launch of its own.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from kvspec.accelerated.cuda_source import compact
from kvspec.accelerated.dtypes import dtype_name
from kvspec.reference.dtypes import QUIET_NAN_BITS

_WARPS_PER_BLOCK = 32  # as in the kernel source: a decode step's groups fit in one block

_SOURCE = r"""
    // One warp per group; lane l holds elements l, l + 32, ... (reads coalesce).
    constexpr int PER_LANE = GROUP / 32;
    constexpr int WORDS = GROUP * BITS / 32;
    constexpr int WARPS_PER_BLOCK = 32;
    __shared__ unsigned char codes[WARPS_PER_BLOCK * GROUP];
    __shared__ unsigned int block_rank;
    const unsigned int lane = threadIdx.x & 31;
    const unsigned int warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) block_rank = 0;
    __syncthreads();
    const unsigned long long index = (unsigned long long)blockIdx.x * WARPS_PER_BLOCK + warp;
    unsigned long long size = 1;
    for (int axis = 0; axis < w_ndim; ++axis) size *= w_shape[axis];
    const unsigned long long groups = size / GROUP;
__SELECT__
    const T* src = source + (active ? group : 0) * GROUP;
    float x[PER_LANE];
    float w_min = __int_as_float(0x7f800000);
    float w_max = -w_min;
    bool finite = true;
    for (int k = 0; k < PER_LANE; ++k) {
        x[k] = static_cast<float>(src[lane + 32 * k]);
        finite = finite && isfinite(x[k]);
        w_min = fminf(w_min, x[k]);
        w_max = fmaxf(w_max, x[k]);
    }
    for (int offset = 16; offset > 0; offset >>= 1) {
        w_min = fminf(w_min, __shfl_xor_sync(0xffffffffu, w_min, offset));
        w_max = fmaxf(w_max, __shfl_xor_sync(0xffffffffu, w_max, offset));
    }
    finite = __all_sync(0xffffffffu, finite);
    const float n_bins = (float)((1 << BITS) - 1);
    float span = __fsub_rn(w_max, w_min);
    bool negative = fabsf(w_min) > fabsf(w_max);
    float scale = fmaxf(__fdiv_rn(span, n_bins), 1e-7f);
    scale = negative ? scale : -scale;
    float edge = negative ? w_min : w_max;
    float q0 = rintf(__fdiv_rn(edge, scale));
    float bias = 0.0f;
    if (q0 != 0.0f) {
        scale = __fdiv_rn(edge, q0);
        bias = edge;
    }
    // DEFER-2's rank of the group's first failed check of AFF-1, AFF-7 (0: none).
    const unsigned int failure = !finite ? 2 : (isfinite(span) && isfinite(q0) ? 0 : 1);
    unsigned char* own = codes + warp * GROUP;
    for (int k = 0; k < PER_LANE; ++k) {
        float q = rintf(__fdiv_rn(__fsub_rn(x[k], bias), scale));
        own[lane + 32 * k] = failure ? 0 : (unsigned char)fminf(fmaxf(q, 0.0f), n_bins);
    }
    __syncwarp();
    if (active && lane < WORDS) {
        // Word `lane` holds stream bits [32 lane, 32 lane + 32) (BITS-2).
        unsigned int word = 0;
        for (int i = (32 * lane) / BITS; i <= (32 * lane + 31) / BITS; ++i) {
            int shift = i * BITS - 32 * (int)lane;
            unsigned int code = own[i];
            word |= shift >= 0 ? code << shift : code >> -shift;
        }
        words[group * WORDS + lane] = word;
    }
    if (active && lane == 0) {
        T nan_value;
        const unsigned int nan_bits = NAN_BITS;
        memcpy(&nan_value, &nan_bits, sizeof(T));  // little-endian: the low bytes
        group_scales[group] = failure ? nan_value : static_cast<T>(scale);
        group_biases[group] = static_cast<T>(failure ? 0.0f : bias);
        if (failure) atomicMax(&block_rank, failure);
    }
    __syncthreads();
    // The block's rank folded into the prior one (DEFER-3); the caller folds the blocks.
    if (threadIdx.x == 0) total[blockIdx.x] = max(prior[0], block_rank);
"""


# Which tensor a warp's group comes from, and where its codes, scale and bias go.
_ONE_TENSOR = """
    const bool active = index < groups;
    const unsigned long long group = index;
    const T* source = w;
    unsigned int* words = wq;
    T* group_scales = scales;
    T* group_biases = biases;
"""
# Keys' groups first, then the values' (k and v share one shape).
_TWO_TENSORS = """
    const bool active = index < 2 * groups;
    const bool second = index >= groups;
    const unsigned long long group = second ? index - groups : index;
    const T* source = second ? v : w;
    unsigned int* words = second ? v_wq : wq;
    T* group_scales = second ? v_scales : scales;
    T* group_biases = second ? v_biases : biases;
"""


@cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(
        name="kvspec_affine_quantize",
        input_names=["w", "prior"],
        output_names=["wq", "scales", "biases", "total"],
        source=compact(_SOURCE.replace("__SELECT__", _ONE_TENSOR)),
    )


@cache
def _pair_kernel() -> object:
    return mx.fast.cuda_kernel(
        name="kvspec_affine_quantize_pair",
        input_names=["w", "v", "prior"],
        output_names=["wq", "scales", "biases", "v_wq", "v_scales", "v_biases", "total"],
        source=compact(_SOURCE.replace("__SELECT__", _TWO_TENSORS)),
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
    wq, scales, biases, failure = _launch(_kernel(), (w,), group_size, bits, prior)
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
    return _launch(_pair_kernel(), (k, v), group_size, bits, prior)


def _launch(
    kernel: object,
    tensors: tuple[mx.array, ...],
    group_size: int,
    bits: int,
    prior: mx.array | None,
) -> tuple[mx.array, ...]:
    """Every group of `tensors` (one shape and dtype) through `kernel`: each tensor's
    (wq, scales, biases), then the failure."""
    w = tensors[0]
    *lead, D = w.shape
    n_groups = len(tensors) * (w.size // group_size)
    blocks = -(-n_groups // _WARPS_PER_BLOCK)
    *fields, totals = kernel(
        inputs=[*tensors, no_failure() if prior is None else prior],
        template=[
            ("T", w.dtype),
            ("GROUP", group_size),
            ("BITS", bits),
            ("NAN_BITS", QUIET_NAN_BITS[dtype_name(w.dtype)]),
        ],
        grid=(n_groups * 32, 1, 1),
        threadgroup=(_WARPS_PER_BLOCK * 32, 1, 1),
        output_shapes=[(*lead, D * bits // 32), (*lead, D // group_size), (*lead, D // group_size)]
        * len(tensors)
        + [(blocks,)],
        output_dtypes=[mx.uint32, w.dtype, w.dtype] * len(tensors) + [mx.uint32],
    )
    failure = totals if blocks == 1 else mx.max(totals, keepdims=True)
    return (*fields, failure)
