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
reduces its dot products with shuffles and keeps an online softmax; the warps of a block
merge in shared memory and write one partial (max, sum, weighted values) per split.
Pass 2 merges the splits of each query head and, for TurboQuant values, unrotates the
output row once (TQ-8): the Hadamard butterflies, 1/sqrt(D), then the signs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import mlx.core as mx

from kvspec.reference.turboquant_tables import INV_SQRT_BITS

#: Storage formats of one side (keys or values) of a cache.
PLAIN = 0  # the input dtype, as appended
AFFINE = 1  # uint32 words, scales and biases in the input dtype (AFF-5)
TURBO_KEY = 2  # int8 codes (8 bits) or packed unsigned codes, float16 scales, zeros (TQ-4)
TURBO_VALUE = 3  # packed codebook indices, float16 scales, rotated domain (TQ-7)

WARPS = 4
#: A split takes at least this many positions; at most MAX_SPLITS splits per head.
MIN_SPLIT = 64
MAX_SPLITS = 128
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

template <int NB>
__device__ __forceinline__ void load_bytes(const unsigned char* p, unsigned char (&out)[NB]) {
    // NB bytes from an address aligned to NB when NB is a power of two up to 16.
    if constexpr (NB == 16) {
        *reinterpret_cast<uint4*>(out) = *reinterpret_cast<const uint4*>(p);
    } else if constexpr (NB == 8) {
        *reinterpret_cast<uint2*>(out) = *reinterpret_cast<const uint2*>(p);
    } else if constexpr (NB == 4) {
        *reinterpret_cast<unsigned int*>(out) = *reinterpret_cast<const unsigned int*>(p);
    } else if constexpr (NB == 2) {
        *reinterpret_cast<unsigned short*>(out) = *reinterpret_cast<const unsigned short*>(p);
    } else {
        #pragma unroll
        for (int i = 0; i < NB; ++i) out[i] = p[i];
    }
}

template <int BITS>
__device__ __forceinline__ unsigned int code_at(const unsigned char* stream, int i) {
    // Code i of an LSB-first stream (BITS-1, BITS-2: words are little-endian bytes).
    const int bit = i * BITS;
    const int byte = bit >> 3;
    const int shift = bit & 7;
    unsigned int window = stream[byte];
    if (shift + BITS > 8) window |= (unsigned int)stream[byte + 1] << 8;
    return (window >> shift) & ((1u << BITS) - 1u);
}

template <int E, int BITS>
__device__ __forceinline__ void lane_codes(
    const unsigned char* row, int lane, unsigned int (&codes)[E]) {
    // The codes of elements [lane E, lane E + E) of one row.
    constexpr int LANE_BITS = E * BITS;
    constexpr int NB = LANE_BITS / 8;
    if constexpr (LANE_BITS % 8 == 0 && (NB & (NB - 1)) == 0 && NB <= 16) {
        unsigned char bytes[NB];
        load_bytes<NB>(row + lane * NB, bytes);
        #pragma unroll
        for (int j = 0; j < E; ++j) codes[j] = code_at<BITS>(bytes, j);
    } else {
        #pragma unroll
        for (int j = 0; j < E; ++j) codes[j] = code_at<BITS>(row, lane * E + j);
    }
}

template <typename T, int E>
__device__ __forceinline__ void lane_plain(const T* row, int lane, float (&x)[E]) {
    constexpr int NB = E * (int)sizeof(T);
    if constexpr ((NB & (NB - 1)) == 0 && NB <= 16) {
        T v[E];
        load_bytes<NB>(reinterpret_cast<const unsigned char*>(row + lane * E),
                       *reinterpret_cast<unsigned char(*)[NB]>(&v[0]));
        #pragma unroll
        for (int j = 0; j < E; ++j) x[j] = static_cast<float>(v[j]);
    } else {
        #pragma unroll
        for (int j = 0; j < E; ++j) x[j] = static_cast<float>(row[lane * E + j]);
    }
}

