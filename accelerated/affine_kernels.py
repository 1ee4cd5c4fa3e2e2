"""The affine encoder as one CUDA kernel (spec AFF-2 .. AFF-5), for MLX's CUDA backend.

One thread per group: min and max, then scale and bias, then the codes, packed into
the group's own words (a group of 32, 64 or 128 codes fills whole words at every
width). Every float step is an explicitly rounded IEEE intrinsic (`__fsub_rn`,
`__fdiv_rn`, `rintf`), so neither compiler flags nor contraction can change a bit.
The kernel also reports, per group, input the format cannot hold (AFF-1, AFF-7):
2 for NaN or inf, 1 for a range or edge / scale that overflows float32.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

NONFINITE = 2
OVERFLOW = 1

_SOURCE = r"""
    const unsigned int group = blockIdx.x * blockDim.x + threadIdx.x;
    if (group >= n_groups[0]) return;
    const T* src = w + (unsigned long long)group * GROUP;
    float w_min = __int_as_float(0x7f800000);
    float w_max = -w_min;
    bool finite = true;
    for (int j = 0; j < GROUP; ++j) {
        float x = static_cast<float>(src[j]);
        finite = finite && isfinite(x);
        w_min = fminf(w_min, x);
        w_max = fmaxf(w_max, x);
    }
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
    status[group] = !finite ? 2 : (isfinite(span) && isfinite(q0) ? 0 : 1);
    unsigned int* dst = wq + (unsigned long long)group * (GROUP * BITS / 32);
    unsigned long long pending = 0;
    int pending_bits = 0;
    int word = 0;
    for (int j = 0; j < GROUP; ++j) {
        float x = static_cast<float>(src[j]);
        float q = rintf(__fdiv_rn(__fsub_rn(x, bias), scale));
        q = fminf(fmaxf(q, 0.0f), n_bins);
        pending |= (unsigned long long)(unsigned int)q << pending_bits;
        pending_bits += BITS;
        if (pending_bits >= 32) {
            dst[word++] = (unsigned int)pending;
            pending >>= 32;
            pending_bits -= 32;
        }
    }
    scales[group] = static_cast<T>(scale);
    biases[group] = static_cast<T>(bias);
"""


@cache
def _kernel() -> object:
    return mx.fast.cuda_kernel(
        name="kvspec_affine_quantize",
        input_names=["w", "n_groups"],
        output_names=["wq", "scales", "biases", "status"],
        source=_SOURCE,
    )


def quantize_groups(
    w: mx.array, group_size: int, bits: int
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """(wq, scales, biases, status) of `w` [..., D]; status per group as above."""
    *lead, D = w.shape
    n_groups = w.size // group_size
    threads = 256
    return _kernel()(
        inputs=[w, mx.array([n_groups], dtype=mx.uint32)],
        template=[("T", w.dtype), ("GROUP", group_size), ("BITS", bits)],
        grid=(-(-n_groups // threads) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(*lead, D * bits // 32)] + [(*lead, D // group_size)] * 3,
        output_dtypes=[mx.uint32, w.dtype, w.dtype, mx.uint8],
    )
