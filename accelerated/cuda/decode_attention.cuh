// Decode attention over stored fields (spec READ-7): accelerated/attention_kernels.py
// describes the kernels. Its custom kernels include this file and call partial_pass
// and merge_pass, so that the source MLX builds and hashes at every call stays short.
#pragma once

namespace kvspec_attn {

// What both bodies use: a lane's share of a row, loaded raw and decoded in registers.

// A choice made at compile time, handed to a generic lambda (a body of two variants).
template <bool B>
struct Choice {
    static constexpr bool value = B;
};

template <typename T>
__device__ __forceinline__ float rounded(float x) {
    // x rounded to T and widened back (CONV-2): the read format's rounding.
    return static_cast<float>(static_cast<T>(x));
}

template <int NW>
__device__ __forceinline__ void load_words(const unsigned char* p, unsigned int (&w)[NW]) {
    // NW little-endian words from an address aligned to 4 * NW (NW = 1, 2, 4 or a multiple
    // of 4): vector loads into registers.
    if constexpr (NW % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < NW; i += 4) {
            const uint4 x = reinterpret_cast<const uint4*>(p)[i / 4];
            w[i] = x.x; w[i + 1] = x.y; w[i + 2] = x.z; w[i + 3] = x.w;
        }
    } else if constexpr (NW == 2) {
        const uint2 x = *reinterpret_cast<const uint2*>(p);
        w[0] = x.x; w[1] = x.y;
    } else {
        w[0] = *reinterpret_cast<const unsigned int*>(p);
    }
}

template <int BITS>
__device__ __forceinline__ unsigned int stream_code(const unsigned char* stream, int i) {
    // Code i of an LSB-first stream (BITS-1, BITS-2: words are little-endian bytes).
    const int bit = i * BITS;
    const int byte = bit >> 3;
    const int shift = bit & 7;
    unsigned int window = stream[byte];
    if (shift + BITS > 8) window |= (unsigned int)stream[byte + 1] << 8;
    return (window >> shift) & ((1u << BITS) - 1u);
}

template <typename T>
constexpr bool IS_BFLOAT16 = false;
template <>
constexpr bool IS_BFLOAT16<__nv_bfloat16> = true;

// The packed pair of a 2-byte format and the bits of M = 2^7 (bfloat16) or 2^10 (float16)
// in both halves: the power of two from which integers below M are spaced by 1.
template <typename S>
struct Paired {};
template <>
struct Paired<__nv_bfloat16> {
    using type = __nv_bfloat162;
    static constexpr unsigned int MAGIC = 0x43004300u;
};
template <>
struct Paired<__half> {
    using type = __half2;
    static constexpr unsigned int MAGIC = 0x64006400u;
};
template <typename S>
constexpr bool PAIRED = sizeof(S) == 2;

template <typename T>
__device__ __forceinline__ T bits_as(unsigned int bits) {
    T value;
    memcpy(&value, &bits, 4);
    return value;
}

// (x & MASK) | magic in one LOP3: with both constants immediate the compiler spends two
// instructions (a LOP3 holds one), so the magic comes in a register the loop keeps.
template <unsigned int MASK>
__device__ __forceinline__ unsigned int masked_or(unsigned int x, unsigned int magic) {
    unsigned int out;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(x), "n"(MASK), "r"(magic));
    return out;
}

__device__ __forceinline__ float2 widened(__nv_bfloat162 pair) {
    // bfloat16 is the top half of a float32.
    unsigned int bits;
    memcpy(&bits, &pair, 4);
    return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xFFFF0000u));
}

__device__ __forceinline__ float2 widened(__half2 pair) { return __half22float2(pair); }

// A lane's share of one row (elements [lane E, lane E + E) of position t of head (b, h))
// as loaded: its words (when the lane's bits fill whole aligned words, or half of one) and,
// for coded formats, its group's scale and bias, all still raw, so that a prefetch does not
// wait for them. FMT: 0 plain, 1 affine, 2 TurboQuant key, 3 TurboQuant value (rotated).
template <int FMT, int E, int BITS, int GROUP, typename C, typename S>
struct LaneRow {
    static constexpr int ELEMENT_BITS = FMT == 0 ? 8 * (int)sizeof(C) : BITS;
    static constexpr int LANE_BITS = E * ELEMENT_BITS;
    static constexpr int NW = LANE_BITS >= 32 ? LANE_BITS / 32 : 1;
    static constexpr bool WORDS =
        LANE_BITS % 32 == 0 && (NW == 1 || NW == 2 || NW % 4 == 0);
    static constexpr bool HALF = LANE_BITS == 16;
    // Widths whose codes never straddle a word's halves (decode_pairs).
    static constexpr bool WHOLE_PAIRS = BITS == 2 || BITS == 4 || BITS == 8;
    // Where E does not divide GROUP (affine codes at head dims 96, 160 and 192 on CUDA
    // cores: E = 3, 5, 6) a lane's elements may reach into the next group (E < GROUP: at most
    // two groups); elements from `second_group_start` on take that group's scale and bias.
    // Such lanes' bits never fill whole words, so only the element-wise decode meets them.
    static constexpr bool TWO_GROUPS = FMT != 0 && GROUP % E != 0;
    static_assert(!(TWO_GROUPS && (WORDS || HALF)), "two groups decode element by element");
    unsigned int w[NW];
    const unsigned char* row;  // read at decode time when the lane's bits are not words
    S scale;
    S bias;
    S scale2;
    S bias2;

    // The group of a lane's last element.
    static __device__ __forceinline__ int last_group(int lane) {
        return (lane * E + E - 1) / GROUP;
    }

    // The first of a lane's elements in its second group (E when it has none).
    static __device__ __forceinline__ int second_group_start(int lane) {
        const int first = lane * E;
        const int last = last_group(lane);
        return last == first / GROUP ? E : last * GROUP - first;
    }

    __device__ __forceinline__ void load(
        const C* codes, const S* scales, const S* biases,
        long long code_row, long long group_row, int lane) {
        if constexpr (FMT == 0) {
            load_row(codes + code_row, nullptr, nullptr, lane);
        } else if constexpr (FMT == 3) {
            load_row(codes + code_row, scales + group_row, nullptr, lane);
        } else {
            load_row(codes + code_row, scales + group_row, biases + group_row, lane);
        }
    }

    // Where a lane's words are whole (WORDS or HALF rows, one group a lane) a pointer can
    // carry its part: the part's byte offset in the row and its group, for load_row at lane 0.
    static constexpr bool OWN_PART = (WORDS || HALF) && !TWO_GROUPS;
    static __device__ __forceinline__ int part_bytes(int lane) {
        return OWN_PART ? lane * (WORDS ? NW * 4 : 2) : 0;
    }
    static __device__ __forceinline__ int part_group(int lane) {
        return OWN_PART && FMT != 0 ? lane * E / GROUP : 0;
    }

    // The same from pointers to the row's codes and its groups' scales and biases (those a
    // format stores; the others are not read).
    __device__ __forceinline__ void load_row(
        const C* codes, const S* scales, const S* biases, int lane) {
        row = reinterpret_cast<const unsigned char*>(codes);
        if constexpr (WORDS) {
            load_words<NW>(row + lane * NW * 4, w);
        } else if constexpr (HALF) {
            w[0] = *reinterpret_cast<const unsigned short*>(row + lane * 2);
        }
        if constexpr (FMT != 0) {
            const int g = lane * E / GROUP;
            scale = scales[g];
            if constexpr (FMT != 3) bias = biases[g];
            if constexpr (TWO_GROUPS) {
                scale2 = scales[last_group(lane)];
                if constexpr (FMT != 3) bias2 = biases[last_group(lane)];
            }
        }
    }

    __device__ __forceinline__ unsigned int element_bits(int j, int lane) const {
        if constexpr (WORDS || HALF) {
            const unsigned int word = w[j * ELEMENT_BITS / 32] >> (j * ELEMENT_BITS % 32);
            return ELEMENT_BITS == 32 ? word : word & ((1u << ELEMENT_BITS) - 1u);
        } else {
            return stream_code<BITS>(row, lane * E + j);
        }
    }

