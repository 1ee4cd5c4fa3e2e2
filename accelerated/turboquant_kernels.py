"""The TurboQuant decode as one CUDA kernel (spec TQ-5, TQ-8, TQ-9), for MLX's CUDA backend.

One thread block per stored vector, one thread per coordinate. Each thread unpacks
its key code and value code straight from the packed bytes, decodes the key as
(code + zero) * scale and the value as centroid[code] * scale, and, unless the
values stay rotated, the block unrotates them: butterflies at strides 1, 2, ..., D/2
(within a warp by shuffles, across warps through shared memory), one multiply by
f32(1/sqrt(D)), then the signs. Every float
step is an explicitly rounded IEEE intrinsic (`__fadd_rn`, `__fsub_rn`,
`__fmul_rn`), so neither compiler flags nor FMA contraction can change a bit: the
result equals the plain MLX path (and the reference) bit for bit.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from kvspec.accelerated.cuda_source import compact
from kvspec.reference.turboquant import DEFERRED_CHECKS
from kvspec.reference.turboquant_tables import INV_SQRT_BITS

_HEADER = r"""
template <int BITS, typename T>
__device__ __forceinline__ unsigned int kvspec_tq_code(const T* row, unsigned int j) {
    // Code j of an LSB-first byte stream (TQ-9); a code of <= 8 bits spans <= 2 bytes.
    const unsigned int bit = j * BITS;
    const unsigned int byte = bit >> 3;
    const unsigned int shift = bit & 7u;
    unsigned int window = (unsigned int)(unsigned char)row[byte];
    if (shift + BITS > 8) {
        window |= (unsigned int)(unsigned char)row[byte + 1] << 8;
    }
    return (window >> shift) & ((1u << BITS) - 1u);
}
"""

_SOURCE = r"""
    const unsigned int row = blockIdx.x;
    const unsigned int j = threadIdx.x;
    const unsigned int group = j / 32;
    const unsigned long long base = (unsigned long long)row * D;
    const unsigned long long group_base = (unsigned long long)row * (D / 32);

    float key_code;
    if (KBITS == 8) {
        key_code = (float)(int)(signed char)k_idx[base + j];
    } else {
        const unsigned long long stride = D * KBITS / 8;
        key_code = (float)kvspec_tq_code<KBITS>(k_idx + (unsigned long long)row * stride, j);
    }
    const float key_zero = __half2float(k_zeros[group_base + group]);
    const float key_scale = __half2float(k_scales[group_base + group]);
    keys[base + j] = __fmul_rn(__fadd_rn(key_code, key_zero), key_scale);

    unsigned int value_code;
    if (VBITS == 8) {
        value_code = (unsigned int)v_packed[base + j];
    } else {
        const unsigned long long stride = D * VBITS / 8;
        value_code = kvspec_tq_code<VBITS>(v_packed + (unsigned long long)row * stride, j);
    }
    float rotated =
        __fmul_rn(centroids[value_code], __half2float(v_scales[group_base + group]));
    if (DEFER) {
        values[base + j] = rotated;
        return;
    }
    // Butterflies at strides 1 .. D/2 (element j of a pair (j, j + h) becomes a + b,
    // element j + h a - b): lanes of one warp by shuffles, wider strides through shared
    // memory, a buffer per stride in turn (one barrier a stride).
    #pragma unroll
    for (unsigned int h = 1; h < 32 && h < D; h <<= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, rotated, h);
        rotated = (j & h) == 0 ? __fadd_rn(rotated, other) : __fsub_rn(other, rotated);
    }
    __shared__ float lane[2][D];
    #pragma unroll
    for (unsigned int h = 32, turn = 0; h < D; h <<= 1, turn ^= 1) {
        lane[turn][j] = rotated;
        __syncthreads();
        const float other = lane[turn][j ^ h];
        rotated = (j & h) == 0 ? __fadd_rn(rotated, other) : __fsub_rn(other, rotated);
    }
    const float scaled = __fmul_rn(rotated, __int_as_float(INV_SQRT_BITS));
    values[base + j] = __fmul_rn(scaled, signs[j]);