// One row (position t of head (b, h)) of one side, decoded to the reference's operands.
// FMT: 0 plain, 1 affine, 2 TurboQuant key, 3 TurboQuant value (rotated).
template <int FMT, int E, int BITS, int GROUP, typename C, typename S>
__device__ __forceinline__ void lane_row(
    const C* codes, const S* scales, const S* biases, const float* table,
    long long code_row, long long group_row, int lane, float (&x)[E]) {
    if constexpr (FMT == 0) {
        lane_plain<C, E>(codes + code_row, lane, x);
    } else {
        const unsigned char* row = reinterpret_cast<const unsigned char*>(codes + code_row);
        unsigned int c[E];
        if constexpr (FMT == 2 && BITS == 8) {
            unsigned char bytes[E];
            load_bytes<E>(row + lane * E, bytes);
            #pragma unroll
            for (int j = 0; j < E; ++j) c[j] = bytes[j];
        } else {
            lane_codes<E, BITS>(row, lane, c);
        }
        // E divides GROUP: a lane's elements share one group.
        const int g = lane * E / GROUP;
        const float scale = static_cast<float>(scales[group_row + g]);
        float bias = 0.0f;
        if constexpr (FMT != 3) bias = static_cast<float>(biases[group_row + g]);
        #pragma unroll
        for (int j = 0; j < E; ++j) {
            if constexpr (FMT == 1) {
                // AFF-6: T(T(code * scale) + bias).
                x[j] = rounded<S>(__fadd_rn(rounded<S>(__fmul_rn((float)c[j], scale)), bias));
            } else if constexpr (FMT == 2) {
                // TQ-5: (code + zero) * scale; 8-bit codes are signed.
                const float code = BITS == 8 ? (float)(int)(signed char)c[j] : (float)c[j];
                x[j] = __fmul_rn(__fadd_rn(code, bias), scale);
            } else {
                // TQ-8: centroid * scale, left rotated.
                x[j] = __fmul_rn(table[c[j]], scale);
            }
        }
    }
}

}  // namespace kvspec_attn
"""

# Pass 1. Inputs: q [B, Hq, 1, DK]; per side codes, scales, biases (a one-element
# placeholder where a format has none); the value codebook; scale (float32 [1]).
# Outputs: partial sums [B * Hq, SPLITS, DV] and (max, sum) [B * Hq, SPLITS, 2].
_PARTIAL_SOURCE = r"""
    using namespace kvspec_attn;
    constexpr int EK = DK / 32;
    constexpr int EV = DV / 32;
    constexpr float LOG2E = 1.4426950408889634f;
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

    const float factor = scale[0] * LOG2E;
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
        m[g] = -inf;
        l[g] = 0.0f;
        #pragma unroll
        for (int j = 0; j < EV; ++j) acc[g][j] = 0.0f;
    }

    // Rows of head (b, h); a placeholder's strides are never used (format PLAIN).
    const long long k_base = b * k_codes_strides[0] + h * k_codes_strides[1];
    const long long ks_base = KFMT == 0 ? 0 : b * k_scales_strides[0] + h * k_scales_strides[1];
    const long long v_base = b * v_codes_strides[0] + h * v_codes_strides[1];
    const long long vs_base = VFMT == 0 ? 0 : b * v_scales_strides[0] + h * v_scales_strides[1];

    for (int t = start + warp; t < end; t += WARPS) {
        float k[EK], v[EV];
        lane_row<KFMT, EK, KBITS, KGROUP>(
            k_codes, k_scales, k_biases, codebook,
            k_base + (long long)t * k_codes_strides[2],
            KFMT == 0 ? 0 : ks_base + (long long)t * k_scales_strides[2], lane, k);
        lane_row<VFMT, EV, VBITS, VGROUP>(
            v_codes, v_scales, v_biases, codebook,
            v_base + (long long)t * v_codes_strides[2],
            VFMT == 0 ? 0 : vs_base + (long long)t * v_scales_strides[2], lane, v);
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            float dot = 0.0f;
            #pragma unroll
            for (int j = 0; j < EK; ++j) dot += q[g][j] * k[j];
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
            const float m_new = fmaxf(m[g], dot);
            const float alpha = exp2f(m[g] - m_new);
            const float p = exp2f(dot - m_new);
            l[g] = l[g] * alpha + p;
            #pragma unroll
            for (int j = 0; j < EV; ++j) acc[g][j] = acc[g][j] * alpha + p * v[j];
            m[g] = m_new;
        }
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
        float top = -inf;
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
    float top = -inf;
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