    // The reference's operands (READ-7): AFF-6, TQ-5, TQ-8 (rotated), or the plain value,
    // computed without conversion instructions (a quarter of the float32 rate): a code c
    // becomes float32 as the bits of 2^23 + c, less 2^23, exactly.
    __device__ __forceinline__ void decode(const float* table, int lane, float (&x)[E]) const {
        if constexpr (FMT == 0) {
            #pragma unroll
            for (int j = 0; j < E; ++j) {
                if constexpr (!(WORDS || HALF)) {
                    x[j] = static_cast<float>(reinterpret_cast<const C*>(row)[lane * E + j]);
                } else if constexpr (sizeof(C) == 4) {
                    x[j] = __uint_as_float(element_bits(j, lane));
                } else if constexpr (IS_BFLOAT16<C>) {
                    x[j] = __uint_as_float(element_bits(j, lane) << 16);
                } else {
                    const unsigned short bits = (unsigned short)element_bits(j, lane);
                    C value;
                    memcpy(&value, &bits, 2);
                    x[j] = static_cast<float>(value);
                }
            }
        } else if constexpr (FMT == 1 && WORDS && PAIRED<S> && WHOLE_PAIRS) {
            decode_pairs(x);
        } else if constexpr (FMT == 2 && BITS == 8 && WORDS) {
            // TQ-5 for signed 8-bit codes in whole words, as below with one instruction to
            // place a code: flipping each byte's sign bit (once a word) makes code + 128, and
            // a byte permute sets it under the float32 bits of 2^23.
            const float s = static_cast<float>(scale);
            const float offset = 8388736.0f - static_cast<float>(bias);
            #pragma unroll
            for (int j = 0; j < E; ++j) {
                const unsigned int biased =
                    __byte_perm(w[j / 4] ^ 0x80808080u, 0x4B000000u, 0x7540u + j % 4);
                x[j] = __fmul_rn(__fsub_rn(__uint_as_float(biased), offset), s);
            }
        } else {
            const int second = TWO_GROUPS ? second_group_start(lane) : E;
            #pragma unroll
            for (int j = 0; j < E; ++j) {
                const bool in_second = j >= second;
                const float s = static_cast<float>(in_second ? scale2 : scale);
                float z = 0.0f;
                if constexpr (FMT != 3) z = static_cast<float>(in_second ? bias2 : bias);
                // TQ-5's code + zero, exact: (2^23 + c) - (2^23 - zero); a signed 8-bit code
                // reads as 2^23 + 128 + c (its sign bit flipped).
                const float offset = (FMT == 2 && BITS == 8 ? 8388736.0f : 8388608.0f) - z;
                const unsigned int c = element_bits(j, lane);
                if constexpr (FMT == 1) {
                    // AFF-6: T(T(code * scale) + bias).
                    const float code = __fsub_rn(__uint_as_float(c | 0x4B000000u), 8388608.0f);
                    x[j] = rounded<S>(__fadd_rn(rounded<S>(__fmul_rn(code, s)), z));
                } else if constexpr (FMT == 2) {
                    // TQ-5: (code + zero) * scale; 8-bit codes are signed.
                    const unsigned int biased = BITS == 8 ? c ^ 0x4B000080u : c | 0x4B000000u;
                    x[j] = __fmul_rn(__fsub_rn(__uint_as_float(biased), offset), s);
                } else {
                    // TQ-8: centroid * scale, left rotated.
                    x[j] = __fmul_rn(table[c], s);
                }
            }
        }
    }

    // AFF-6 two elements at a time in S (bfloat16 or float16 scales), for codes in whole
    // words: a word's elements i and i + N/2 (N per word) sit in its two 16-bit halves after
    // a shift; OR-ing the S bits of M (a power of two whose spacing is 1) makes M + c.
    // Then T(c * scale) and T(. + bias) in S, each rounded once (each correctly rounded in
    // S, as CONV-3 shows the reference's float32 steps are). Below 8 bits T(c * scale) is
    // one FMA, T((M + c) scale - M scale), exact inside the FMA, wherever M scale is an S
    // value (|scale| < LIMIT: no overflow; an S value times a power of two); elsewhere, and
    // for 8-bit codes (each byte placed by a byte permute, exact), c then `__hmul2_rn`,
    // which the compiler may not fuse with the sum into one rounding as it fuses `__hmul2`.
    template <typename Emit>
    __device__ __forceinline__ void visit_pairs(Emit emit) const {
        using S2 = typename Paired<S>::type;
        constexpr unsigned int MAGIC = Paired<S>::MAGIC;
        constexpr float M = IS_BFLOAT16<S> ? 128.0f : 1024.0f;
        constexpr float LIMIT = IS_BFLOAT16<S> ? 0x1p120f : 32.0f;
        const S2 magic = bits_as<S2>(MAGIC);
        const unsigned int magic_bits = MAGIC;
        const S2 s2 = {scale, scale};
        const S2 b2 = {bias, bias};
        constexpr int PER_WORD = 32 / BITS;
        auto decode = [&](auto fused) {
            constexpr bool FUSED = decltype(fused)::value;
            const S2 minus_m_scale = __hmul2_rn(s2, S2{S(-M), S(-M)});
            #pragma unroll
            for (int word = 0; word < NW; ++word) {
                #pragma unroll
                for (int i = 0; i < PER_WORD / 2; ++i) {
                    S2 product;
                    if constexpr (BITS == 8) {
                        // The pair's codes, bytes i and i + 2 of the word, exact in S: a
                        // byte permute sets each under the bits of float16 1024, or of
                        // float32 2^23 (then packed, exact) for bfloat16, whose M is 128.
                        S2 code;
                        if constexpr (IS_BFLOAT16<S>) {
                            auto byte = [&](unsigned int selector) {
                                const unsigned int bits =
                                    __byte_perm(w[word], 0x4B000000u, selector);
                                return __fsub_rn(__uint_as_float(bits), 8388608.0f);
                            };
                            code = __floats2bfloat162_rn(byte(0x7650u + i), byte(0x7652u + i));
                        } else {
                            const unsigned int pair =
                                __byte_perm(w[word], 0x64646464u, 0x4240u + 0x101u * i);
                            code = __hsub2(bits_as<S2>(pair), magic);
                        }
                        product = __hmul2_rn(code, s2);
                    } else {
                        constexpr unsigned int MASK = ((1u << BITS) - 1u) * 0x00010001u;
                        const S2 m_plus_code =
                            bits_as<S2>(masked_or<MASK>(w[word] >> (BITS * i), magic_bits));
                        if constexpr (FUSED) {
                            product = __hfma2(m_plus_code, s2, minus_m_scale);
                        } else {
                            product = __hmul2_rn(__hsub2(m_plus_code, magic), s2);
                        }
                    }
                    emit(word, i, __hadd2(product, b2));
                }
            }
        };
        if (BITS < 8 && fabsf(static_cast<float>(scale)) < LIMIT) {
            decode(Choice<true>());
        } else {
            decode(Choice<false>());
        }
    }

    // READ-7's scaled weights: code c of element j as the float32 bits of 2^BITS + c, exact
    // in TF32 (c fills the significand's top BITS bits): a shift and a LOP3. One element at
    // a time, so that each MMA's operands are made as it takes them (registers).
    __device__ __forceinline__ unsigned int offset_code(int j) const {
        static_assert(FMT == 1 && WORDS && WHOLE_PAIRS, "affine codes in whole words");
        constexpr int TOP = 23 - BITS;
        constexpr unsigned int MASK = ((1u << BITS) - 1u) << TOP;
        const unsigned int exponent = (127u + BITS) << 23;
        const unsigned int word = w[j * BITS / 32];
        const int at = j * BITS % 32;
        return masked_or<MASK>(at <= TOP ? word << (TOP - at) : word >> (at - TOP), exponent);
    }

    __device__ __forceinline__ void decode_pairs(float (&x)[E]) const {
        constexpr int PER_WORD = 32 / BITS;
        visit_pairs([&](int word, int i, auto value) {
            const float2 wide = widened(value);
            x[word * PER_WORD + i] = wide.x;
            x[word * PER_WORD + i + PER_WORD / 2] = wide.y;
        });
    }

    // Rows whose decoded elements are 16-bit values (PAIRS16: plain bfloat16 or float16
    // words, affine codes in whole pairs with 16-bit scales) also decode to those values
    // two to a word, as a 16-bit MMA takes them. Pair p holds elements pair_element(p) and
    // pair_element(p) + PER_PAIR_WORD / 2, the lower in the low half.
    static constexpr bool PAIRS16 =
        WORDS && (FMT == 0 ? PAIRED<C> : FMT == 1 && PAIRED<S> && WHOLE_PAIRS);
    static constexpr int PER_PAIR_WORD = FMT == 0 ? 2 : 32 / (BITS > 0 ? BITS : 1);
    static constexpr int pair_element(int p) {
        return p / (PER_PAIR_WORD / 2) * PER_PAIR_WORD + p % (PER_PAIR_WORD / 2);
    }

    // A template, so that rows of one element a lane (head dim 32 on CUDA cores, which
    // never call it) declare no array of size zero.
    template <int PAIRS>
    __device__ __forceinline__ void decode_pairs16(unsigned int (&pairs)[PAIRS]) const {
        static_assert(PAIRS == E / 2, "one word per pair of the lane's elements");
        if constexpr (FMT == 0) {
            #pragma unroll
            for (int p = 0; p < E / 2; ++p) pairs[p] = w[p];
        } else {
            visit_pairs([&](int word, int i, auto value) {
                unsigned int bits;
                memcpy(&bits, &value, 4);
                pairs[word * (PER_PAIR_WORD / 2) + i] = bits;
            });
        }
    }
};

// What only the CUDA-core body uses: the warp reductions and the stage update.

