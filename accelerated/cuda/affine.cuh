// The affine encoder's CUDA kernel (spec AFF-2 .. AFF-5, DEFER-1 .. DEFER-3):
// accelerated/affine_kernels.py describes it. Its custom kernels include this file and call
// quantize_groups, so that the source MLX builds and hashes at every call stays short.
#pragma once

namespace kvspec_affine {

// Elements of a group one lane holds: consecutive, one 16-byte load for 2-byte formats.
constexpr int PER_LANE = 8;

template <typename T>
__device__ __forceinline__ void load_lane(const T* src, float (&x)[PER_LANE]) {
    // PER_LANE consecutive elements: 16-byte loads where the address allows (a group starts
    // at a multiple of 32 elements, so only an input that begins off 16 bytes does not).
    constexpr int PER_VECTOR = 16 / (int)sizeof(T);
    if (reinterpret_cast<unsigned long long>(src) % 16 == 0) {
        #pragma unroll
        for (int i = 0; i < PER_LANE / PER_VECTOR; ++i) {
            const uint4 raw = reinterpret_cast<const uint4*>(src)[i];
            T values[PER_VECTOR];
            memcpy(values, &raw, 16);
            #pragma unroll
            for (int k = 0; k < PER_VECTOR; ++k) x[i * PER_VECTOR + k] = static_cast<float>(values[k]);
        }
    } else {
        #pragma unroll
        for (int k = 0; k < PER_LANE; ++k) x[k] = static_cast<float>(src[k]);
    }
}

// The groups of w (and, PAIR, of v after them). A group of GROUP elements takes LANES =
// GROUP / PER_LANE consecutive threads, thread `part` of the group holding its elements
// [PER_LANE part, PER_LANE part + PER_LANE): the range reduces over log2(LANES) shuffles,
// and at 2, 4 and 8 bits a thread's codes fill half a word, one word or two words of the
// group's stream (BITS-2) in registers; other widths pack through shared memory. With
// ROW_BYTES > 0 (PAIR only) the six fields go to one record per row of w's last axis
// (accelerated/records.py): ROW_BYTES bytes, the fields at byte offsets OFF_*, the bytes
// outside them zero; the six field pointers are then not used.
template <bool PAIR, typename T, int GROUP, int BITS, int NAN_BITS, int ROW_BYTES, int OFF_KW,
          int OFF_KS, int OFF_KB, int OFF_VW, int OFF_VS, int OFF_VB, typename Shape>
__device__ __forceinline__ void quantize_groups(
    const T* w, const Shape& w_shape, int w_ndim, const T* v, const uint32_t* prior,
    uint32_t* wq, T* scales, T* biases, uint32_t* v_wq, T* v_scales, T* v_biases,
    uint8_t* record, uint32_t* total) {
    constexpr int LANES = GROUP / PER_LANE;  // 4, 8 or 16
    constexpr int MOST_GROUPS_PER_BLOCK = 1024 / LANES;  // blocks of up to 1024 threads
    constexpr int WORDS = GROUP * BITS / 32;
    __shared__ unsigned char codes[MOST_GROUPS_PER_BLOCK * GROUP];
    __shared__ unsigned int block_rank;
    const unsigned int part = threadIdx.x % LANES;
    const unsigned int slot = threadIdx.x / LANES;
    if (threadIdx.x == 0) block_rank = 0;
    __syncthreads();
    const unsigned long long index = (unsigned long long)blockIdx.x * (blockDim.x / LANES) + slot;
    unsigned long long size = 1;
    for (int axis = 0; axis < w_ndim; ++axis) size *= w_shape[axis];
    const unsigned long long groups = size / GROUP;
    // Which tensor a group comes from (PAIR: keys' groups first, then the values' of the
    // same shape), and where its codes, scale and bias go.
    const bool second = PAIR && index >= groups;
    const bool active = index < (PAIR ? 2 : 1) * groups;
    const unsigned long long group = second ? index - groups : index;
    const T* source = second ? v : w;
    unsigned int* group_words;
    T* group_scale;
    T* group_bias;
    if constexpr (ROW_BYTES > 0) {
        // Group j of row `row` of its tensor; the row's record holds both tensors' fields.
        const unsigned long long per_row = w_shape[w_ndim - 1] / GROUP;
        const unsigned long long row = group / per_row;
        const unsigned long long j = group % per_row;
        uint8_t* own = record + row * ROW_BYTES;
        group_words = reinterpret_cast<unsigned int*>(own + (second ? OFF_VW : OFF_KW)) + j * WORDS;
        group_scale = reinterpret_cast<T*>(own + (second ? OFF_VS : OFF_KS)) + j;
        group_bias = reinterpret_cast<T*>(own + (second ? OFF_VB : OFF_KB)) + j;
        // The record's bytes outside every field, spread over the threads of the row's keys.
        const unsigned long long word_bytes = per_row * WORDS * 4;
        const unsigned long long group_bytes = per_row * sizeof(T);
        for (unsigned long long b = j * LANES + part; active && !second && b < ROW_BYTES;
             b += per_row * LANES) {
            const bool in_field = (b >= OFF_KW && b < OFF_KW + word_bytes) ||
                (b >= OFF_VW && b < OFF_VW + word_bytes) ||
                (b >= OFF_KS && b < OFF_KS + group_bytes) ||
                (b >= OFF_KB && b < OFF_KB + group_bytes) ||
                (b >= OFF_VS && b < OFF_VS + group_bytes) ||
                (b >= OFF_VB && b < OFF_VB + group_bytes);
            if (!in_field) own[b] = 0;
        }
    } else {
        group_words = (second ? v_wq : wq) + group * WORDS;
        group_scale = (second ? v_scales : scales) + group;
        group_bias = (second ? v_biases : biases) + group;
    }

    float x[PER_LANE];
    load_lane<T>(source + (active ? group : 0) * GROUP + part * PER_LANE, x);
    float w_min = __int_as_float(0x7f800000);
    float w_max = -w_min;
    bool finite = true;
    #pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
        finite = finite && isfinite(x[k]);
        w_min = fminf(w_min, x[k]);
        w_max = fmaxf(w_max, x[k]);
    }
    // The group's threads are consecutive lanes of one warp (LANES divides 32).
    int all_finite = finite;
    #pragma unroll
    for (int offset = LANES / 2; offset > 0; offset >>= 1) {
        w_min = fminf(w_min, __shfl_xor_sync(0xffffffffu, w_min, offset));
        w_max = fmaxf(w_max, __shfl_xor_sync(0xffffffffu, w_max, offset));
        all_finite &= __shfl_xor_sync(0xffffffffu, all_finite, offset);
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
    // DEFER-2's rank of the group's first failed check of AFF-1, AFF-7 (0: none).
    const unsigned int failure = !all_finite ? 2 : (isfinite(span) && isfinite(q0) ? 0 : 1);
    unsigned int code[PER_LANE];
    #pragma unroll
    for (int k = 0; k < PER_LANE; ++k) {
        float q = rintf(__fdiv_rn(__fsub_rn(x[k], bias), scale));
        code[k] = failure ? 0 : (unsigned int)fminf(fmaxf(q, 0.0f), n_bins);
    }
    // The group's stream (BITS-2): code i at bits [BITS i, BITS i + BITS), LSB first.
    if constexpr (BITS == 4 || BITS == 8) {
        // PER_LANE * BITS / 32 whole words of the thread's own codes.
        constexpr int OWN = PER_LANE * BITS / 32;
        constexpr int PER_WORD = 32 / BITS;
        #pragma unroll
        for (int i = 0; i < OWN; ++i) {
            unsigned int word = 0;
            #pragma unroll
            for (int k = 0; k < PER_WORD; ++k) word |= code[i * PER_WORD + k] << (k * BITS);
            if (active) group_words[part * OWN + i] = word;
        }
    } else if constexpr (BITS == 2) {
        // Half a word each: an even thread takes its odd neighbour's half as the top one.
        unsigned int half = 0;
        #pragma unroll
        for (int k = 0; k < PER_LANE; ++k) half |= code[k] << (k * BITS);
        const unsigned int upper = __shfl_down_sync(0xffffffffu, half, 1);
        if (active && part % 2 == 0) group_words[part / 2] = half | (upper << 16);
    } else {
        // Words that straddle threads: the codes through shared memory, then word by word.
        unsigned char* own = codes + slot * GROUP;
        #pragma unroll
        for (int k = 0; k < PER_LANE; ++k) own[part * PER_LANE + k] = (unsigned char)code[k];
        __syncwarp();
        for (int j = part; j < WORDS; j += LANES) {
            // Word j holds stream bits [32 j, 32 j + 32).
            unsigned int word = 0;
            for (int i = (32 * j) / BITS; i <= (32 * j + 31) / BITS; ++i) {
                const int shift = i * BITS - 32 * j;
                const unsigned int c = own[i];
                word |= shift >= 0 ? c << shift : c >> -shift;
            }
            if (active) group_words[j] = word;
        }
    }
    if (active && part == 0) {
        T nan_value;
        const unsigned int nan_bits = NAN_BITS;
        memcpy(&nan_value, &nan_bits, sizeof(T));  // little-endian: the low bytes
        *group_scale = failure ? nan_value : static_cast<T>(scale);
        *group_bias = static_cast<T>(failure ? 0.0f : bias);
        if (failure) atomicMax(&block_rank, failure);
    }
    __syncthreads();
    // The block's rank folded into the prior one (DEFER-3); the caller folds the blocks.
    if (threadIdx.x == 0) total[blockIdx.x] = max(prior[0], block_rank);
}

}  // namespace kvspec_affine
