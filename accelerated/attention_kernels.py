"""Decode attention over stored fields, as two CUDA kernels (spec READ-7).

One query position attends over every stored position of a cache without decoding the
window into memory first. Keys and values are read where they lie: the growable buffer
up to the offset (a strided view, never copied), affine words with their scales and
biases, TurboQuant codes with their scales and zero points. Each element is decoded in
registers to exactly the operand the reference's attention sees (AFF-6's two roundings
in the scales' format, TQ-5's `(code + zero) * scale`, TQ-8's `centroid * scale` in the
rotated domain), so only the attention arithmetic itself departs from the reference,
within READ-1's bound.

Pass 1 (split-K, as FlashDecoding): the positions are cut into splits; a block of
WARPS warps takes one split of one KV head and serves every query head that reads that
head (GQA), so each stored byte is read once. Lane l of a warp owns elements
[l E, l E + E) of a row (E = D / 32); a warp takes every WARPS-th position of the split,
STAGE at a time, loading the next stage's raw words before it decodes this one; the
stage's dot products reduce together (5 + G shuffles each) and update one online softmax;
the warps of a block merge in shared memory and write one partial (max, sum, weighted
values) per split.
Pass 2 merges the splits of each query head and, for TurboQuant values, unrotates the
output row once (TQ-8): the Hadamard butterflies, 1/sqrt(D), then the signs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from kvspec.reference.turboquant_tables import INV_SQRT_BITS

#: Storage formats of one side (keys or values) of a cache.
PLAIN = 0  # the input dtype, as appended
AFFINE = 1  # uint32 words, scales and biases in the input dtype (AFF-5)
TURBO_KEY = 2  # int8 codes (8 bits) or packed unsigned codes, float16 scales, zeros (TQ-4)
TURBO_VALUE = 3  # packed codebook indices, float16 scales, rotated domain (TQ-7)

WARPS = 4
#: Positions a warp reads and reduces together (pass 1).
STAGE = 4
#: A split takes at least this many positions; at most MAX_SPLITS splits per head; about
#: TARGET_BLOCKS blocks in all (four per SM of an H200 hold one resident wave).
MIN_SPLIT = 64
MAX_SPLITS = 128
TARGET_BLOCKS = 528
#: The query heads one block serves and the head dims the kernels take.
MAX_GROUP = 8
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256, 512)

_HEADER = r"""
namespace kvspec_attn {

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
    unsigned int w[NW];
    const unsigned char* row;  // read at decode time when the lane's bits are not words
    S scale;
    S bias;

    __device__ __forceinline__ void load(
        const C* codes, const S* scales, const S* biases,
        long long code_row, long long group_row, int lane) {
        row = reinterpret_cast<const unsigned char*>(codes + code_row);
        if constexpr (WORDS) {
            load_words<NW>(row + lane * NW * 4, w);
        } else if constexpr (HALF) {
            w[0] = *reinterpret_cast<const unsigned short*>(row + lane * 2);
        }
        if constexpr (FMT != 0) {
            // E divides GROUP: a lane's elements share one group.
            const int g = lane * E / GROUP;
            scale = scales[group_row + g];
            if constexpr (FMT != 3) bias = biases[group_row + g];
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

    // The reference's operands (READ-7): AFF-6, TQ-5, TQ-8 (rotated), or the plain value.
    __device__ __forceinline__ void decode(const float* table, int lane, float (&x)[E]) const {
        if constexpr (FMT == 0) {
            #pragma unroll
            for (int j = 0; j < E; ++j) {
                if constexpr (!(WORDS || HALF)) {
                    x[j] = static_cast<float>(reinterpret_cast<const C*>(row)[lane * E + j]);
                } else if constexpr (sizeof(C) == 4) {
                    x[j] = __uint_as_float(element_bits(j, lane));
                } else {
                    const unsigned short bits = (unsigned short)element_bits(j, lane);
                    C value;
                    memcpy(&value, &bits, 2);
                    x[j] = static_cast<float>(value);
                }
            }
        } else {
            const float s = static_cast<float>(scale);
            float z = 0.0f;
            if constexpr (FMT != 3) z = static_cast<float>(bias);
            #pragma unroll
            for (int j = 0; j < E; ++j) {
                const unsigned int c = element_bits(j, lane);
                if constexpr (FMT == 1) {
                    // AFF-6: T(T(code * scale) + bias).
                    x[j] = rounded<S>(__fadd_rn(rounded<S>(__fmul_rn((float)c, s)), z));
                } else if constexpr (FMT == 2) {
                    // TQ-5: (code + zero) * scale; 8-bit codes are signed.
                    const float code = BITS == 8 ? (float)(int)(signed char)c : (float)c;
                    x[j] = __fmul_rn(__fadd_rn(code, z), s);
                } else {
                    // TQ-8: centroid * scale, left rotated.
                    x[j] = __fmul_rn(table[c], s);
                }
            }
        }
    }
};

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

}  // namespace kvspec_attn
"""

# Pass 1. Inputs: q [B, Hq, 1, DK]; per side codes, scales, biases (a one-element
# placeholder where a format has none); the value codebook. Outputs: partial sums
# [B * Hq, SPLITS, DV] and (max, sum) [B * Hq, SPLITS, 2]. The softmax scale is a
# template constant (its float32 bits): one compile per model, no per-step upload.
_PARTIAL_SOURCE = r"""
    using namespace kvspec_attn;
    constexpr int EK = DK / 32;
    constexpr int EV = DV / 32;
    constexpr float LOG2E = 1.4426950408889634f;
    const float NEG_INF = -__int_as_float(0x7f800000);
    extern __shared__ float shared[];
    __shared__ float codebook[TABLE];

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int split = blockIdx.x;
    const int splits = gridDim.x;
    const int bh = blockIdx.y;
    const int kv_heads = k_codes_shape[1];
    const int b = bh / kv_heads;
    const int h = bh % kv_heads;
    const int T = k_codes_shape[2];
    const int q_heads = queries_shape[1];

