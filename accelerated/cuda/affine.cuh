// The affine encoder's CUDA kernel (spec AFF-2 .. AFF-5, DEFER-1 .. DEFER-3):
// accelerated/affine_kernels.py describes it. Its custom kernels include this file and call
// quantize_groups, so that the source MLX builds and hashes at every call stays short.
#pragma once

namespace kvspec_affine {

// The groups of w (and, PAIR, of v after them), one warp each.
template <bool PAIR, typename T, int GROUP, int BITS, int NAN_BITS, typename Shape>
__device__ __forceinline__ void quantize_groups(
    const T* w, const Shape& w_shape, int w_ndim, const T* v, const uint32_t* prior,
    uint32_t* wq, T* scales, T* biases, uint32_t* v_wq, T* v_scales, T* v_biases,
    uint32_t* total) {
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
    // Which tensor a warp's group comes from (PAIR: keys' groups first, then the values'
    // of the same shape), and where its codes, scale and bias go.
    const bool second = PAIR && index >= groups;
    const bool active = index < (PAIR ? 2 : 1) * groups;
    const unsigned long long group = second ? index - groups : index;
    const T* source = second ? v : w;
    unsigned int* words = second ? v_wq : wq;
    T* group_scales = second ? v_scales : scales;
    T* group_biases = second ? v_biases : biases;
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
}

}  // namespace kvspec_affine