template <int G>
__device__ __forceinline__ void warp_sums(float (&dot)[G], int lane) {
    // Every lane gets the warp-wide sum of each of its G partial dot products. Halving
    // exchange: at offset 16 a lane keeps half the heads and sends the other half, so
    // log2(G) rounds cut the values per lane to one; plain rounds finish the sum; each
    // head's total is then read from a lane that holds it. 5 + G shuffles, not 5 G.
    float v[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) v[g] = dot[g];
    int offset = 16;
    #pragma unroll
    for (int level = 0; (1 << level) < G; ++level) {
        const int half = G >> (level + 1);
        const bool upper = (lane & offset) != 0;
        #pragma unroll
        for (int i = 0; i < half; ++i) {
            const float keep = upper ? v[i + half] : v[i];
            const float send = upper ? v[i] : v[i + half];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
        offset >>= 1;
    }
    #pragma unroll
    for (int o = offset; o > 0; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
    // The lane whose bits 4, 3, ... (one per halving level) spell head g holds its sum.
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        int source = 0;
        #pragma unroll
        for (int level = 0; (1 << level) < G; ++level) {
            const int bit = (g >> (__ffs(G) - 2 - level)) & 1;
            source |= bit << (4 - level);
        }
        dot[g] = __shfl_sync(0xffffffffu, v[0], source);
    }
}

// U positions at once: their dot products reduce together (independent shuffle chains),
// then one online-softmax update, m' = max(m, s_0 .. s_{U-1}),
// acc' = acc 2^(m - m') + sum_u 2^(s_u - m') v_u, and likewise the running sum l.
template <int U, int G, int EK, int EV, typename KeyRow, typename ValueRow>
__device__ __forceinline__ void attend_stage(
    const KeyRow (&keys)[U], const ValueRow (&values)[U], const float* codebook, int lane,
    const float (&q)[G][EK], float (&m)[G], float (&l)[G], float (&acc)[G][EV]) {
    float dot[U][G];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        float k[EK];
        keys[u].decode(codebook, lane, k);
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            dot[u][g] = 0.0f;
            #pragma unroll
            for (int j = 0; j < EK; ++j) dot[u][g] += q[g][j] * k[j];
        }
        warp_sums<G>(dot[u], lane);
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        float m_new = m[g];
        #pragma unroll
        for (int u = 0; u < U; ++u) m_new = fmaxf(m_new, dot[u][g]);
        const float alpha = exp2f(m[g] - m_new);
        float sum = l[g] * alpha;
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            dot[u][g] = exp2f(dot[u][g] - m_new);  // now the weight p_u
            sum += dot[u][g];
        }
        l[g] = sum;
        m[g] = m_new;
        #pragma unroll
        for (int j = 0; j < EV; ++j) acc[g][j] *= alpha;
    }
    #pragma unroll
    for (int u = 0; u < U; ++u) {
        float v[EV];
        values[u].decode(codebook, lane, v);
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            #pragma unroll
            for (int j = 0; j < EV; ++j) acc[g][j] += dot[u][g] * v[j];
        }
    }
}

// What only the tensor-core body uses: TF32 rounding and the MMAs.

__device__ __forceinline__ unsigned int tf32(float x) {
    // x rounded to the nearest TF32 (ties away), for the operands computed once per block
    // or per 8 positions (the query, the weights). Stored operands go in as float32 bits:
    // the tensor cores read their top 19 bits, a truncation (READ-7).
    unsigned int bits;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bits) : "f"(x));
    return bits;
}