"""


@cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(
        name="kvspec_turboquant_decode",
        input_names=["k_idx", "k_scales", "k_zeros", "v_packed", "v_scales", "centroids", "signs"],
        output_names=["keys", "values"],
        source=compact(_SOURCE),
        header=compact(_HEADER),
    )


def fused_decode(
    k_idx: mx.array,
    k_scales: mx.array,
    k_zeros: mx.array,
    v_packed: mx.array,
    v_scales: mx.array,
    centroids: mx.array,
    signs: mx.array,
    k_bits: int,
    v_bits: int,
    head_dim: int,
    defer_v: bool,
) -> tuple[mx.array, mx.array]:
    """float32 keys and values [B, H, L, head_dim] of the stored fields, in one launch.

    The fields are validated by the caller (turboquant.decode) and cut to the positions
    to read; `centroids` is the value codebook and `signs` the head_dim's sign vector.
    """
    B, H, L, _ = k_scales.shape
    shape = (B, H, L, head_dim)
    rows = B * H * L
    if rows == 0:
        return mx.zeros(shape, mx.float32), mx.zeros(shape, mx.float32)
    keys, values = _kernel()(
        inputs=[k_idx, k_scales, k_zeros, v_packed, v_scales, centroids, signs],
        template=[
            ("D", head_dim),
            ("KBITS", k_bits),
            ("VBITS", v_bits),
            ("DEFER", defer_v),
            ("INV_SQRT_BITS", INV_SQRT_BITS[head_dim]),
        ],
        grid=(rows * head_dim, 1, 1),
        threadgroup=(head_dim, 1, 1),
        output_shapes=[shape, shape],
        output_dtypes=[mx.float32, mx.float32],
    )
    return keys, values


# TQ-3 .. TQ-10 in one pass: each block encodes one position of one head, keys and values.
_ENCODE_SOURCE = r"""
    // Block: R rows (positions of a head) of D threads; thread (j, r) holds element j of
    // row r. Warp w of a row is key group w and value group w (groups of 32).
    const unsigned int j = threadIdx.x;
    const unsigned int r = threadIdx.y;
    const unsigned int R = blockDim.y;
    const unsigned int lane = j & 31;
    const unsigned int group = j >> 5;
    // k is [B, H, L, D] (the caller checks): constant indices, no loop over the shape.
    const unsigned long long rows =
        (unsigned long long)k_shape[0] * (unsigned long long)k_shape[1] * k_shape[2];
    const unsigned long long row_index = (unsigned long long)blockIdx.x * R + r;
    const bool active = row_index < rows;
    const unsigned long long row = active ? row_index : rows - 1;
    const unsigned long long base = row * D;
    const unsigned long long group_base = row * (D / 32);
    __shared__ unsigned char key_codes[1024];
    __shared__ unsigned char value_codes[1024];
    __shared__ float lane_values[2][1024];
    __shared__ unsigned int row_failures[32];
    __shared__ unsigned int block_rank;
    unsigned char* own_keys = key_codes + r * D;
    unsigned char* own_values = value_codes + r * D;
    // Ordered before the atomics below by the rotation's first barrier (D >= 64: TQ's
    // head dims have a stride of 32 or more, which crosses warps).
    if (j == 0) row_failures[r] = 0;
    if (j == 0 && r == 0) block_rank = 0;
    const __half nan16 = __ushort_as_half((unsigned short)0x7E00);

    // TQ-4 keys: the group's range, scale, step and zero point, each one IEEE operation.
    const float x = static_cast<float>(k[base + j]);
    bool finite = isfinite(x);
    float top = x, bottom = x;
    for (int o = 16; o > 0; o >>= 1) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
        bottom = fminf(bottom, __shfl_xor_sync(0xffffffffu, bottom, o));
    }
    finite = __all_sync(0xffffffffu, finite);
    const bool is_signed = KBITS == 8;
    const float levels = is_signed ? 254.0f : (float)((1 << KBITS) - 1);
    const float eps = 1e-8f;
    const float span = __fsub_rn(top, bottom);
    float scale = __fdiv_rn(span, levels);
    const float step = __fadd_rn(scale, eps);
    float zero = is_signed ? rintf(__fdiv_rn(__fadd_rn(top, bottom), __fmul_rn(step, 2.0f)))
                           : rintf(__fdiv_rn(bottom, step));
    zero = __fadd_rn(zero, 0.0f);  // a zero point of -0 is stored as +0
    // TQ-11: a constant group stores its magnitude and its sign.
    const bool constant = span == 0.0f;
    const float sign = top > 0.0f ? 1.0f : (top < 0.0f ? -1.0f : 0.0f);
    if (constant) {
        scale = fabsf(top);
        zero = is_signed ? 0.0f : fminf(sign, 0.0f);
    }
    const __half scale16 = __float2half_rn(scale);
    const __half zero16 = __float2half_rn(zero);
    const bool scale_fits = isfinite(__half2float(scale16));
    const bool zero_fits = isfinite(__half2float(zero16));
    float code = constant ? __fsub_rn(sign, zero) : rintf(__fsub_rn(__fdiv_rn(x, step), zero));
    const bool key_ok = finite && scale_fits && zero_fits;
    if (is_signed) {
        code = fminf(fmaxf(code, -127.0f), 127.0f);
    } else {
        code = fminf(fmaxf(code, 0.0f), levels);
    }
    // DEFER-1: a group the format cannot hold stores codes 0, zero 0 and a NaN scale.
    const int key_code = key_ok ? (int)code : 0;
    if (is_signed) {
        if (active) k_idx[base + j] = (signed char)key_code;
    } else {
        own_keys[j] = (unsigned char)key_code;
    }
    if (active && lane == 0) {
        k_scales[group_base + group] = key_ok ? scale16 : nan16;
        k_zeros[group_base + group] = key_ok ? zero16 : __float2half_rn(0.0f);
    }

    // TQ-6 rotation: the signs, butterflies at strides 1 .. D/2, then f32(1/sqrt(D)).
    // Element j of a butterfly pair (j, j + h) becomes a + b, element j + h a - b: strides
    // below 32 pair lanes of one warp (shuffles); wider ones pass through shared memory,
    // a buffer per stride in turn, so one barrier a stride keeps every read before the
    // next write to its buffer.
    const float value = static_cast<float>(v[base + j]);
    float rotated = __fmul_rn(value, signs[j]);
    #pragma unroll
    for (unsigned int h = 1; h < 32 && h < D; h <<= 1) {
        const float other = __shfl_xor_sync(0xffffffffu, rotated, h);
        rotated = (j & h) == 0 ? __fadd_rn(rotated, other) : __fsub_rn(other, rotated);
    }
    #pragma unroll
    for (unsigned int h = 32, turn = 0; h < D; h <<= 1, turn ^= 1) {
        float* own_lanes = lane_values[turn] + r * D;
        own_lanes[j] = rotated;
        __syncthreads();
        const float other = own_lanes[j ^ h];
        rotated = (j & h) == 0 ? __fadd_rn(rotated, other) : __fsub_rn(other, rotated);
    }
    const float y = __fmul_rn(rotated, __int_as_float(INV_SQRT_BITS));
    // TQ-7: the group rms by the halving tree (partial[i] + partial[i + w], w = 16 .. 1).
    float partial = __fmul_rn(y, y);
    for (int w = 16; w > 0; w >>= 1) {
        const float other = __shfl_down_sync(0xffffffffu, partial, w);
        if (lane < (unsigned int)w) partial = __fadd_rn(partial, other);
    }
    const float rms = __fsqrt_rn(__fdiv_rn(__shfl_sync(0xffffffffu, partial, 0), 32.0f));
    const __half rms16 = __float2half_rn(rms);
    const bool value_ok = isfinite(__half2float(rms16));
    const float u = __fdiv_rn(y, __fadd_rn(rms, eps));
    // The number of boundaries strictly below u, by binary search over the sorted table.
    unsigned int count = 0;
    for (unsigned int stride = 1u << (VBITS - 1); stride >= 1; stride >>= 1) {
        if (boundaries[count + stride - 1] < u) count += stride;
    }
    own_values[j] = value_ok ? (unsigned char)count : 0;
    if (active && lane == 0) v_scales[group_base + group] = value_ok ? rms16 : nan16;

    // DEFER-2: bit i of a row's failures is TQ-3's check i; the row's rank names its
    // lowest bit, the block's rank is the largest, folded into the prior one (DEFER-3).
    unsigned int bits = 0;
    if (!finite && lane == 0) bits |= 1u;
    if (!isfinite(value)) bits |= 2u;
    if (!scale_fits && lane == 0) bits |= 4u;
    if (!zero_fits && lane == 0) bits |= 8u;
    if (!value_ok && lane == 0) bits |= 16u;
    if (active && bits != 0) atomicOr(&row_failures[r], bits);
    __syncthreads();
    if (j == 0 && row_failures[r] != 0) {
        atomicMax(&block_rank, CHECKS - __ffs(row_failures[r]) + 1);
    }

    // TQ-9: each vector's codes as one LSB-first byte stream; thread m writes byte m.
    if (active && !is_signed && j < D * KBITS / 8) {
        unsigned int byte = 0;
        for (unsigned int i = (8 * j) / KBITS; i <= (8 * j + 7) / KBITS; ++i) {
            const int shift = (int)(i * KBITS) - (int)(8 * j);
            const unsigned int c = own_keys[i];
            byte |= shift >= 0 ? c << shift : c >> -shift;
        }
        k_idx[row * (D * KBITS / 8) + j] = (unsigned char)byte;
    }
    if (active && j < D * VBITS / 8) {
        unsigned int byte = 0;
        for (unsigned int i = (8 * j) / VBITS; i <= (8 * j + 7) / VBITS; ++i) {
            const int shift = (int)(i * VBITS) - (int)(8 * j);
            const unsigned int c = own_values[i];
            byte |= shift >= 0 ? c << shift : c >> -shift;
        }
        v_packed[row * (D * VBITS / 8) + j] = (unsigned char)byte;
    }
    __syncthreads();
    if (j == 0 && r == 0) total[blockIdx.x] = max(prior[0], block_rank);
