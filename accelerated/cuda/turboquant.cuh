// TurboQuant's fused CUDA kernels (spec TQ-3 .. TQ-10): accelerated/turboquant_kernels.py
// describes them. Its custom kernels include this file and call decode_row and
// encode_rows, so that the source MLX builds and hashes at every call stays short.
#pragma once

namespace kvspec_tq {

template <int BITS, typename T>
__device__ __forceinline__ unsigned int code_at(const T* row, unsigned int j) {
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

// TQ-5, TQ-8, TQ-9: one stored vector per block (blockIdx.x), one thread per coordinate.
template <int D, int KBITS, int VBITS, bool DEFER, int INV_SQRT_BITS, typename KI>
__device__ __forceinline__ void decode_row(
    const KI* k_idx, const __half* k_scales, const __half* k_zeros, const uint8_t* v_packed,
    const __half* v_scales, const float* centroids, const float* signs, float* keys,
    float* values) {
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
        key_code = (float)code_at<KBITS>(k_idx + (unsigned long long)row * stride, j);
    }
    const float key_zero = __half2float(k_zeros[group_base + group]);
    const float key_scale = __half2float(k_scales[group_base + group]);
    keys[base + j] = __fmul_rn(__fadd_rn(key_code, key_zero), key_scale);

    unsigned int value_code;
    if (VBITS == 8) {
        value_code = (unsigned int)v_packed[base + j];
    } else {
        const unsigned long long stride = D * VBITS / 8;
        value_code = code_at<VBITS>(v_packed + (unsigned long long)row * stride, j);
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
}

constexpr int cmax(int a, int b) { return a > b ? a : b; }

// A thread's P codes of BITS bits as one LSB-first little-endian word of P * BITS bits
// (TQ-9), stored at its own byte offset when that is whole bytes: in one store where they
// are 1, 2, 4 or 8 bytes (the record's fields are 16-byte aligned), else byte by byte.
template <int P, int BITS>
__device__ __forceinline__ void store_codes(uint8_t* field, unsigned int t, const unsigned int (&codes)[P]) {
    constexpr int BYTES = P * BITS / 8;
    static_assert(P * BITS % 8 == 0 && BYTES <= 8, "whole bytes, one 64-bit word at most");
    unsigned long long word = 0;
    #pragma unroll
    for (int e = 0; e < P; ++e) {
        word |= (unsigned long long)(codes[e] & ((1u << BITS) - 1u)) << (e * BITS);
    }
    if constexpr (BYTES == 1) {
        field[t] = (uint8_t)word;
    } else if constexpr (BYTES == 2) {
        reinterpret_cast<unsigned short*>(field)[t] = (unsigned short)word;
    } else if constexpr (BYTES == 4) {
        reinterpret_cast<unsigned int*>(field)[t] = (unsigned int)word;
    } else if constexpr (BYTES == 8) {
        reinterpret_cast<unsigned long long*>(field)[t] = word;
    } else {
        #pragma unroll
        for (int b = 0; b < BYTES; ++b) field[t * BYTES + b] = (uint8_t)(word >> (8 * b));
    }
}

// TQ-9 for codes whose P-code words are not whole bytes: each vector's codes as one
// LSB-first byte stream through shared memory (`codes`, one byte a code); thread m writes
// byte m (and m + THREADS).
template <int BITS, int BYTES, int THREADS>
__device__ __forceinline__ void pack_codes(uint8_t* field, unsigned int t, const unsigned char* codes) {
    for (unsigned int m = t; m < BYTES; m += THREADS) {
        unsigned int byte = 0;
        for (unsigned int i = (8 * m) / BITS; i <= (8 * m + 7) / BITS; ++i) {
            const int shift = (int)(i * BITS) - (int)(8 * m);
            const unsigned int c = codes[i];
            byte |= shift >= 0 ? c << shift : c >> -shift;
        }
        field[m] = (uint8_t)byte;
    }
}

// TQ-3 .. TQ-10 in one pass: each block encodes R positions of a head, keys and values,
// into one record per position (accelerated/records.py): ROW_BYTES bytes, the five fields at
// byte offsets OFF_*, the bytes outside them (the row's end) zero. The block's shared
// buffers hold CAP coordinates: R D <= CAP.
template <typename T, int D, int P, int CAP, int KBITS, int VBITS, int INV_SQRT_BITS,
          int CHECKS, int ROW_BYTES, int OFF_KI, int OFF_KS, int OFF_KZ, int OFF_VP, int OFF_VS,
          typename Shape>
__device__ __forceinline__ void encode_rows(
    const T* k, const Shape& k_shape, const T* v, const float* boundaries, const float* signs,
    const uint32_t* prior, uint8_t* record, uint32_t* total) {
    constexpr int KEY_BYTES = D * KBITS / 8;
    constexpr int VALUE_BYTES = D * VBITS / 8;
    constexpr int GROUP_BYTES = D / 32 * 2;
    // Block: R rows (positions of a head) of D / P threads; thread (t, r) holds elements
    // P t .. P t + P - 1 of row r, so a group of 32 elements is 32 / P lanes: what a group
    // computes once (its range, scale, zero point, rms, checks) is shared by P times fewer
    // lanes than with one element a thread. A row fills whole warps, or a warp holds whole
    // rows (its shuffles then stay within a row: every stride of a row is below its width).
    static_assert(P == 1 || P == 2 || P == 4 || P == 8, "1, 2, 4 or 8 elements a thread");
    constexpr int THREADS = D / P;
    constexpr int GROUP_LANES = 32 / P;
    static_assert(THREADS % 32 == 0 || 32 % THREADS == 0, "rows and warps nest");
    static_assert(CAP % D == 0, "whole rows in the shared buffers");
    const unsigned int t = threadIdx.x;
    const unsigned int r = threadIdx.y;
    const unsigned int R = blockDim.y;
    const unsigned int lane = (r * THREADS + t) & 31;
    const unsigned int group = t / GROUP_LANES;
    const unsigned int group_lane = t % GROUP_LANES;
    const bool group_first = group_lane == 0;
    const unsigned int first_lane = lane - group_lane;
    const unsigned int group_mask =
        GROUP_LANES == 32 ? 0xFFFFFFFFu : ((1u << GROUP_LANES) - 1u) << first_lane;
    // k is [B, H, L, D] (the caller checks): constant indices, no loop over the shape.
    const unsigned long long rows =
        (unsigned long long)k_shape[0] * (unsigned long long)k_shape[1] * k_shape[2];
    const unsigned long long row_index = (unsigned long long)blockIdx.x * R + r;
    const bool active = row_index < rows;
    const unsigned long long row = active ? row_index : rows - 1;
    uint8_t* const own_record = record + row * ROW_BYTES;
    uint8_t* const k_idx = own_record + OFF_KI;
    __half* const k_scales = reinterpret_cast<__half*>(own_record + OFF_KS);
    __half* const k_zeros = reinterpret_cast<__half*>(own_record + OFF_KZ);
    uint8_t* const v_packed = own_record + OFF_VP;
    __half* const v_scales = reinterpret_cast<__half*>(own_record + OFF_VS);
    const unsigned long long base = row * D + P * t;
    __shared__ unsigned char key_codes[CAP];
    __shared__ unsigned char value_codes[CAP];
    __shared__ float lane_values[2][CAP];
    __shared__ unsigned int row_failures[CAP / D];
    __shared__ unsigned int block_rank;
    unsigned char* own_keys = key_codes + r * D;
    unsigned char* own_values = value_codes + r * D;
    // Strides of 32 P elements and more cross warps (shared memory, a barrier each); a row
    // of one warp (D <= 32 P) has none.
    constexpr bool ONE_WARP = D <= 32 * P;
    // Ordered before the atomics below by the rotation's first barrier, or a warp barrier
    // where a row is one warp.
    if (t == 0) row_failures[r] = 0;
    if (t == 0 && r == 0) block_rank = 0;
    const __half nan16 = __ushort_as_half((unsigned short)0x7E00);

    // TQ-4 keys: the group's range, scale, step and zero point, each one IEEE operation.
    float x[P];
    bool finite = true;
    #pragma unroll
    for (int e = 0; e < P; ++e) {
        x[e] = static_cast<float>(k[base + e]);
        finite = finite && isfinite(x[e]);
    }
    float top = x[0], bottom = x[0];
    #pragma unroll
    for (int e = 1; e < P; ++e) {
        top = fmaxf(top, x[e]);
        bottom = fminf(bottom, x[e]);
    }
    for (int o = GROUP_LANES / 2; o > 0; o >>= 1) {
        top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
        bottom = fminf(bottom, __shfl_xor_sync(0xffffffffu, bottom, o));
    }
    finite = (__ballot_sync(0xffffffffu, finite) & group_mask) == group_mask;
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
    const bool key_ok = finite && scale_fits && zero_fits;
    unsigned int key_code[P];
    #pragma unroll
    for (int e = 0; e < P; ++e) {
        float code =
            constant ? __fsub_rn(sign, zero) : rintf(__fsub_rn(__fdiv_rn(x[e], step), zero));
        if (is_signed) {
            code = fminf(fmaxf(code, -127.0f), 127.0f);
        } else {
            code = fminf(fmaxf(code, 0.0f), levels);
        }
        // DEFER-1: a group the format cannot hold stores codes 0, zero 0 and a NaN scale.
        key_code[e] = key_ok ? (unsigned int)(int)code : 0u;
    }
    if (active && group_first) {
        k_scales[group] = key_ok ? scale16 : nan16;
        k_zeros[group] = key_ok ? zero16 : __float2half_rn(0.0f);
    }

    // TQ-6 rotation: the signs, butterflies at strides 1 .. D/2, then f32(1/sqrt(D)).
    // Element j of a butterfly pair (j, j + h) becomes a + b, element j + h a - b. Strides
    // below P pair a thread's own elements; up to 16 P, threads of one warp (shuffles at
    // h / P lanes); wider ones pass through shared memory, a buffer per stride in turn, so
    // one barrier a stride keeps every read before the next write to its buffer.
    float value[P], rotated[P];
    #pragma unroll
    for (int e = 0; e < P; ++e) {
        value[e] = static_cast<float>(v[base + e]);
        rotated[e] = __fmul_rn(value[e], signs[P * t + e]);
    }
    #pragma unroll
    for (int h = 1; h < P; h <<= 1) {
        float own[P];
        #pragma unroll
        for (int e = 0; e < P; ++e) own[e] = rotated[e];
        #pragma unroll
        for (int e = 0; e < P; ++e) {
            const float other = own[e ^ h];
            rotated[e] = (e & h) == 0 ? __fadd_rn(own[e], other) : __fsub_rn(other, own[e]);
        }
    }
    #pragma unroll
    for (unsigned int h = P; h < 32 * P && h < D; h <<= 1) {
        const bool low = (t & (h / P)) == 0;
        #pragma unroll
        for (int e = 0; e < P; ++e) {
            const float other = __shfl_xor_sync(0xffffffffu, rotated[e], h / P);
            rotated[e] = low ? __fadd_rn(rotated[e], other) : __fsub_rn(other, rotated[e]);
        }
    }
    #pragma unroll
    for (unsigned int h = 32 * P, turn = 0; h < D; h <<= 1, turn ^= 1) {
        float* own_lanes = lane_values[turn] + r * D;
        #pragma unroll
        for (int e = 0; e < P; ++e) own_lanes[P * t + e] = rotated[e];
        __syncthreads();
        const bool low = (t & (h / P)) == 0;
        #pragma unroll
        for (int e = 0; e < P; ++e) {
            const float other = own_lanes[(P * t + e) ^ h];
            rotated[e] = low ? __fadd_rn(rotated[e], other) : __fsub_rn(other, rotated[e]);
        }
    }
    float y[P], partial[P];
    #pragma unroll
    for (int e = 0; e < P; ++e) {
        y[e] = __fmul_rn(rotated[e], __int_as_float(INV_SQRT_BITS));
        partial[e] = __fmul_rn(y[e], y[e]);
    }
    // TQ-7: the group rms by the halving tree (partial[i] + partial[i + w], w = 16 .. 1):
    // element i + w of a step w >= P is the same element of the thread w / P lanes on; the
    // steps below P add a thread's own (those of the group's first thread count).
    const unsigned int i0 = P * group_lane;
    #pragma unroll
    for (int w = 16; w >= P; w >>= 1) {
        #pragma unroll
        for (int e = 0; e < P; ++e) {
            const float other = __shfl_down_sync(0xffffffffu, partial[e], w / P);
            if (i0 + e < (unsigned int)w) partial[e] = __fadd_rn(partial[e], other);
        }
    }
    #pragma unroll
    for (int w = P / 2; w >= 1; w >>= 1) {
        #pragma unroll
        for (int e = 0; e < w; ++e) partial[e] = __fadd_rn(partial[e], partial[e + w]);
    }
    const float sum = __shfl_sync(0xffffffffu, partial[0], first_lane);
    const float rms = __fsqrt_rn(__fdiv_rn(sum, 32.0f));
    const __half rms16 = __float2half_rn(rms);
    const bool value_ok = isfinite(__half2float(rms16));
    unsigned int value_code[P];
    bool values_finite = true;
    #pragma unroll
    for (int e = 0; e < P; ++e) {
        const float u = __fdiv_rn(y[e], __fadd_rn(rms, eps));
        // The number of boundaries strictly below u, by binary search over the sorted table.
        unsigned int count = 0;
        for (unsigned int stride = 1u << (VBITS - 1); stride >= 1; stride >>= 1) {
            if (boundaries[count + stride - 1] < u) count += stride;
        }
        value_code[e] = value_ok ? count : 0u;
        values_finite = values_finite && isfinite(value[e]);
    }
    if (active && group_first) v_scales[group] = value_ok ? rms16 : nan16;

    // DEFER-2: bit i of a row's failures is TQ-3's check i; the row's rank names its
    // lowest bit, the block's rank is the largest, folded into the prior one (DEFER-3).
    unsigned int bits = 0;
    if (!finite && group_first) bits |= 1u;
    if (!values_finite) bits |= 2u;
    if (!scale_fits && group_first) bits |= 4u;
    if (!zero_fits && group_first) bits |= 8u;
    if (!value_ok && group_first) bits |= 16u;
    if constexpr (ONE_WARP) __syncwarp();
    if (active && bits != 0) atomicOr(&row_failures[r], bits);

    // TQ-9: each vector's codes as one LSB-first byte stream. A thread's P codes that fill
    // whole bytes are stored by that thread; others pass through shared memory.
    constexpr bool KEYS_WHOLE = P * KBITS % 8 == 0;
    constexpr bool VALUES_WHOLE = P * VBITS % 8 == 0;
    if constexpr (KEYS_WHOLE) {
        if (active) store_codes<P, KBITS>(k_idx, t, key_code);
    } else {
        #pragma unroll
        for (int e = 0; e < P; ++e) own_keys[P * t + e] = (unsigned char)key_code[e];
    }
    if constexpr (VALUES_WHOLE) {
        if (active) store_codes<P, VBITS>(v_packed, t, value_code);
    } else {
        #pragma unroll
        for (int e = 0; e < P; ++e) own_values[P * t + e] = (unsigned char)value_code[e];
    }
    __syncthreads();
    if (t == 0 && row_failures[r] != 0) {
        atomicMax(&block_rank, CHECKS - __ffs(row_failures[r]) + 1);
    }
    if constexpr (!KEYS_WHOLE) {
        if (active) pack_codes<KBITS, KEY_BYTES, THREADS>(k_idx, t, own_keys);
    }
    if constexpr (!VALUES_WHOLE) {
        if (active) pack_codes<VBITS, VALUE_BYTES, THREADS>(v_packed, t, own_values);
    }
    // The record's bytes outside every field: its fields leave no gap (records.py places
    // the widest alignments first), so those past the last field's end.
    constexpr int FIELDS_END = cmax(cmax(cmax(OFF_KI + KEY_BYTES, OFF_KS + GROUP_BYTES),
                                         cmax(OFF_KZ + GROUP_BYTES, OFF_VP + VALUE_BYTES)),
                                    OFF_VS + GROUP_BYTES);
    static_assert(FIELDS_END == KEY_BYTES + VALUE_BYTES + 3 * GROUP_BYTES, "no gap");
    for (unsigned int b = FIELDS_END + t; active && b < ROW_BYTES; b += THREADS) {
        own_record[b] = 0;
    }
    __syncthreads();
    if (t == 0 && r == 0) total[blockIdx.x] = max(prior[0], block_rank);
}

}  // namespace kvspec_tq