__device__ __forceinline__ void mma_tf32(
    float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
    unsigned int b0, unsigned int b1) {
    // d += A B on tensor cores: A 16 x 8 (row major), B 8 x 8 (column major), float32
    // accumulation. Lane (r, c) = (lane / 4, lane % 4) holds A[r][c], A[r + 8][c],
    // A[r][c + 4], A[r + 8][c + 4]; B[c][r], B[c + 4][r]; D[r][2c], D[r][2c + 1],
    // D[r + 8][2c], D[r + 8][2c + 1] (PTX ISA, mma.m16n8k8 .tf32).
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

template <typename H>
__device__ __forceinline__ void mma_16bit(
    float (&d)[4], unsigned int a0, unsigned int a1, unsigned int a2, unsigned int a3,
    unsigned int b0, unsigned int b1) {
    // d += A B on tensor cores, A 16 x 16 and B 16 x 8 of 16-bit values H (bfloat16 or
    // float16, two to a register, the lower k in the low half), float32 accumulation of
    // exact products. Lane (r, c) holds A[r][2c, 2c + 1], A[r + 8][2c, 2c + 1],
    // A[r][2c + 8, 2c + 9], A[r + 8][2c + 8, 2c + 9]; B[2c, 2c + 1][r], B[2c + 8, 2c + 9][r];
    // D as mma_tf32 (PTX ISA, mma.m16n8k16 .bf16 / .f16).
    if constexpr (IS_BFLOAT16<H>) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
            "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
}

// TurboQuant's 8-bit keys on 16-bit MMAs (READ-7's group scores): lane col's share of a row
// is 8 codes of each 32-element group g (elements 32 g + 8 col .. 32 g + 8 col + 7), so that
// each k-step of 16 lies in one group, whose scale and zero then apply to its partial score.
// Loaded raw; `decode_pairs16` makes them float16 1152 + code (exact), two to a word as
// mma_16bit takes them. The interface is LaneRow's where the loop calls it.
template <int DK>
struct GroupedKeyRow {
    static constexpr int GROUPS = DK / 32;
    static constexpr bool OWN_PART = true;
    static constexpr bool PAIRS16 = false;
    unsigned int w[2 * GROUPS];

    static __device__ __forceinline__ int part_bytes(int lane) { return lane * 8; }
    static __device__ __forceinline__ int part_group(int) { return 0; }

    template <typename C, typename S>
    __device__ __forceinline__ void load(
        const C* codes, const S*, const S*, long long code_row, long long, int lane) {
        load_row(codes + code_row, static_cast<const S*>(nullptr), static_cast<const S*>(nullptr),
                 lane);
    }

    template <typename C, typename S>
    __device__ __forceinline__ void load_row(const C* codes, const S*, const S*, int lane) {
        const unsigned char* part = reinterpret_cast<const unsigned char*>(codes) + lane * 8;
        #pragma unroll
        for (int g = 0; g < GROUPS; ++g) {
            const uint2 x = *reinterpret_cast<const uint2*>(part + 32 * g);
            w[2 * g] = x.x;
            w[2 * g + 1] = x.y;
        }
    }

    // k-step 2 g + h: b0 = (elements 4 h, 4 h + 1 of the lane's 8 in group g), b1 = (4 h + 2,
    // 4 h + 3), lower element in the low half: flipping a code's sign bit makes code + 128,
    // which a byte permute sets under the float16 bits of 1024.
    __device__ __forceinline__ void decode_pairs16(unsigned int (&k)[4 * GROUPS]) const {
        #pragma unroll
        for (int i = 0; i < 2 * GROUPS; ++i) {
            const unsigned int biased = w[i] ^ 0x80808080u;
            k[2 * i] = __byte_perm(biased, 0x64646464u, 0x4140u);
            k[2 * i + 1] = __byte_perm(biased, 0x64646464u, 0x4342u);
        }
    }
};

// The float16 scales and zeros of a TurboQuant key row's GROUPS groups, raw, as the lane
// that holds the row's scores loads them (GroupedKeyRow).
template <int GROUPS>
struct KeyGroups {
    static constexpr int NW = GROUPS / 2;
    unsigned int scales[NW];
    unsigned int zeros[NW];

    template <typename S>
    __device__ __forceinline__ void load(const S* row_scales, const S* row_zeros) {
        load_words<NW>(reinterpret_cast<const unsigned char*>(row_scales), scales);
        load_words<NW>(reinterpret_cast<const unsigned char*>(row_zeros), zeros);
    }

    __device__ __forceinline__ void clear() {
        #pragma unroll
        for (int i = 0; i < NW; ++i) scales[i] = zeros[i] = 0u;
    }

    static __device__ __forceinline__ float half_of(const unsigned int (&words)[NW], int g) {
        const __half2 pair = bits_as<__half2>(words[g / 2]);
        return __half2float(g % 2 == 0 ? __low2half(pair) : __high2half(pair));
    }
    __device__ __forceinline__ float scale(int g) const { return half_of(scales, g); }
    __device__ __forceinline__ float zero(int g) const { return half_of(zeros, g); }
};

// The 16-bit type a side's rows decode to: its codes' for plain rows, its scales' for
// affine rows (void for the others).
template <int FMT, typename C, typename S>
struct Paired16 {
    using type = void;
};
template <typename C, typename S>
struct Paired16<0, C, S> {
    using type = C;
};
template <typename C, typename S>
struct Paired16<1, C, S> {
    using type = S;
};

// A if B, else C (std::conditional_t, which NVRTC's headers may not give).
template <bool B, typename A, typename C>
struct Pick {
    using type = A;
};
template <typename A, typename C>
struct Pick<false, A, C> {
    using type = C;
};

template <typename A, typename B>
constexpr bool SAME_TYPE = false;
template <typename A>
constexpr bool SAME_TYPE<A, A> = true;

// The order of a batch row's live rows where it is not the buffer's (ORDERED): `order`
// holds keep, then each batch row's left padding; `turn` and `oldest` (int32 [1] each) the
// ring's turn and its oldest position in the buffer. The buffer's `rows` rows hold
// positions oldest .. oldest + rows - 1, of which batch row b reads those from its padding
// on, the last rows - hidden (hidden = min(rows, max(0, padding - oldest)), ROWS-6), oldest
// first: temporal row u (0 the oldest in the buffer) lies at buffer row u below keep and at
// keep + (u - keep + turn) mod (rows - keep) from there on (a ring that wrapped: its oldest
// row past the kept ones is buffer row keep + turn, READ-7). The pass reads live row t,
// temporal row hidden + t, at row(t) from buffer row hidden.
struct RowOrder {
    int keep = 0;
    int turn = 0;
    int rows = 0;
    int hidden = 0;

    static __device__ __forceinline__ RowOrder of(const int* order, const int* turn,
                                                  const int* oldest, int b, int rows) {
        const int hidden = min(rows, max(0, order[1 + b] - oldest[0]));
        return RowOrder{order[0], turn[0], rows, hidden};
    }
    // The compiled step's ring (SLOT): no padding (COMPILE-2), and the write row holds the
    // newest position, so the oldest past the kept rows is the row after it (0 where the
    // ring has not wrapped: the write row is then its last live row).
    static __device__ __forceinline__ RowOrder after_write(const int* order, int written,
                                                           int rows) {
        const int keep = order[0];
        const int span = rows - keep;
        return RowOrder{keep, span > 0 ? (written + 1 - keep) % span : 0, rows, 0};
    }
    // Live row t's buffer row less hidden + t.
    __device__ __forceinline__ int shift(int t) const {
        const int u = hidden + t;
        if (u < keep) return 0;
        return u + turn < rows ? turn : turn - (rows - keep);
    }
    __device__ __forceinline__ int row(int t) const { return t + shift(t); }
    // The end of the run of live rows from t on that share t's shift.
    __device__ __forceinline__ int run_end(int t) const {
        constexpr int NO_END = 0x7fffffff;
        const int u = hidden + t;
        if (turn == 0) return NO_END;
        if (u < keep) return keep - hidden;
        return u + turn < rows ? rows - turn - hidden : NO_END;
    }
};

// Pass 1 (READ-7) of one block: split blockIdx.x of KV head blockIdx.y. Inputs: q
// [B, Hq, 1, DK]; per side codes, scales, biases (a null pointer where a format has none:
// never read); the value codebook (TABLE entries; none when TABLE is 0); COUNTED: the live
// row count rows[0]; SLOT: the write slot's row slot_row[0] and the new position's fields;
// ORDERED: the order of each batch row's live rows, `order`, `turn` and `oldest` (RowOrder:
// ROWS-6's padding, a ring's turn; with SLOT `order` alone, RowOrder::after_write).
// Output: one row a split of each query head, [B * Hq, SPLITS, DV + 2]: the DV partial
// sums, then the split's maximum and sum (one array, so that the merge takes one input).
// The softmax scale is a template constant (its float32 bits): one compile per model, no
// per-step upload. Two bodies share the block's setup and its final merge of the warps: on
// tensor cores (MMA: MMA over 8 positions at a time) and on CUDA cores (lanes over elements).
template <bool MMA, bool COUNTED, bool SLOT, bool ORDERED, typename QT, typename KC,
          typename VC, typename KS, typename VS, int DK, int DV, int G, int WARPS, int STAGE,
          int KFMT, int KBITS, int KGROUP, int VFMT, int VBITS, int VGROUP, int TABLE,
          int SCALE_BITS, bool SCALED, int MIN_SPLIT, int MOST_SPLITS, typename Shape,
          typename Strides>
__device__ __forceinline__ void partial_pass(
    const QT* queries, const Shape& queries_shape, const Strides& queries_strides,
    const KC* k_codes, const Shape& k_codes_shape, const Strides& k_codes_strides,
    const KS* k_scales, const Strides& k_scales_strides, const KS* k_biases,
    const VC* v_codes, const Strides& v_codes_strides,
    const VS* v_scales, const Strides& v_scales_strides, const VS* v_biases,
    const float* table, const int* rows, const int* slot_row, const int* order,
    const int* turn, const int* oldest,
    const KC* new_k_codes, const Strides& new_k_codes_strides,
    const KS* new_k_scales, const Strides& new_k_scales_strides, const KS* new_k_biases,
    const VC* new_v_codes, const Strides& new_v_codes_strides,
    const VS* new_v_scales, const Strides& new_v_scales_strides, const VS* new_v_biases,
    float* partial) {
    // Each body's share of a row per lane.
    constexpr int EK = MMA ? DK / 4 : DK / 32;
    constexpr int EV = MMA ? DV / 8 : DV / 32;
    constexpr float LOG2E = 1.4426950408889634f;
    const float NEG_INF = -__int_as_float(0x7f800000);
    extern __shared__ __align__(16) float shared[];
    __shared__ float codebook[TABLE > 0 ? TABLE : 1];  // TABLE 0: no codebook given

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int split = blockIdx.x;
    const int splits = gridDim.x;
    const int bh = blockIdx.y;
    const int kv_heads = k_codes_shape[1];
    const int b = bh / kv_heads;
    const int h = bh % kv_heads;
    // The counted variant (eager reads, the compiled step: COMPILE-4) reads the live row
    // count from `rows`.
    // ORDERED: row b's live rows in their order (RowOrder): past its padding (ROWS-6), oldest
    // first in a ring (READ-7), as the row's own cache holding its positions alone reads them.
    // The compiled step's slot variant (COMPILE-4): buffer row slot_row[0] comes from the new
    // position's fields. Read before the barrier below, with the count: issued after it, its
    // load's latency stalled the prologue where the count is first used.
    const int slot = SLOT ? slot_row[0] : -1;
    const int stored_rows = COUNTED ? min(k_codes_shape[2], rows[0]) : k_codes_shape[2];
    const RowOrder ordering = !ORDERED ? RowOrder{}
        : SLOT ? RowOrder::after_write(order, slot, stored_rows)
               : RowOrder::of(order, turn, oldest, b, stored_rows);
    const int first = ordering.hidden;
    const int T = max(0, stored_rows - first);
    // The live row read from the new position's fields: the write row, which an ordered read
    // reads last.
    const int written = !SLOT ? -1 : ORDERED ? T - 1 : slot;
    const int q_heads = queries_shape[1];

    for (int i = threadIdx.x; i < TABLE; i += blockDim.x) codebook[i] = table[i];
    __syncthreads();

    const float factor = __int_as_float(SCALE_BITS) * LOG2E;
    // The live rows' splits (READ-7): as many as T alone asks for, so that the read does not
    // follow the buffer's capacity (the launch has room for its whole length's splits,
    // never fewer than T's) nor the batch; the blocks past them read nothing.
    const int live_splits =
        min(splits, min(MOST_SPLITS, max(1, (T + MIN_SPLIT - 1) / MIN_SPLIT)));
    const int per_split = (T + live_splits - 1) / live_splits;
    const int start = split * per_split;
    const int end = min(T, start + per_split);

    // Rows of head (b, h); the scales strides of format PLAIN (which has none) are not read.
    const long long k_base =
        b * k_codes_strides[0] + h * k_codes_strides[1] + (long long)first * k_codes_strides[2];
    const long long ks_base = KFMT == 0 ? 0
        : b * k_scales_strides[0] + h * k_scales_strides[1] +
              (long long)first * k_scales_strides[2];
    const long long v_base =
        b * v_codes_strides[0] + h * v_codes_strides[1] + (long long)first * v_codes_strides[2];
    const long long vs_base = VFMT == 0 ? 0
        : b * v_scales_strides[0] + h * v_scales_strides[1] +
              (long long)first * v_scales_strides[2];

    // TurboQuant's 8-bit keys score group by group on 16-bit MMAs (GroupedKeyRow): each
    // group's partial score of 1152 + code against the query scaled by a power of two per
    // head, then its zero and scale (READ-7's group scores).
    constexpr bool GROUP_SCORES = MMA && KFMT == 2 && KBITS == 8 && KGROUP == 32;
    constexpr int KEY_GROUPS = GROUP_SCORES ? DK / 32 : 2;
    using KeyRow = typename Pick<GROUP_SCORES, GroupedKeyRow<DK>,
                                 LaneRow<KFMT, EK, KBITS, KGROUP, KC, KS>>::type;
    using ValueRow = LaneRow<VFMT, EV, VBITS, VGROUP, VC, VS>;
    using RowGroups = KeyGroups<KEY_GROUPS>;
    // Per query head: the sums of each group's scaled query elements as float16 rounds them,
    // and the factor that takes its scores back (the softmax scale over the head's power).
    __shared__ float query_sums[GROUP_SCORES ? G * KEY_GROUPS : 1];
    __shared__ float query_factors[GROUP_SCORES ? G : 1];

    // The warps' results for the block merge: [WARPS][G][DV] sums, [WARPS][G] maxima and sums.
    float* sums = shared;
    float* maxima = shared + WARPS * G * DV;
    float* totals = maxima + WARPS * G;

    // Live row t's share of a lane (elements [part E, part E + E)), raw, from buffer row at;
    // in the slot variant live row `written` comes from the new position's fields (new_*
    // [B, Hk, 1, *]) instead, so the buffers need no copy.
    auto load_key = [&](KeyRow& key, int t, int at, int part) {
        if (SLOT && t == written) {
            key.load(new_k_codes, new_k_scales, new_k_biases,
                     b * new_k_codes_strides[0] + h * new_k_codes_strides[1],
                     KFMT == 0 ? 0 : b * new_k_scales_strides[0] + h * new_k_scales_strides[1],
                     part);
        } else {
            key.load(k_codes, k_scales, k_biases, k_base + (long long)at * k_codes_strides[2],
                     KFMT == 0 ? 0 : ks_base + (long long)at * k_scales_strides[2], part);
        }
    };
    auto load_value = [&](ValueRow& value, int t, int at, int part) {
        if (SLOT && t == written) {
            value.load(new_v_codes, new_v_scales, new_v_biases,
                       b * new_v_codes_strides[0] + h * new_v_codes_strides[1],
                       VFMT == 0 ? 0 : b * new_v_scales_strides[0] + h * new_v_scales_strides[1],
                       part);
        } else {
            value.load(v_codes, v_scales, v_biases, v_base + (long long)at * v_codes_strides[2],
                       VFMT == 0 ? 0 : vs_base + (long long)at * v_scales_strides[2], part);
        }
    };

    if constexpr (MMA) {
        // Lane (row, col) of the MMA fragments (mma_tf32). Scores S = Q K^T take 8 positions
        // at a time: A holds query head h G + row (rows from G on are zero), B the keys;
        // lane (row, col) decodes position t0 + row at elements [col EK, col EK + EK), and
        // step j's k-indices col and col + 4 are elements col EK + 2j and col EK + 2j + 1.
        // The output O^T += V^T P^T: A holds values (lane (row, col): positions t0 + 2 col and
        // t0 + 2 col + 1, elements [row EV, row EV + EV); tile i's rows row and row + 8 are
        // elements row EV + 2i and row EV + 2i + 1), B the weights as S left them in the lane.
        // Keys that decode to 16-bit values of the queries' own format score on 16-bit MMAs
        // (SCORES16, mma_16bit): step j takes the lane's pairs 2j and 2j + 1 of its elements
        // (pair_element), the query as given, exact products; the softmax scale multiplies
        // each float32 score after. Other keys score in TF32 as above.
        constexpr bool SCORES16 =
            KeyRow::PAIRS16 && SAME_TYPE<QT, typename Paired16<KFMT, KC, KS>::type>;
        const int row = lane >> 2;
        const int col = lane & 3;
        // Scaled weights (READ-7, SCALED: attention_kernels.scaled_weights): affine values
        // enter as their codes, 2^VBITS + code, and B as each weight times its row's group
        // scale, so that column n of the value MMA is query head n % HEAD_SPAN of value group
        // n / HEAD_SPAN, the group of the lanes of rows [n / HEAD_SPAN * HEAD_SPAN, + HEAD_SPAN)
        // (their EV elements lie in one group). Row `row` of the query (A of the scores) is
        // then head `row % HEAD_SPAN`, so the lane's weights are those its column wants; the
        // biases times the weights are summed apart (bias_sum), less 2^VBITS times B.
        constexpr bool SCALED_VALUES = SCALED && VFMT == 1;
        constexpr int HEAD_SPAN = SCALED_VALUES ? VGROUP / EV : 8;
        static_assert(!SCALED_VALUES || (HEAD_SPAN >= G && HEAD_SPAN <= 8), "a column a head");
        const int head_row = row % HEAD_SPAN;
        constexpr int KSTEPS = SCORES16 || GROUP_SCORES ? DK / 16 : DK / 8;
        constexpr int MTILES = DV / 16;

        // The query fragment, the same for every warp of the block, in shared memory past the
        // warps' merge (registers go to the decode): step j's A operand (A[row][col], 0,
        // A[row][col + 4], 0) at [j][lane], one 16-byte load straight into the MMA's registers
        // (for SCORES16 each of the two a pair of 16-bit values, mma_16bit's a0 and a2).
        constexpr int MERGED = (WARPS * G * DV + 2 * WARPS * G + 3) / 4 * 4;
        uint4 (*query_fragment)[32] = reinterpret_cast<uint4 (*)[32]>(shared + MERGED);
        if (warp == 0 && GROUP_SCORES) {
            // Lane (row, col) holds elements 32 g + 8 col + i of head `row`; the head's
            // largest magnitude m 2^e (m in [1/2, 1)) sets its power 2^(15 - e), at most 2^126
            // (a float32), so that every scaled element lies within float16's range, exact
            // where it is a bfloat16 or float16 value in float16's normal range; a head of
            // zeros, NaN or infinity keeps power 1.
            const long long q_row = (long long)b * queries_strides[0] +
                (long long)(h * G + (head_row < G ? head_row : 0)) * queries_strides[1];
            float x[KEY_GROUPS][8];
            float top = 0.0f;
            #pragma unroll
            for (int g = 0; g < KEY_GROUPS; ++g) {
                #pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const long long at = q_row + (32 * g + 8 * col + i) * queries_strides[3];
                    x[g][i] = head_row < G ? static_cast<float>(queries[at]) : 0.0f;
                    top = fmaxf(top, fabsf(x[g][i]));
                }
            }
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
            int exponent = 0;
            frexpf(top, &exponent);
            const float power =
                top > 0.0f && isfinite(top) ? ldexpf(1.0f, min(15 - exponent, 126)) : 1.0f;
            #pragma unroll
            for (int g = 0; g < KEY_GROUPS; ++g) {
                float sum = 0.0f;
                unsigned int a[4];
                #pragma unroll
                for (int p = 0; p < 4; ++p) {
                    const __half2 pair = __floats2half2_rn(x[g][2 * p] * power,
                                                           x[g][2 * p + 1] * power);
                    const float2 wide = __half22float2(pair);
                    sum += wide.x + wide.y;
                    memcpy(&a[p], &pair, 4);
                }
                // k-step 2 g + h takes the lane's pairs 2 h and 2 h + 1 (GroupedKeyRow::pairs).
                query_fragment[2 * g][lane] = make_uint4(a[0], 0u, a[1], 0u);
                query_fragment[2 * g + 1][lane] = make_uint4(a[2], 0u, a[3], 0u);
                sum += __shfl_xor_sync(0xffffffffu, sum, 1);
                sum += __shfl_xor_sync(0xffffffffu, sum, 2);
                if (col == 0 && row < G) query_sums[row * KEY_GROUPS + g] = sum;
            }
            if (col == 0 && row < G) query_factors[row] = factor / power;
        } else if (warp == 0) {
            const long long q_row = (long long)b * queries_strides[0] +
                (long long)(h * G + (head_row < G ? head_row : 0)) * queries_strides[1];
            #pragma unroll
            for (int j = 0; j < KSTEPS; ++j) {
                unsigned int a[2];
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    if constexpr (SCORES16) {
                        // Pair 2j + i: the query's elements where the keys' pair lies.
                        const int e = col * EK + KeyRow::pair_element(2 * j + i);
                        const int e_hi = e + KeyRow::PER_PAIR_WORD / 2;
                        unsigned short lo = 0, hi = 0;
                        if (head_row < G) {
                            memcpy(&lo, &queries[q_row + e * queries_strides[3]], 2);
                            memcpy(&hi, &queries[q_row + e_hi * queries_strides[3]], 2);
                        }
                        a[i] = (unsigned int)lo | ((unsigned int)hi << 16);
                    } else {
                        const long long at = q_row + (col * EK + 2 * j + i) * queries_strides[3];
                        a[i] = head_row < G ? tf32(static_cast<float>(queries[at]) * factor)
                                            : 0u;
                    }
                }
                query_fragment[j][lane] = make_uint4(a[0], 0u, a[1], 0u);
            }
        }
        __syncthreads();
        // Group scores: head `row`'s group sums and factor, for the scores this lane holds.
        float group_sums[KEY_GROUPS];
        float head_factor = 0.0f;
        if constexpr (GROUP_SCORES) {
            #pragma unroll
            for (int g = 0; g < KEY_GROUPS; ++g) {
                group_sums[g] = head_row < G ? query_sums[head_row * KEY_GROUPS + g] : 0.0f;
            }
            head_factor = head_row < G ? query_factors[head_row] : 0.0f;
        }
        // Head `head_row`'s running maximum and this lane's share of its sum (and of its
        // group's bias sum); O^T in the C layout (acc[i]: elements row EV + 2i, + 1 of
        // columns 2 col, 2 col + 1).
        float m = NEG_INF;
        float l = 0.0f;
        float bias_sum = 0.0f;
        float acc[MTILES][4];
        #pragma unroll
        for (int i = 0; i < MTILES; ++i) {
            #pragma unroll
            for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
        }

        // Warp w takes chunks w, w + WARPS, ... of 8 positions; a chunk's raw rows load while
        // the one before it computes. Only a split's last chunk can be partial: it has a body
        // of its own (WHOLE false) that decodes rows past the end as zeros, after the loop, so
        // that whole chunks spend no instruction on that test.
        const int whole_chunks = end > start ? (end - start) / 8 : 0;
        const int chunks = end > start ? (end - start + 7) / 8 : 0;
        // The lane's rows of the next chunk it loads (chunk c: key row start + 8 c + row, value
        // rows start + 8 c + 2 col and the one after), as pointers that each load moves on by
        // the warp's stride of chunks: an add a field instead of a row's address computed anew.
        const long long chunk_rows = 8LL * WARPS;
        // ORDERED: the pointers carry the shift of a run of rows (RowOrder), the run of the
        // warp's next chunk; a chunk that leaves it loads row by row, and the pointers then
        // take the run of the chunk after it.
        int carried = ORDERED ? ordering.shift(start + 8 * warp) : 0;
        int run_end = ORDERED ? ordering.run_end(start + 8 * warp) : 0;
        const int first_key = start + 8 * warp + row + carried;
        const int first_value = start + 8 * warp + 2 * col + carried;
        // Where a lane's part is whole (OWN_PART) the pointers carry it, and load_row reads
        // them as lane 0's.
        const int key_part = KeyRow::OWN_PART ? 0 : col;
        const int value_part = ValueRow::OWN_PART ? 0 : row;
        const KC* key_codes = reinterpret_cast<const KC*>(
            reinterpret_cast<const unsigned char*>(
                k_codes + k_base + first_key * k_codes_strides[2]) +
            KeyRow::part_bytes(col));
        const int key_group = KeyRow::part_group(col);
        const KS* key_scales =
            KFMT == 0 ? nullptr : k_scales + ks_base + first_key * k_scales_strides[2] + key_group;
        const KS* key_biases =
            KFMT == 0 ? nullptr : k_biases + ks_base + first_key * k_scales_strides[2] + key_group;
        const VC* value_codes = reinterpret_cast<const VC*>(
            reinterpret_cast<const unsigned char*>(
                v_codes + v_base + first_value * v_codes_strides[2]) +
            ValueRow::part_bytes(row));
        const int value_group = ValueRow::part_group(row);
        const VS* value_scales = VFMT == 0
            ? nullptr : v_scales + vs_base + first_value * v_scales_strides[2] + value_group;
        const VS* value_biases = VFMT == 0 || VFMT == 3
            ? nullptr : v_biases + vs_base + first_value * v_scales_strides[2] + value_group;
        // Group scores: the key scales and zeros of the positions whose scores the lane holds
        // (its value rows' positions).
        const KS* score_scales =
            GROUP_SCORES ? k_scales + ks_base + first_value * k_scales_strides[2] : nullptr;
        const KS* score_zeros =
            GROUP_SCORES ? k_biases + ks_base + first_value * k_scales_strides[2] : nullptr;
        // The compiled step's slot variant: the write row lies in at most one chunk of the
        // split (`slot_chunk`), which alone tests its rows against it; every other chunk
        // loads as the other variants do, for one warp-wide test a chunk.
        const int slot_chunk =
            SLOT && written >= start && written < end ? (written - start) / 8 : -1;
        // The lane's pointers moved on by `moved` rows.
        auto move_pointers = [&](long long moved) {
            if constexpr (GROUP_SCORES) {
                score_scales += moved * k_scales_strides[2];
                score_zeros += moved * k_scales_strides[2];
            }
            key_codes += moved * k_codes_strides[2];
            if constexpr (KFMT != 0) {
                key_scales += moved * k_scales_strides[2];
                key_biases += moved * k_scales_strides[2];
            }
            value_codes += moved * v_codes_strides[2];
            if constexpr (VFMT != 0) value_scales += moved * v_scales_strides[2];
            if constexpr (VFMT == 1 || VFMT == 2) value_biases += moved * v_scales_strides[2];
        };
        // The lane's rows of a chunk (key row tk, value rows tv and tv + 1) from the pointers,
        // each moved on by its own rows (ORDERED, where the chunk leaves the pointers' run;
        // else none). A whole chunk (WHOLE_ROWS) loads every row without testing it against
        // the end.
        auto load_moved = [&](auto slot_rows, auto whole_rows, int tk, int tv, int key_moved,
                              const int (&value_moved)[2], KeyRow& key, ValueRow& v0,
                              ValueRow& v1, RowGroups& g0, RowGroups& g1) {
            constexpr bool SLOT_ROWS = decltype(slot_rows)::value;
            constexpr bool WHOLE_ROWS = decltype(whole_rows)::value;
            if (WHOLE_ROWS || tk < end) {
                if (SLOT_ROWS && tk == written) {
                    load_key(key, tk, tk, col);
                } else {
                    const long long moved = key_moved;
                    key.load_row(key_codes + moved * k_codes_strides[2],
                                 KFMT == 0 ? nullptr : key_scales + moved * k_scales_strides[2],
                                 KFMT == 0 ? nullptr : key_biases + moved * k_scales_strides[2],
                                 key_part);
                }
            }
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                ValueRow& value = i == 0 ? v0 : v1;
                const long long moved = i + value_moved[i];
                if (WHOLE_ROWS || tv + i < end) {
                    if (SLOT_ROWS && tv + i == written) {
                        load_value(value, tv + i, tv + i, row);
                    } else {
                        value.load_row(
                            value_codes + moved * v_codes_strides[2],
                            VFMT == 0 ? nullptr : value_scales + moved * v_scales_strides[2],
                            VFMT == 0 || VFMT == 3 ? nullptr
                                                   : value_biases + moved * v_scales_strides[2],
                            value_part);
                    }
                }
                if constexpr (GROUP_SCORES) {
                    RowGroups& groups = i == 0 ? g0 : g1;
                    if (WHOLE_ROWS || tv + i < end) {
                        if (SLOT_ROWS && tv + i == written) {
                            const long long at =
                                b * new_k_scales_strides[0] + h * new_k_scales_strides[1];
                            groups.load(new_k_scales + at, new_k_biases + at);
                        } else {
                            groups.load(score_scales + moved * k_scales_strides[2],
                                        score_zeros + moved * k_scales_strides[2]);
                        }
                    } else {
                        groups.clear();
                    }
                }
            }
        };
        auto load_rows = [&](auto slot_rows, auto whole_rows, int c, KeyRow& key, ValueRow& v0,
                             ValueRow& v1, RowGroups& g0, RowGroups& g1) {
            const int tk = start + 8 * c + row;
            const int tv = start + 8 * c + 2 * col;
            if constexpr (ORDERED) {
                const int t0 = start + 8 * c;
                if (t0 + 8 > run_end) {  // the same for the whole warp
                    const int value_moved[2] = {ordering.shift(tv) - carried,
                                                ordering.shift(tv + 1) - carried};
                    load_moved(slot_rows, whole_rows, tk, tv, ordering.shift(tk) - carried,
                               value_moved, key, v0, v1, g0, g1);
                    // The pointers take the run of the warp's next chunk.
                    const int next = t0 + (int)chunk_rows;
                    const int shift = ordering.shift(next);
                    move_pointers(chunk_rows + shift - carried);
                    carried = shift;
                    run_end = ordering.run_end(next);
                    return;
                }
            }
            constexpr int NOT_MOVED[2] = {0, 0};
            load_moved(slot_rows, whole_rows, tk, tv, 0, NOT_MOVED, key, v0, v1, g0, g1);
            move_pointers(chunk_rows);
        };
        auto load = [&](int c, KeyRow& key, ValueRow& v0, ValueRow& v1, RowGroups& g0,
                        RowGroups& g1) {
            if (SLOT && c == slot_chunk) {
                load_rows(Choice<true>(), Choice<false>(), c, key, v0, v1, g0, g1);
            } else if (c < whole_chunks) {
                load_rows(Choice<false>(), Choice<true>(), c, key, v0, v1, g0, g1);
            } else {
                load_rows(Choice<false>(), Choice<false>(), c, key, v0, v1, g0, g1);
            }
        };
        auto attend_chunk = [&](auto whole, int c, const KeyRow& key, const ValueRow& v0,
                                const ValueRow& v1, const RowGroups& g0, const RowGroups& g1) {
            constexpr bool WHOLE = decltype(whole)::value;
            const int t0 = start + 8 * c;
            const int tv = t0 + 2 * col;

            // Independent accumulation chains: four for 8-bit TurboQuant keys on TF32 (measured
            // faster on an H200), two elsewhere (more registers cost plain rows a block per SM);
            // group scores keep one accumulator a group of their own.
            constexpr int CHAINS = GROUP_SCORES ? 1 : KFMT == 2 && KBITS == 8 ? 4 : 2;
            float s[CHAINS][4] = {};
            if constexpr (SCORES16 || GROUP_SCORES) {
                unsigned int k[EK / 2];
                if (WHOLE || t0 + row < end) {
                    key.decode_pairs16(k);
                } else {
                    #pragma unroll
                    for (int j = 0; j < EK / 2; ++j) k[j] = 0u;
                }
                if constexpr (SCORES16) {
                    #pragma unroll
                    for (int j = 0; j < KSTEPS; ++j) {
                        const uint4 a = query_fragment[j][lane];
                        mma_16bit<QT>(s[j % CHAINS], a.x, a.y, a.z, a.w, k[2 * j], k[2 * j + 1]);
                    }
                } else {
                    // Group scores: four groups at a time, each its own accumulator; a
                    // group's score is scale (partial + (zero - 1152) query sum), 1152 + code
                    // its operand.
                    #pragma unroll
                    for (int first_group = 0; first_group < KEY_GROUPS; first_group += 4) {
                        constexpr int BATCH = KEY_GROUPS < 4 ? KEY_GROUPS : 4;
                        float part[BATCH][4] = {};
                        #pragma unroll
                        for (int half = 0; half < 2; ++half) {
                            #pragma unroll
                            for (int i = 0; i < BATCH; ++i) {
                                const int j = 2 * (first_group + i) + half;
                                const uint4 a = query_fragment[j][lane];
                                mma_16bit<__half>(part[i], a.x, a.y, a.z, a.w, k[2 * j],
                                                  k[2 * j + 1]);
                            }
                        }
                        #pragma unroll
                        for (int i = 0; i < BATCH; ++i) {
                            const int g = first_group + i;
                            const float sum = group_sums[g];
                            const float full0 = fmaf(g0.zero(g) - 1152.0f, sum, part[i][0]);
                            const float full1 = fmaf(g1.zero(g) - 1152.0f, sum, part[i][1]);
                            s[0][0] = fmaf(g0.scale(g), full0, s[0][0]);
                            s[0][1] = fmaf(g1.scale(g), full1, s[0][1]);
                        }
                    }
                }
            } else {
                float k[EK];
                if (WHOLE || t0 + row < end) {
                    key.decode(codebook, col, k);
                } else {
                    #pragma unroll
                    for (int j = 0; j < EK; ++j) k[j] = 0.0f;
                }
                #pragma unroll
                for (int j = 0; j < KSTEPS; ++j) {
                    const uint4 a = query_fragment[j][lane];
                    mma_tf32(s[j % CHAINS], a.x, a.y, a.z, a.w, __float_as_uint(k[2 * j]),
                             __float_as_uint(k[2 * j + 1]));
                }
            }
            #pragma unroll
            for (int chain = 1; chain < CHAINS; ++chain) {
                s[0][0] += s[chain][0];
                s[0][1] += s[chain][1];
            }
            if constexpr (SCORES16) {
                s[0][0] = __fmul_rn(s[0][0], factor);
                s[0][1] = __fmul_rn(s[0][1], factor);
            } else if constexpr (GROUP_SCORES) {
                s[0][0] = __fmul_rn(s[0][0], head_factor);
                s[0][1] = __fmul_rn(s[0][1], head_factor);
            }
            const float s0 = WHOLE || tv < end ? s[0][0] : NEG_INF;
            const float s1 = WHOLE || tv + 1 < end ? s[0][1] : NEG_INF;

            // Online softmax of head `row` over the chunk (its 8 scores lie in 4 lanes). A NaN
            // score (DEFER-1) passes fmaxf by and makes its weight NaN, even where no finite
            // score has been seen yet (a split of one row); only positions past the end weigh 0.
            float top = fmaxf(s0, s1);
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
            const float m_new = fmaxf(m, top);
            const float alpha = m == NEG_INF ? 1.0f : exp2f(m - m_new);
            const float p0 = s0 == NEG_INF ? 0.0f : exp2f(s0 - m_new);
            const float p1 = s1 == NEG_INF ? 0.0f : exp2f(s1 - m_new);
            l = l * alpha + (p0 + p1);
            m = m_new;
            // acc holds heads 2 col and 2 col + 1, whose factors lanes 8 col and 8 col + 4 hold.
            const float alpha_even = __shfl_sync(0xffffffffu, alpha, 8 * col);
            const float alpha_odd = __shfl_sync(0xffffffffu, alpha, 8 * col + 4);

            // The values decoded (zero past the end), or with scaled weights their codes,
            // 2^VBITS + code, made tile by tile below (finite past the end, where B is 0).
            float y0[EV], y1[EV];
            unsigned int w0, w1;
            float bias_part = 0.0f;
            if constexpr (SCALED_VALUES) {
                constexpr float OFFSET = 1 << VBITS;
                w0 = WHOLE || tv < end ? tf32(p0 * static_cast<float>(v0.scale)) : 0u;
                w1 = WHOLE || tv + 1 < end ? tf32(p1 * static_cast<float>(v1.scale)) : 0u;
                if (WHOLE || tv < end) {
                    bias_part = fmaf(p0, static_cast<float>(v0.bias),
                                     -OFFSET * __uint_as_float(w0));
                }
                if (WHOLE || tv + 1 < end) {
                    bias_part += fmaf(p1, static_cast<float>(v1.bias),
                                      -OFFSET * __uint_as_float(w1));
                }
            } else {
                if (WHOLE || tv < end) {
                    v0.decode(codebook, row, y0);
                } else {
                    #pragma unroll
                    for (int j = 0; j < EV; ++j) y0[j] = 0.0f;
                }
                if (WHOLE || tv + 1 < end) {
                    v1.decode(codebook, row, y1);
                } else {
                    #pragma unroll
                    for (int j = 0; j < EV; ++j) y1[j] = 0.0f;
                }
                w0 = tf32(p0);
                w1 = tf32(p1);
            }
            // Once the maxima settle, no factor moves: skip the rescale (a warp-wide choice).
            if (__any_sync(0xffffffffu, alpha_even != 1.0f || alpha_odd != 1.0f)) {
                #pragma unroll
                for (int i = 0; i < MTILES; ++i) {
                    acc[i][0] *= alpha_even;
                    acc[i][1] *= alpha_odd;
                    acc[i][2] *= alpha_even;
                    acc[i][3] *= alpha_odd;
                }
                if constexpr (SCALED_VALUES) bias_sum *= alpha;
            }
            if constexpr (SCALED_VALUES) bias_sum += bias_part;
            #pragma unroll
            for (int i = 0; i < MTILES; ++i) {
                if constexpr (SCALED_VALUES) {
                    mma_tf32(acc[i], v0.offset_code(2 * i), v0.offset_code(2 * i + 1),
                             v1.offset_code(2 * i), v1.offset_code(2 * i + 1), w0, w1);
                } else {
                    mma_tf32(acc[i], __float_as_uint(y0[2 * i]), __float_as_uint(y0[2 * i + 1]),
                             __float_as_uint(y1[2 * i]), __float_as_uint(y1[2 * i + 1]), w0, w1);
                }
            }
        };
        KeyRow next_key;
        ValueRow next_v0, next_v1;
        RowGroups next_g0, next_g1;
        if (warp < chunks) load(warp, next_key, next_v0, next_v1, next_g0, next_g1);
        int c = warp;
        for (; c < whole_chunks; c += WARPS) {
            const KeyRow key = next_key;
            const ValueRow v0 = next_v0;
            const ValueRow v1 = next_v1;
            const RowGroups g0 = next_g0;
            const RowGroups g1 = next_g1;
            if (c + WARPS < chunks) load(c + WARPS, next_key, next_v0, next_v1, next_g0, next_g1);
            attend_chunk(Choice<true>(), c, key, v0, v1, g0, g1);
        }
        // The partial chunk, if any, is this warp's next (its rows are loaded).
        if (c < chunks) {
            attend_chunk(Choice<false>(), c, next_key, next_v0, next_v1, next_g0, next_g1);
        }
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        // Scaled weights: column n's bias sum (over the lanes of row n) joins its outputs.
        float bias_even = 0.0f, bias_odd = 0.0f;
        if constexpr (SCALED_VALUES) {
            bias_sum += __shfl_xor_sync(0xffffffffu, bias_sum, 1);
            bias_sum += __shfl_xor_sync(0xffffffffu, bias_sum, 2);
            bias_even = __shfl_sync(0xffffffffu, bias_sum, 8 * col);
            bias_odd = __shfl_sync(0xffffffffu, bias_sum, 8 * col + 4);
        }

        // The warp's results to shared memory, for the block merge: column n holds head
        // n % HEAD_SPAN of the lane's elements where n / HEAD_SPAN is their group.
        const int even_head = 2 * col % HEAD_SPAN;
        const int odd_head = (2 * col + 1) % HEAD_SPAN;
        const bool even_own = 2 * col / HEAD_SPAN == row / HEAD_SPAN && even_head < G;
        const bool odd_own = (2 * col + 1) / HEAD_SPAN == row / HEAD_SPAN && odd_head < G;
        auto with_bias = [](float sum, float bias) {
            if constexpr (SCALED_VALUES) return sum + bias;
            return sum;
        };
        #pragma unroll
        for (int i = 0; i < MTILES; ++i) {
            const int d = row * EV + 2 * i;
            if (even_own) {
                sums[(warp * G + even_head) * DV + d] = with_bias(acc[i][0], bias_even);
                sums[(warp * G + even_head) * DV + d + 1] = with_bias(acc[i][2], bias_even);
            }
            if (odd_own) {
                sums[(warp * G + odd_head) * DV + d] = with_bias(acc[i][1], bias_odd);
                sums[(warp * G + odd_head) * DV + d + 1] = with_bias(acc[i][3], bias_odd);
            }
        }
        if (col == 0 && row < G) {
            maxima[warp * G + row] = m;
            totals[warp * G + row] = l;
        }
    } else {
        float q[G][EK];
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            const long long q_row =
                (long long)b * queries_strides[0] + (long long)(h * G + g) * queries_strides[1];
            #pragma unroll
            for (int j = 0; j < EK; ++j) {
                const long long at = q_row + (lane * EK + j) * queries_strides[3];
                q[g][j] = static_cast<float>(queries[at]) * factor;
            }
        }

        float m[G], l[G], acc[G][EV];
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            m[g] = NEG_INF;
            l[g] = 0.0f;
            #pragma unroll
            for (int j = 0; j < EV; ++j) acc[g][j] = 0.0f;
        }

        // The warp's positions are first, first + WARPS, ...: STAGE at a time, the next stage's
        // loads issued before this one computes (software pipelining), then the rest one by one.
        const int first = start + warp;
        const int n = first < end ? (end - first + WARPS - 1) / WARPS : 0;
        const int stages = n / STAGE;
        KeyRow next_keys[STAGE];
        ValueRow next_values[STAGE];
        auto load = [&](int i, KeyRow& key, ValueRow& value) {
            const int t = first + i * WARPS;
            const int at = ORDERED ? ordering.row(t) : t;
            load_key(key, t, at, lane);
            load_value(value, t, at, lane);
        };
        if (stages > 0) {
            #pragma unroll
            for (int u = 0; u < STAGE; ++u) load(u, next_keys[u], next_values[u]);
        }
        for (int stage = 0; stage < stages; ++stage) {
            KeyRow keys[STAGE];
            ValueRow values[STAGE];
            #pragma unroll
            for (int u = 0; u < STAGE; ++u) {
                keys[u] = next_keys[u];
                values[u] = next_values[u];
            }
            if (stage + 1 < stages) {
                #pragma unroll
                for (int u = 0; u < STAGE; ++u) {
                    load((stage + 1) * STAGE + u, next_keys[u], next_values[u]);
                }
            }
            attend_stage<STAGE, G, EK, EV>(keys, values, codebook, lane, q, m, l, acc);
        }
        for (int i = stages * STAGE; i < n; ++i) {
            KeyRow keys[1];
            ValueRow values[1];
            load(i, keys[0], values[0]);
            attend_stage<1, G, EK, EV>(keys, values, codebook, lane, q, m, l, acc);
        }

        // The warp's results to shared memory, for the block merge.
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            #pragma unroll
            for (int j = 0; j < EV; ++j) sums[(warp * G + g) * DV + lane * EV + j] = acc[g][j];
            if (lane == 0) {
                maxima[warp * G + g] = m[g];
                totals[warp * G + g] = l[g];
            }
        }
    }

    __syncthreads();
    for (int i = threadIdx.x; i < G * DV; i += blockDim.x) {
        const int g = i / DV;
        const int d = i % DV;
        float top = NEG_INF;
        for (int w = 0; w < WARPS; ++w) top = fmaxf(top, maxima[w * G + g]);
        // A warp without positions has total 0 and is skipped; a NaN row (a poisoned
        // group, DEFER-1) leaves NaN sums that reach the output.
        float sum = 0.0f, total = 0.0f;
        for (int w = 0; w < WARPS; ++w) {
            if (totals[w * G + g] == 0.0f) continue;
            const float weight = exp2f(maxima[w * G + g] - top);
            sum += sums[(w * G + g) * DV + d] * weight;
            total += totals[w * G + g] * weight;
        }
        // The split's row of `partial`: its DV sums, then its maximum and total.
        const long long row = ((long long)b * q_heads + h * G + g) * splits + split;
        partial[row * (DV + 2) + d] = sum;
        if (d == 0) {
            partial[row * (DV + 2) + DV] = top;
            partial[row * (DV + 2) + DV + 1] = total;
        }
    }
}