"""


@cache
def _encode_kernel() -> object:
    return mx.fast.cuda_kernel(
        name="kvspec_turboquant_encode",
        input_names=["k", "v", "boundaries", "signs", "prior"],
        output_names=["k_idx", "k_scales", "k_zeros", "v_packed", "v_scales", "total"],
        source=compact(_ENCODE_SOURCE),
    )


def fused_encode(
    k: mx.array,
    v: mx.array,
    boundaries: mx.array,
    signs: mx.array,
    prior: mx.array,
    k_bits: int,
    v_bits: int,
) -> tuple[mx.array, ...]:
    """The five stored fields of k, v [B, H, L, D] (TQ-10), in one launch, and the failure
    (uint32 [1]): the largest DEFER-2 rank of any row and of `prior` (uint32 [1]). Groups
    that fail are stored as DEFER-1 says. A block takes as many rows as 1024 threads hold,
    so a decode step's rows fit one block; more blocks' ranks are folded by one more op.
    Shapes, dtypes and widths are validated by the caller (turboquant.encode)."""
    B, H, L, D = k.shape
    rows = B * H * L
    per_block = max(1, min(rows, 1024 // D))
    blocks = -(-rows // per_block)
    groups = (B, H, L, D // 32)
    k_dtype = mx.int8 if k_bits == 8 else mx.uint8
    *fields, totals = _encode_kernel()(
        inputs=[k, v, boundaries, signs, prior],
        template=[
            ("T", k.dtype),  # names the instance: NVRTC compiles one per input dtype
            ("D", D),
            ("KBITS", k_bits),
            ("VBITS", v_bits),
            ("INV_SQRT_BITS", INV_SQRT_BITS[D]),
            ("CHECKS", len(DEFERRED_CHECKS)),
        ],
        grid=(blocks * D, per_block, 1),
        threadgroup=(D, per_block, 1),
        output_shapes=[
            (B, H, L, D * k_bits // 8),
            groups,
            groups,
            (B, H, L, D * v_bits // 8),
            groups,
            (blocks,),
        ],
        output_dtypes=[k_dtype, mx.float16, mx.float16, mx.uint8, mx.float16, mx.uint32],
    )
    failure = totals if blocks == 1 else mx.max(totals, keepdims=True)
    return (*fields, failure)