@cache
def _partial_kernel(shared_bytes: int) -> object:
    # The dynamic shared memory is fixed per kernel object: one per (G, DV).
    return mx.fast.cuda_kernel(
        name="kvspec_decode_attention",
        input_names=[
            "queries",
            "k_codes",
            "k_scales",
            "k_biases",
            "v_codes",
            "v_scales",
            "v_biases",
            "table",
            "scale",
        ],
        output_names=["partial", "stats"],
        source=_PARTIAL_SOURCE,
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
    be strided along T), and for coded formats their group fields [B, H, T, D / group].

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
    """Whether the kernels take this read: a CUDA device, head dims they are built for,
    at most MAX_GROUP query heads per KV head, rows contiguous in their last axis."""
    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        return False
    kv_heads = keys.codes.shape[1]
    if query_heads % kv_heads != 0 or query_heads // kv_heads > MAX_GROUP:
        return False
    if keys.dim not in HEAD_DIMS or values.dim not in HEAD_DIMS:
        return False
    return all(
        a is None or a.strides[-1] == 1
        for side in (keys, values)
        for a in (side.codes, side.scales, side.biases)
    )


def _splits(T: int, blocks_per_split: int) -> int:
    # Enough blocks to fill the GPU; no split shorter than MIN_SPLIT positions.
    wanted = max(1, math.ceil(1024 / blocks_per_split))
    return max(1, min(MAX_SPLITS, wanted, math.ceil(T / MIN_SPLIT)))


_PLACEHOLDER = {}


def _placeholder(dtype: mx.Dtype) -> mx.array:
    if dtype not in _PLACEHOLDER:
        _PLACEHOLDER[dtype] = mx.zeros((1, 1, 1, 1), dtype)
    return _PLACEHOLDER[dtype]


def decode_attention(
    queries: mx.array,
    keys: StoredSide,
    values: StoredSide,
    scale: float,
    table: mx.array | None,
    signs: mx.array | None,
    out_dtype: mx.Dtype,
) -> mx.array:
    """READ-7: the attention of queries [B, Hq, 1, Dk] over every stored row, [B, Hq, 1, Dv]
    in `out_dtype`. `table` is the value codebook and `signs` the sign vector of Dv for
    TURBO_VALUE (the output is unrotated); None otherwise. Call only when `supported`."""
    B, Hq, N, _ = queries.shape
    _, Hk, T, _ = keys.codes.shape
    G = Hq // Hk
    DK, DV = keys.dim, values.dim
    rotated = values.fmt == TURBO_VALUE
    splits = _splits(T, B * Hk)
    threads = WARPS * 32
    shared = (WARPS * G * DV + 2 * WARPS * G) * 4
    codebook = table if table is not None else _placeholder(mx.float32)

    def fields(side: StoredSide) -> list[mx.array]:
        if side.fmt == PLAIN:
            filler = _placeholder(side.codes.dtype)
            return [side.codes, filler, filler]
        return [side.codes, side.scales, side.biases]

    partial, stats = _partial_kernel(shared)(
        inputs=[
            queries,
            *fields(keys),
            *fields(values),
            codebook,
            mx.array([scale], mx.float32),
        ],
        template=[
            # The operand dtypes name the instance (one NVRTC compile per combination).
            ("QT", queries.dtype),
            ("KC", keys.codes.dtype),
            ("VC", values.codes.dtype),
            ("KS", (keys.scales if keys.scales is not None else keys.codes).dtype),
            ("VS", (values.scales if values.scales is not None else values.codes).dtype),
            ("DK", DK),
            ("DV", DV),
            ("G", G),
            ("WARPS", WARPS),
            ("KFMT", keys.fmt),
            ("KBITS", keys.bits),
            ("KGROUP", keys.group_size or 32),
            ("VFMT", values.fmt),
            ("VBITS", values.bits),
            ("VGROUP", values.group_size or 32),
            ("TABLE", codebook.size),
        ],
        grid=(splits * threads, B * Hk, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B * Hq, splits, DV), (B * Hq, splits, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (out,) = _merge_kernel()(
        inputs=[partial, stats, signs if signs is not None else _placeholder(mx.float32)],
        template=[
            ("DV", DV),
            ("ROTATED", rotated),
            ("OT", out_dtype),
            ("INV_SQRT_BITS", INV_SQRT_BITS.get(DV, 0)),
        ],
        grid=(B * Hq * DV, 1, 1),
        threadgroup=(DV, 1, 1),
        output_shapes=[(B, Hq, N, DV)],
        output_dtypes=[out_dtype],
    )
    return out