// A field of a record row at byte `offset` as its element type (none where offset < 0: the
// format does not store it, or where there is no record).
template <typename T>
__device__ __forceinline__ const T* record_field(const uint8_t* record, int offset) {
    return record == nullptr || offset < 0 ? nullptr : reinterpret_cast<const T*>(record + offset);
}

// The strides of a 4-d array's axes, in elements of SIZE bytes where the array's strides
// are in bytes (a record's, uint8 rows, accelerated/records.py): a record's strides along
// batch, heads and positions are multiples of its rows' 16 bytes. (The last axis's stride
// of a record, one byte, is not read.)
struct AxisStrides {
    long long s[4];
    __device__ __forceinline__ long long operator[](int i) const { return s[i]; }
};

template <int SIZE, typename S>
__device__ __forceinline__ AxisStrides element_strides(const S& bytes) {
    return AxisStrides{{bytes[0] / SIZE, bytes[1] / SIZE, bytes[2] / SIZE, bytes[3] / SIZE}};
}

// Pass 1 over keys and values stored in one record per row (accelerated/records.py): the
// fields the formats store at byte offsets OFF_* of a row (-1: a field they do not store),
// read where they lie; in the slot variant the new position's from its record row.
template <bool MMA, bool COUNTED, bool SLOT, bool ORDERED, typename QT, typename KC,
          typename VC, typename KS, typename VS, int DK, int DV, int G, int WARPS, int STAGE,
          int KFMT, int KBITS, int KGROUP, int VFMT, int VBITS, int VGROUP, int TABLE,
          int SCALE_BITS, bool SCALED, int MIN_SPLIT, int MOST_SPLITS, int OFF_KC, int OFF_KS,
          int OFF_KB, int OFF_VC, int OFF_VS, int OFF_VB, typename Shape, typename Strides>