    for (int i = threadIdx.x; i < TABLE; i += blockDim.x) codebook[i] = table[i];
    __syncthreads();

    const float factor = __int_as_float(SCALE_BITS) * LOG2E;
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

    const int per_split = (T + splits - 1) / splits;
    const int start = split * per_split;
    const int end = min(T, start + per_split);

    float m[G], l[G], acc[G][EV];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
        #pragma unroll
        for (int j = 0; j < EV; ++j) acc[g][j] = 0.0f;
    }

    // Rows of head (b, h); a placeholder's strides are never used (format PLAIN).
    const long long k_base = b * k_codes_strides[0] + h * k_codes_strides[1];
    const long long ks_base = KFMT == 0 ? 0 : b * k_scales_strides[0] + h * k_scales_strides[1];
    const long long v_base = b * v_codes_strides[0] + h * v_codes_strides[1];
    const long long vs_base = VFMT == 0 ? 0 : b * v_scales_strides[0] + h * v_scales_strides[1];

    using KeyRow = LaneRow<KFMT, EK, KBITS, KGROUP, KC, KS>;
    using ValueRow = LaneRow<VFMT, EV, VBITS, VGROUP, VC, VS>;
    // The warp's positions are first, first + WARPS, ...: STAGE at a time, the next stage's
    // loads issued before this one computes (software pipelining), then the rest one by one.
    const int first = start + warp;
    const int n = first < end ? (end - first + WARPS - 1) / WARPS : 0;
    const int stages = n / STAGE;
    KeyRow next_keys[STAGE];
    ValueRow next_values[STAGE];
    auto load = [&](int i, KeyRow& key, ValueRow& value) {
        const int t = first + i * WARPS;
        key.load(k_codes, k_scales, k_biases, k_base + (long long)t * k_codes_strides[2],
                 KFMT == 0 ? 0 : ks_base + (long long)t * k_scales_strides[2], lane);
        value.load(v_codes, v_scales, v_biases, v_base + (long long)t * v_codes_strides[2],
                   VFMT == 0 ? 0 : vs_base + (long long)t * v_scales_strides[2], lane);
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

    // Merge the warps: shared holds [WARPS][G][DV] sums, then [WARPS][G] maxima and sums.
    float* sums = shared;
    float* maxima = shared + WARPS * G * DV;
    float* totals = maxima + WARPS * G;
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        #pragma unroll
        for (int j = 0; j < EV; ++j) sums[(warp * G + g) * DV + lane * EV + j] = acc[g][j];
        if (lane == 0) {
            maxima[warp * G + g] = m[g];
            totals[warp * G + g] = l[g];
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
        const long long row = ((long long)b * q_heads + h * G + g) * splits + split;
        partial[row * DV + d] = sum;
        if (d == 0) {
            stats[row * 2] = top;
            stats[row * 2 + 1] = total;
        }
    }
"""

# Pass 2. One block per (b, query head), DV threads: merge the splits, unrotate if ROTATED.
_MERGE_SOURCE = r"""
    const int d = threadIdx.x;
    const long long row = blockIdx.x;
    const int splits = stats_shape[1];
    float top = -__int_as_float(0x7f800000);
    for (int s = 0; s < splits; ++s) top = fmaxf(top, stats[(row * splits + s) * 2]);
    float sum = 0.0f, total = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float split_total = stats[(row * splits + s) * 2 + 1];
        if (split_total == 0.0f) continue;  // a split without positions
        const float weight = exp2f(stats[(row * splits + s) * 2] - top);
        sum += partial[(row * splits + s) * DV + d] * weight;
        total += split_total * weight;
    }
    float value = sum / total;
    if (ROTATED) {
        // TQ-8: butterflies at strides 1 .. DV/2, then f32(1/sqrt(DV)), then the signs.
        __shared__ float lane[DV];
        lane[d] = value;
        __syncthreads();
        for (int h = 1; h < DV; h <<= 1) {
            if ((d & h) == 0) {
                const float a = lane[d];
                const float b = lane[d + h];
                lane[d] = __fadd_rn(a, b);
                lane[d + h] = __fsub_rn(a, b);
            }
            __syncthreads();
        }
        value = __fmul_rn(__fmul_rn(lane[d], __int_as_float(INV_SQRT_BITS)), signs[d]);
    }
    out[row * DV + d] = static_cast<OT>(value);
