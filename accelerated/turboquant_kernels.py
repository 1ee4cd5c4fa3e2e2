"""The TurboQuant decode as one CUDA kernel (spec TQ-5, TQ-8, TQ-9), for MLX's CUDA backend.

One thread block per stored vector, one thread per coordinate. Each thread unpacks
its key code and value code straight from the packed bytes, decodes the key as
(code + zero) * scale and the value as centroid[code] * scale, and, unless the
values stay rotated, the block unrotates them in shared memory: butterflies at
strides 1, 2, ..., D/2, one multiply by f32(1/sqrt(D)), then the signs. Every float
step is an explicitly rounded IEEE intrinsic (`__fadd_rn`, `__fsub_rn`,
`__fmul_rn`), so neither compiler flags nor FMA contraction can change a bit: the
result equals the plain MLX path (and the reference) bit for bit.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

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
    const float rotated =
        __fmul_rn(centroids[value_code], __half2float(v_scales[group_base + group]));
    if (DEFER) {
        values[base + j] = rotated;
        return;
    }
    __shared__ float lane[D];
    lane[j] = rotated;
    __syncthreads();
    for (unsigned int h = 1; h < D; h <<= 1) {
        if ((j & h) == 0) {
            const float a = lane[j];
            const float b = lane[j + h];
            lane[j] = __fadd_rn(a, b);
            lane[j + h] = __fsub_rn(a, b);
        }
        __syncthreads();
    }
    const float scaled = __fmul_rn(lane[j], __int_as_float(INV_SQRT_BITS));
    values[base + j] = __fmul_rn(scaled, signs[j]);
"""


@cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(
        name="kvspec_turboquant_decode",
        input_names=["k_idx", "k_scales", "k_zeros", "v_packed", "v_scales", "centroids", "signs"],
        output_names=["keys", "values"],
        source=_SOURCE,
        header=_HEADER,
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