__device__ __forceinline__ void record_pass(
    const QT* queries, const Shape& queries_shape, const Strides& queries_strides,
    const uint8_t* record, const Shape& record_shape, const Strides& record_strides,
    const float* table, const int* rows, const int* slot_row, const int* order,
    const int* turn, const int* oldest,
    const uint8_t* new_record, const Strides& new_record_strides, float* partial) {
    // One strides type for every argument of partial_pass: the queries' in elements too.
    const AxisStrides q = element_strides<1>(queries_strides);
    const AxisStrides kc = element_strides<sizeof(KC)>(record_strides);
    const AxisStrides ks = element_strides<sizeof(KS)>(record_strides);
    const AxisStrides vc = element_strides<sizeof(VC)>(record_strides);
    const AxisStrides vs = element_strides<sizeof(VS)>(record_strides);
    const AxisStrides new_kc = element_strides<sizeof(KC)>(new_record_strides);
    const AxisStrides new_ks = element_strides<sizeof(KS)>(new_record_strides);
    const AxisStrides new_vc = element_strides<sizeof(VC)>(new_record_strides);
    const AxisStrides new_vs = element_strides<sizeof(VS)>(new_record_strides);
    partial_pass<MMA, COUNTED, SLOT, ORDERED, QT, KC, VC, KS, VS, DK, DV, G, WARPS, STAGE, KFMT,
                 KBITS, KGROUP, VFMT, VBITS, VGROUP, TABLE, SCALE_BITS, SCALED, MIN_SPLIT,
                 MOST_SPLITS>(
        queries, queries_shape, q,
        record_field<KC>(record, OFF_KC), record_shape, kc,
        record_field<KS>(record, OFF_KS), ks, record_field<KS>(record, OFF_KB),
        record_field<VC>(record, OFF_VC), vc,
        record_field<VS>(record, OFF_VS), vs, record_field<VS>(record, OFF_VB),
        table, rows, slot_row, order, turn, oldest,
        record_field<KC>(new_record, OFF_KC), new_kc,
        record_field<KS>(new_record, OFF_KS), new_ks, record_field<KS>(new_record, OFF_KB),
        record_field<VC>(new_record, OFF_VC), new_vc,
        record_field<VS>(new_record, OFF_VS), new_vs, record_field<VS>(new_record, OFF_VB),
        partial);
}