"""


#: The compiled decode step's variant reads the live row count from an input (spec
#: COMPILE-4): its graph passes whole buffers, and the count changes every step.
_ROWS_FROM_SHAPE = "const int T = k_codes_shape[2];"
_ROWS_FROM_INPUT = "const int T = min(k_codes_shape[2], rows[0]);"
assert _PARTIAL_SOURCE.count(_ROWS_FROM_SHAPE) == 1


@cache
def _partial_kernel(shared_bytes: int, counted: bool = False) -> object:
    # The dynamic shared memory is fixed per kernel object: one per (G, DV). The counted
    # variant takes one more input, `rows` (int32 [1]); the plain one is unchanged.
    source = (
        _PARTIAL_SOURCE.replace(_ROWS_FROM_SHAPE, _ROWS_FROM_INPUT) if counted else _PARTIAL_SOURCE
    )
    return mx.fast.cuda_kernel(
        name="kvspec_decode_attention_counted" if counted else "kvspec_decode_attention",
        input_names=[
            "queries",
            "k_codes",
            "k_scales",
            "k_biases",
            "v_codes",
            "v_scales",
            "v_biases",
            "table",
            *(["rows"] if counted else []),
        ],
        output_names=["partial", "stats"],
        source=source,
        header=_HEADER,
        ensure_row_contiguous=False,
        shared_memory=shared_bytes,
    )


@cache
def _merge_kernel() -> object:
    return mx.fast.cuda_kernel(
        name="kvspec_decode_merge",
        input_names=["partial", "stats", "signs"],
        output_names=["out"],
        source=_MERGE_SOURCE,
    )


@dataclass(frozen=True)
class StoredSide:
    """Keys or values of a cache as stored: rows [B, H, T, *] of `codes` (a view that may
    be strided along T), and for coded formats their group fields [B, H, T', D / group].
    The read covers the first T rows of the key codes; every other field holds at least
    T rows (the whole buffer may be passed).

    fmt is PLAIN, AFFINE, TURBO_KEY or TURBO_VALUE; bits and group_size describe the codes
    (0 for PLAIN); dim is the head dim the codes hold.
    """

    fmt: int
    codes: mx.array
    scales: mx.array | None
    biases: mx.array | None
    bits: int
    group_size: int
    dim: int


def supported(keys: StoredSide, values: StoredSide, query_heads: int) -> bool:
    """Whether the kernels take this read: a CUDA device, head dims they are built for, at
    most MAX_GROUP query heads per KV head. (Stored fields are contiguous in their last
    axis: caches slice them along positions only.)"""
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        return False
    kv_heads = keys.codes.shape[1]
    if query_heads % kv_heads != 0 or query_heads // kv_heads > MAX_GROUP:
        return False
    return keys.dim in HEAD_DIMS and values.dim in HEAD_DIMS


def _splits(T: int, blocks_per_split: int) -> int:
    # About one resident wave of blocks (TARGET_BLOCKS); no split shorter than MIN_SPLIT.
    wanted = max(1, math.ceil(TARGET_BLOCKS / blocks_per_split))
    return max(1, min(MAX_SPLITS, wanted, math.ceil(T / MIN_SPLIT)))


@cache
def _float_bits(x: float) -> int:
    """The float32 bits of x as a signed int (a template constant)."""
    return int(np.array(x, np.float32).view(np.int32))


@cache
def _placeholder(dtype: mx.Dtype) -> mx.array:
    """A one-element stand-in for a field a format does not have (never read)."""
    return mx.zeros((1, 1, 1, 1), dtype)


@dataclass(frozen=True)
class _Plan:
    """What one read configuration launches with; built once per configuration, so a decode
    step spends no host time on it."""

    partial_template: list
    merge_template: list
    shared_bytes: int


@cache
def _plan(
    query_dtype: mx.Dtype,
    keys: tuple,
    values: tuple,
    group: int,
    scale_bits: int,
    table_size: int,
    out_dtype: mx.Dtype,
) -> _Plan:
    (k_fmt, k_codes, k_scales, k_bits, k_group, DK) = keys
    (v_fmt, v_codes, v_scales, v_bits, v_group, DV) = values
    partial = [
        # The operand dtypes name the instance (one NVRTC compile per combination).
        ("QT", query_dtype),
        ("KC", k_codes),
        ("VC", v_codes),
        ("KS", k_scales),
        ("VS", v_scales),
        ("DK", DK),
        ("DV", DV),
        ("G", group),
        ("WARPS", WARPS),
        ("STAGE", STAGE),
        ("KFMT", k_fmt),
        ("KBITS", k_bits),
        ("KGROUP", k_group),
        ("VFMT", v_fmt),
        ("VBITS", v_bits),
        ("VGROUP", v_group),
        ("TABLE", table_size),
        ("SCALE_BITS", scale_bits),
    ]
    merge = [
        ("DV", DV),
        ("ROTATED", v_fmt == TURBO_VALUE),
        ("OT", out_dtype),
        ("INV_SQRT_BITS", INV_SQRT_BITS.get(DV, 0)),
    ]
    return _Plan(partial, merge, (WARPS * group * DV + 2 * WARPS * group) * 4)


def _side_key(side: StoredSide) -> tuple:
    scales = side.scales if side.scales is not None else side.codes
    return (side.fmt, side.codes.dtype, scales.dtype, side.bits, side.group_size or 32, side.dim)


def _fields(side: StoredSide) -> list[mx.array]:
    # Placeholders where a format has no such field (the kernel never reads them).
    scales = side.scales if side.scales is not None else _placeholder(side.codes.dtype)
    biases = side.biases if side.biases is not None else _placeholder(scales.dtype)
    return [side.codes, scales, biases]


def decode_attention(
    queries: mx.array,
    keys: StoredSide,
    values: StoredSide,
    scale: float,
    table: mx.array | None,
    signs: mx.array | None,
    out_dtype: mx.Dtype,
    rows: mx.array | None = None,
) -> mx.array:
    """READ-7: the attention of queries [B, Hq, 1, Dk] over every stored row, [B, Hq, 1, Dv]
    in `out_dtype`. `table` is the value codebook and `signs` the sign vector of Dv for
    TURBO_VALUE (the output is unrotated); None otherwise. `rows` (int32 [1]), when given,
    limits the read to the first rows[0] rows as data (COMPILE-4): splits are planned for
    the whole buffer, and a split past the count reads nothing. Call only when
    `supported`."""
    B, Hq, N, _ = queries.shape
    _, Hk, T, _ = keys.codes.shape
    codebook = table if table is not None else _placeholder(mx.float32)
    plan = _plan(
        queries.dtype,
        _side_key(keys),
        _side_key(values),
        Hq // Hk,
        _float_bits(scale),
        codebook.size,
        out_dtype,
    )
    splits = _splits(T, B * Hk)
    threads = WARPS * 32
    DV = values.dim
    partial, stats = _partial_kernel(plan.shared_bytes, rows is not None)(
        inputs=[
            queries,
            *_fields(keys),
            *_fields(values),
            codebook,
            *([] if rows is None else [rows]),
        ],
        template=plan.partial_template,
        grid=(splits * threads, B * Hk, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B * Hq, splits, DV), (B * Hq, splits, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (out,) = _merge_kernel()(
        inputs=[partial, stats, signs if signs is not None else _placeholder(mx.float32)],
        template=plan.merge_template,
        grid=(B * Hq * DV, 1, 1),
        threadgroup=(DV, 1, 1),
        output_shapes=[(B, Hq, N, DV)],
        output_dtypes=[out_dtype],
    )
    return out