// Pass 2 of one block (b, query head blockIdx.x), PARTS * DV threads: merge the splits and,
// for TurboQuant values (ROTATED), unrotate the output row once (TQ-8). Each split's weight
// is computed once, not once an element; thread (part, d) sums element d over every PARTS-th
// split, its loads independent of each other, so that the block has many in flight (the
// merge is bound by their latency, not their bytes); part 0 then adds the parts in order.
template <int DV, int PARTS, int MAX_SPLITS, bool ROTATED, typename OT, int INV_SQRT_BITS,
          typename Shape>
__device__ __forceinline__ void merge_pass(
    const float* partial, const Shape& partial_shape, const float* signs, OT* out) {
    const int d = threadIdx.x % DV;
    const int part = threadIdx.x / DV;
    const long long row = blockIdx.x;
    const int splits = partial_shape[1];
    // Split s's row: its DV sums, then its maximum and total (partial_pass).
    const float* row_partials = partial + row * splits * (DV + 2);
    __shared__ float weight[MAX_SPLITS];
    __shared__ float split_totals[MAX_SPLITS];
    __shared__ float part_sums[PARTS][DV];
    __shared__ float part_totals[PARTS];

    // Warp 0 loads each split's maximum and total once, finds the row's maximum (fmaxf
    // passes a NaN maximum by) and gives each split its weight; a split without positions
    // (total 0) adds nothing: weight -1 marks it.
    if (threadIdx.x < 32) {
        constexpr int PER_LANE = (MAX_SPLITS + 31) / 32;
        const float NEG_INF = -__int_as_float(0x7f800000);
        float maxima[PER_LANE], totals[PER_LANE];
        float top = NEG_INF;
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int s = threadIdx.x + 32 * i;
            maxima[i] = s < splits ? row_partials[s * (DV + 2) + DV] : NEG_INF;
            totals[i] = s < splits ? row_partials[s * (DV + 2) + DV + 1] : 0.0f;
            top = fmaxf(top, maxima[i]);
        }
        #pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, offset));
        }
        #pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int s = threadIdx.x + 32 * i;
            if (s < splits) {
                weight[s] = totals[i] == 0.0f ? -1.0f : exp2f(maxima[i] - top);
                split_totals[s] = totals[i];
            }
        }
    }
    __syncthreads();
    float sum = 0.0f, total = 0.0f;
    #pragma unroll 4
    for (int s = part; s < splits; s += PARTS) {
        const float w = weight[s];
        const float x = row_partials[s * (DV + 2) + d];
        if (!(w < 0.0f)) {
            sum += x * w;
            total += split_totals[s] * w;
        }
    }
    if constexpr (PARTS > 1) {
        if (part > 0) {
            part_sums[part][d] = sum;
            if (d == 0) part_totals[part] = total;
        }
        __syncthreads();
        if (part == 0) {
            #pragma unroll
            for (int p = 1; p < PARTS; ++p) {
                sum += part_sums[p][d];
                total += part_totals[p];
            }
        }
    }
    float value = sum / total;
    if (ROTATED) {
        // TQ-8: butterflies at strides 1 .. DV/2 (element d of a pair (d, d + h) becomes
        // a + b, element d + h a - b; within a warp by shuffles, across warps through two
        // shared buffers in turn, one barrier a stride, which every thread of the block
        // meets), then f32(1/sqrt(DV)), then the signs. Part 0 holds the row.
        if (part == 0) {
            #pragma unroll
            for (int h = 1; h < 32 && h < DV; h <<= 1) {
                const float other = __shfl_xor_sync(0xffffffffu, value, h);
                value = (d & h) == 0 ? __fadd_rn(value, other) : __fsub_rn(other, value);
            }
        }
        __shared__ float lane[2][DV];
        #pragma unroll
        for (int h = 32, turn = 0; h < DV; h <<= 1, turn ^= 1) {
            if (part == 0) lane[turn][d] = value;
            __syncthreads();
            if (part == 0) {
                const float other = lane[turn][d ^ h];
                value = (d & h) == 0 ? __fadd_rn(value, other) : __fsub_rn(other, value);
            }
        }
        value = __fmul_rn(__fmul_rn(value, __int_as_float(INV_SQRT_BITS)), signs[d]);
    }
    if (part == 0) out[row * DV + d] = static_cast<OT>(value);
}

}  // namespace kvspec_attn
