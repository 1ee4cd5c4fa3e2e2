// The CUDA a custom kernel of the accelerated backend uses, on the host: what
// conformance/emulated_cuda.py compiles a kernel's source against to run it on a CPU.
//
// Each thread of a block runs as a fiber of one host thread, the blocks one after the
// other. A fiber runs until it reaches a barrier (__syncthreads, or a warp's collective:
// shuffles, votes, MMAs, __syncwarp) and yields there; a barrier opens once every live
// thread of the block (of the warp) has reached it, and a warp's collective waits for all
// 32 lanes. So the kernel's synchronisation is exercised, though not its timing: a race
// the barriers do not order may go unseen. Barriers that can never open (a thread waiting
// where others have exited or wait elsewhere) stop the launch with an error.
//
// Arithmetic is IEEE single precision without contraction (the kernels write the
// roundings they depend on with __fmul_rn and kin); float16 and bfloat16 round to nearest
// even. The MMAs sum exact products in double precision and round once, the TF32 one
// after cutting its operands to their top 19 bits, as the tensor cores read them;
// ex2.approx is exp2f with subnormal inputs and results flushed to zero.
#pragma once

#include <algorithm>
#include <cmath>
#include <math.h>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <type_traits>
#include <unistd.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __shared__ static
#define __restrict__ __restrict
#define __grid_constant__
#define __launch_bounds__(...)
// The slot variant's header redefines __global__ with CUDA's own spelling of it
// (attention_kernels._slot_bounds).
#define __location__(...)
#define __align__(n) alignas(n)

struct uint3 {
    unsigned int x, y, z;
};
using dim3 = uint3;
constexpr int warpSize = 32;

// The calling thread's indices, set by the runtime whenever a fiber resumes.
inline uint3 threadIdx, blockIdx, blockDim, gridDim;

// Vector types aligned as CUDA's are: the checked build faults a load that is not.
struct alignas(8) float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned int x, y;
};
struct alignas(16) uint4 {
    unsigned int x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
    return {x, y, z, w};
}

// ---- bit casts and IEEE single precision, correctly rounded ----

template <typename To, typename From>
inline To emulated_bit_cast(From from) {
    static_assert(sizeof(To) == sizeof(From));
    To to;
    memcpy(&to, &from, sizeof(To));
    return to;
}
inline float __uint_as_float(unsigned int x) { return emulated_bit_cast<float>(x); }
inline float __int_as_float(int x) { return emulated_bit_cast<float>(x); }
inline unsigned int __float_as_uint(float x) { return emulated_bit_cast<unsigned int>(x); }

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
using std::isfinite;
using std::isinf;
using std::isnan;
using std::sqrt;

// CUDA's min and max take any two arithmetic operands of one type after promotion.
template <typename A, typename B>
inline auto min(A a, B b) -> decltype(a + b) {
    using C = decltype(a + b);
    return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <typename A, typename B>
inline auto max(A a, B b) -> decltype(a + b) {
    using C = decltype(a + b);
    return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int s) {
    // Byte n of the result is byte (s >> 4 n) & 7 of the 8 bytes y:x.
    const unsigned long long bytes = (static_cast<unsigned long long>(y) << 32) | x;
    unsigned int out = 0;
    for (int n = 0; n < 4; ++n) {
        const unsigned int pick = (s >> (4 * n)) & 7u;
        out |= static_cast<unsigned int>((bytes >> (8 * pick)) & 0xFFu) << (8 * n);
    }
    return out;
}

// ---- 16-bit floats: bits, and conversions rounded to nearest even ----

struct __half;
struct __nv_bfloat16;
inline float __half2float(__half h);
inline __half __float2half_rn(float f);
inline float __bfloat162float(__nv_bfloat16 h);
inline __nv_bfloat16 __float2bfloat16_rn(float f);

struct __half {
    uint16_t x;
    __half() = default;
    __half(float f);
    operator float() const;
};
struct __nv_bfloat16 {
    uint16_t x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f);
    operator float() const;
};
struct alignas(4) __half2 {
    __half x, y;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline float __half2float(__half h) {
    _Float16 value;
    memcpy(&value, &h.x, 2);
    return static_cast<float>(value);
}
inline __half emulated_half_of(double d) {
    // One rounding: `d` is exact where callers pass a product or sum of float16 values.
    const _Float16 value = static_cast<_Float16>(d);
    __half h;
    memcpy(&h.x, &value, 2);
    return h;
}
inline __half __float2half_rn(float f) { return emulated_half_of(static_cast<double>(f)); }
inline __half::__half(float f) : x(__float2half_rn(f).x) {}
inline __half::operator float() const { return __half2float(*this); }

inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(uint32_t(h.x) << 16); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const uint32_t bits = __float_as_uint(f);
    __nv_bfloat16 h;
    if (f != f) {
        h.x = static_cast<uint16_t>((bits >> 16) | 0x40u);  // a quiet NaN
    } else {
        h.x = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
    }
    return h;
}
inline __nv_bfloat16::__nv_bfloat16(float f) : x(__float2bfloat16_rn(f).x) {}
inline __nv_bfloat16::operator float() const { return __bfloat162float(*this); }

inline __half __ushort_as_half(unsigned short x) {
    __half h;
    h.x = x;
    return h;
}
inline __half __low2half(__half2 pair) { return pair.x; }
inline __half __high2half(__half2 pair) { return pair.y; }
inline float2 __half22float2(__half2 pair) {
    return {__half2float(pair.x), __half2float(pair.y)};
}
inline __half2 __floats2half2_rn(float a, float b) {
    return {__float2half_rn(a), __float2half_rn(b)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return {__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}

// bfloat16 from double precision: rounded to odd in float32 first (its last bit set where
// anything below it was cut), which the rounding to bfloat16's 8 bits then leaves as one
// rounding of the exact value.
inline __nv_bfloat16 emulated_bfloat16_of(double d) {
    float f = static_cast<float>(d);
    if (std::isfinite(f) && static_cast<double>(f) != d) {
        if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
        f = __uint_as_float(__float_as_uint(f) | 1u);
    }
    return __float2bfloat16_rn(f);
}
inline double emulated_wide(__half h) { return __half2float(h); }
inline double emulated_wide(__nv_bfloat16 h) { return __bfloat162float(h); }
inline __half emulated_rounded(double d, __half) { return emulated_half_of(d); }
inline __nv_bfloat16 emulated_rounded(double d, __nv_bfloat16) { return emulated_bfloat16_of(d); }

// Pair arithmetic of float16 or bfloat16: each half exact in double precision (products
// and sums of 16-bit values are), then one rounding.
template <typename P>
using EmulatedPair =
    std::enable_if_t<std::is_same_v<P, __half2> || std::is_same_v<P, __nv_bfloat162>, P>;
template <typename P, typename Op>
inline P emulated_pairwise(P a, P b, P c, Op op) {
    return {emulated_rounded(op(emulated_wide(a.x), emulated_wide(b.x), emulated_wide(c.x)), a.x),
            emulated_rounded(op(emulated_wide(a.y), emulated_wide(b.y), emulated_wide(c.y)), a.y)};
}
template <typename P>
inline EmulatedPair<P> __hadd2(P a, P b) {
    return emulated_pairwise(a, b, a, [](double x, double y, double) { return x + y; });
}
template <typename P>
inline EmulatedPair<P> __hsub2(P a, P b) {
    return emulated_pairwise(a, b, a, [](double x, double y, double) { return x - y; });
}
template <typename P>
inline EmulatedPair<P> __hmul2_rn(P a, P b) {
    return emulated_pairwise(a, b, a, [](double x, double y, double) { return x * y; });
}
template <typename P>
inline EmulatedPair<P> __hfma2(P a, P b, P c) {
    return emulated_pairwise(a, b, c, [](double x, double y, double z) { return x * y + z; });
}

// ---- atomics: one host thread runs every fiber, so each is a plain update ----

// The value takes the pointer's type, converted as CUDA's overloads convert it.
template <typename T, typename Op>
inline T emulated_update(T* at, T value, Op op) {
    const T old = *at;
    *at = op(old, value);
    return old;
}
template <typename T, typename V>
inline T atomicMax(T* at, V value) {
    return emulated_update(at, static_cast<T>(value), [](T x, T y) { return x < y ? y : x; });
}
template <typename T, typename V>
inline T atomicOr(T* at, V value) {
    return emulated_update(at, static_cast<T>(value), [](T x, T y) { return x | y; });
}

// ---- the fibers ----

namespace emulated {

struct Fiber {
    void* stack_pointer = nullptr;
    uint3 index{};
    bool done = false;
    unsigned int collectives = 0;  // warp collectives this thread has joined
};

struct Barrier {
    int arrived = 0;
    unsigned int generation = 0;
};

// Words each lane hands a collective: an MMA's A, B and C fragments at most.
constexpr int EXCHANGE_WORDS = 10;

struct Runtime {
    void (*body)(void* const*) = nullptr;
    void* const* arguments = nullptr;
    Fiber* fibers = nullptr;
    int count = 0;    // threads in a block
    int live = 0;     // threads of the block that have not returned
    int current = 0;  // the running thread
    int idle = 0;     // resumptions in a row that found their barrier closed
    int step = 1;     // the next thread to run: this many on (count - 1: the one before)
    void* launcher = nullptr;
    Barrier block;
    Barrier warps[32];
    int warp_live[32] = {};
    // Per warp, two sets of each lane's words: consecutive collectives use alternate sets,
    // so that a lane that has gone on does not overwrite what a slower one has yet to read.
    unsigned long long exchange[32][2][32][EXCHANGE_WORDS + 1] = {};
    const char* error = nullptr;
};

inline Runtime runtime;
inline unsigned char* dynamic_shared = nullptr;

extern "C" void emulated_switch(void** save, void* resume);
asm(R"(
.text
.globl emulated_switch
.type emulated_switch, @function
emulated_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emulated_switch, .-emulated_switch
)");

inline int linear(uint3 index) {
    return static_cast<int>(index.x + blockDim.x * (index.y + blockDim.y * index.z));
}
inline int lane() { return linear(threadIdx) % 32; }
inline int warp() { return linear(threadIdx) / 32; }

// Hand the host thread to the next thread of the block that has not returned (the
// launcher once none is left, or on an error); returns when this thread is resumed.
inline void yield_from(int self, bool returned) {
    Runtime& r = runtime;
    void* abandoned;
    void** save = returned ? &abandoned : &r.fibers[self].stack_pointer;
    if (r.live == 0 || r.error != nullptr) {
        emulated_switch(save, r.launcher);
        return;
    }
    int next = self;
    do {
        next = (next + r.step) % r.count;
    } while (r.fibers[next].done);
    if (next == self) return;
    r.current = next;
    threadIdx = r.fibers[next].index;
    emulated_switch(save, r.fibers[next].stack_pointer);
}

[[noreturn]] inline void fail(const char* message) {
    runtime.error = message;
    void* abandoned;
    emulated_switch(&abandoned, runtime.launcher);
    __builtin_unreachable();
}

inline void open(Barrier& barrier) {
    barrier.arrived = 0;
    ++barrier.generation;
}

// Wait at `barrier` until as many threads have reached it as `*live` counts (a count that
// falls as threads return: those do not wait).
inline void wait(Barrier& barrier, const int* live) {
    Runtime& r = runtime;
    const int self = r.current;
    const unsigned int generation = barrier.generation;
    r.idle = 0;
    if (++barrier.arrived == *live) {
        open(barrier);
        return;
    }
    while (barrier.generation == generation) {
        yield_from(self, false);
        if (barrier.generation == generation && ++r.idle > 2 * r.live + 2) {
            fail("a barrier no thread can open: the block's threads wait at different "
                 "barriers");
        }
    }
}

// This lane's words handed to its warp; once every live lane of the warp has handed its
// own, every lane's words, by lane, with the collective's number in word EXCHANGE_WORDS
// (a lane that did not join it holds another). The lanes a warp's collective names are
// all 32; a block of fewer threads, or lanes that have returned, leave some out: a
// collective of the rest, as a GPU runs it.
inline const unsigned long long (*exchange(unsigned int mask, const unsigned long long* mine,
                                           int words))[EXCHANGE_WORDS + 1] {
    Runtime& r = runtime;
    if (mask != 0xffffffffu) fail("a warp collective with a mask other than all 32 lanes");
    const int w = warp();
    const unsigned int number = ++r.fibers[r.current].collectives;
    unsigned long long* slot = r.exchange[w][number & 1][lane()];
    memcpy(slot, mine, words * sizeof(unsigned long long));
    slot[EXCHANGE_WORDS] = number;
    wait(r.warps[w], &r.warp_live[w]);
    return r.exchange[w][number & 1];
}

// Whether lane `source` joined the collective whose words are `words`.
inline bool joined(const unsigned long long (*words)[EXCHANGE_WORDS + 1], int source) {
    return words[source][EXCHANGE_WORDS] == runtime.fibers[runtime.current].collectives;
}

template <typename T>
inline unsigned long long word_of(T value) {
    static_assert(sizeof(T) <= 8);
    unsigned long long word = 0;
    memcpy(&word, &value, sizeof(T));
    return word;
}
template <typename T>
inline T value_of(unsigned long long word) {
    T value;
    memcpy(&value, &word, sizeof(T));
    return value;
}

template <typename T>
inline T shuffle(unsigned int mask, T value, int source) {
    const unsigned long long mine = word_of(value);
    const auto words = exchange(mask, &mine, 1);
    // A lane without a live thread gives an undefined value: NaN bits here, so that a
    // result that uses it shows.
    return value_of<T>(joined(words, source) ? words[source][0] : ~0ull);
}

inline unsigned int ballot(unsigned int mask, bool predicate) {
    const unsigned long long mine = predicate;
    const auto words = exchange(mask, &mine, 1);
    unsigned int bits = 0;
    for (int l = 0; l < 32; ++l) {
        if (joined(words, l)) bits |= static_cast<unsigned int>(words[l][0] & 1u) << l;
    }
    return bits;
}

inline double tf32_value(unsigned int bits) {
    return __uint_as_float(bits & 0xFFFFE000u);  // the top 19 bits: what tensor cores read
}
inline double bf16_value(unsigned int bits) { return __uint_as_float(bits << 16); }
inline double f16_value(unsigned int bits) {
    __half h;
    h.x = static_cast<uint16_t>(bits);
    return __half2float(h);
}

// d = A B + C for m16n8k16 (two 16-bit elements a register, the lower k in the low half)
// or m16n8k8 tf32, from each lane's a0..a3, b0..b1, c0..c3.
// ELEMENT reads one element's bits (a template argument: each call inlined).
template <int K, double (*ELEMENT)(unsigned int)>
inline void mma(float& d0, float& d1, float& d2, float& d3, const unsigned int (&a)[4],
                const unsigned int (&b)[2], const float (&c)[4]) {
    unsigned long long mine[EXCHANGE_WORDS];
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    for (int i = 0; i < 2; ++i) mine[4 + i] = b[i];
    for (int i = 0; i < 4; ++i) mine[6 + i] = __float_as_uint(c[i]);
    const auto words = exchange(0xffffffffu, mine, EXCHANGE_WORDS);
    for (int l = 0; l < 32; ++l) {
        if (!joined(words, l)) fail("an MMA in a warp without 32 live lanes");
    }
    auto a_at = [&](int row, int k) -> double {
        if constexpr (K == 16) {
            const int owner = (row % 8) * 4 + (k % 8) / 2;
            const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
            const unsigned int word = static_cast<unsigned int>(words[owner][reg]);
            return ELEMENT(k % 2 ? word >> 16 : word & 0xFFFFu);
        } else {
            const int owner = (row % 8) * 4 + k % 4;
            const int reg = (row >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0);
            return ELEMENT(static_cast<unsigned int>(words[owner][reg]));
        }
    };
    auto b_at = [&](int k, int col) -> double {
        if constexpr (K == 16) {
            const int owner = col * 4 + (k % 8) / 2;
            const unsigned int word = static_cast<unsigned int>(words[owner][4 + (k >= 8)]);
            return ELEMENT(k % 2 ? word >> 16 : word & 0xFFFFu);
        } else {
            const int owner = col * 4 + k % 4;
            return ELEMENT(static_cast<unsigned int>(words[owner][4 + (k >= 4)]));
        }
    };
    const int group = lane() / 4;
    const int pair = lane() % 4;
    float* out[4] = {&d0, &d1, &d2, &d3};
    for (int i = 0; i < 4; ++i) {
        const int row = group + (i >= 2 ? 8 : 0);
        const int col = 2 * pair + i % 2;
        double sum = 0.0;
        for (int k = 0; k < K; ++k) sum += a_at(row, k) * b_at(k, col);
        *out[i] = static_cast<float>(sum + static_cast<double>(c[i]));
    }
}

inline void fiber_main() {
    Runtime& r = runtime;
    r.body(r.arguments);
    const int self = r.current;
    r.fibers[self].done = true;
    --r.live;
    --r.warp_live[warp()];
    r.idle = 0;
    if (r.block.arrived > 0 && r.block.arrived == r.live) open(r.block);
    Barrier& warp_barrier = r.warps[warp()];
    if (warp_barrier.arrived > 0 && warp_barrier.arrived == r.warp_live[warp()]) {
        open(warp_barrier);
    }
    yield_from(self, true);
    __builtin_unreachable();
}

// Run the kernel `body` over the grid, block by block: nullptr, or what stopped it.
// Between two barriers the threads run one after another: in increasing order, or with
// `reversed` in decreasing order, so that a result that depends on which of two threads
// runs first (a race the barriers do not order) shows as two results.
inline const char* launch(void (*body)(void* const*), void* const* arguments,
                          const unsigned int* blocks, const unsigned int* threads,
                          unsigned char* shared, size_t stack_bytes, bool reversed) {
    Runtime& r = runtime;
    const int count = static_cast<int>(threads[0] * threads[1] * threads[2]);
    if (count < 1 || count > 1024) return "a block of more than 1024 threads, or none";
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    stack_bytes = (stack_bytes + page - 1) / page * page;
    const size_t span = static_cast<size_t>(count) * (stack_bytes + page);
    void* mapped = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED) return "no memory for the threads' stacks";
    unsigned char* stacks = static_cast<unsigned char*>(mapped);
    for (int t = 0; t < count; ++t) {
        mprotect(stacks + t * (stack_bytes + page), page, PROT_NONE);  // overflow faults
    }
    Fiber* fibers = new Fiber[count];
    r = Runtime{};
    r.body = body;
    r.arguments = arguments;
    r.fibers = fibers;
    r.count = count;
    r.step = reversed ? count - 1 : 1;
    dynamic_shared = shared;
    blockDim = {threads[0], threads[1], threads[2]};
    gridDim = {blocks[0], blocks[1], blocks[2]};
    const char* error = nullptr;
    for (unsigned int bz = 0; bz < blocks[2] && error == nullptr; ++bz) {
        for (unsigned int by = 0; by < blocks[1] && error == nullptr; ++by) {
            for (unsigned int bx = 0; bx < blocks[0] && error == nullptr; ++bx) {
                blockIdx = {bx, by, bz};
                r.live = count;
                r.block = Barrier{};
                for (int w = 0; w < 32; ++w) {
                    r.warps[w] = Barrier{};
                    r.warp_live[w] = std::max(0, std::min(32, count - 32 * w));
                }
                for (int t = 0; t < count; ++t) {
                    Fiber& fiber = fibers[t];
                    fiber = Fiber{};
                    fiber.index = {t % threads[0], (t / threads[0]) % threads[1],
                                   t / (threads[0] * threads[1])};
                    unsigned char* top = stacks + (t + 1) * (stack_bytes + page);
                    void** frame = reinterpret_cast<void**>(top);
                    *--frame = nullptr;  // fiber_main's return address: it never returns
                    *--frame = reinterpret_cast<void*>(&fiber_main);
                    for (int saved = 0; saved < 6; ++saved) *--frame = nullptr;
                    fiber.stack_pointer = frame;
                }
                r.current = reversed ? count - 1 : 0;
                threadIdx = fibers[r.current].index;
                emulated_switch(&r.launcher, fibers[r.current].stack_pointer);
                error = r.error;
            }
        }
    }
    delete[] fibers;
    munmap(mapped, span);
    return error;
}

}  // namespace emulated

// ---- the collectives ----

inline void __syncthreads() { emulated::wait(emulated::runtime.block, &emulated::runtime.live); }
inline void __syncwarp(unsigned int mask = 0xffffffffu) {
    const unsigned long long none = 0;
    emulated::exchange(mask, &none, 1);
}
template <typename T>
inline T __shfl_sync(unsigned int mask, T value, int source, int width = 32) {
    const int lane = emulated::lane();
    return emulated::shuffle(mask, value, (lane & ~(width - 1)) + (source & (width - 1)));
}
template <typename T>
inline T __shfl_xor_sync(unsigned int mask, T value, int lane_mask, int width = 32) {
    const int lane = emulated::lane();
    const int source = lane ^ lane_mask;
    const bool inside = (source & ~(width - 1)) == (lane & ~(width - 1));
    return emulated::shuffle(mask, value, inside ? source : lane);
}
template <typename T>
inline T __shfl_down_sync(unsigned int mask, T value, unsigned int delta, int width = 32) {
    const int lane = emulated::lane();
    const bool inside = (lane & (width - 1)) + static_cast<int>(delta) < width;
    return emulated::shuffle(mask, value, inside ? lane + static_cast<int>(delta) : lane);
}
template <typename T>
inline T __shfl_up_sync(unsigned int mask, T value, unsigned int delta, int width = 32) {
    const int lane = emulated::lane();
    const bool inside = (lane & (width - 1)) >= static_cast<int>(delta);
    return emulated::shuffle(mask, value, inside ? lane - static_cast<int>(delta) : lane);
}
inline unsigned int __ballot_sync(unsigned int mask, int predicate) {
    return emulated::ballot(mask, predicate != 0);
}
inline int __any_sync(unsigned int mask, int predicate) {
    return emulated::ballot(mask, predicate != 0) != 0;
}
inline int __all_sync(unsigned int mask, int predicate) {
    return emulated::ballot(mask, predicate != 0) == 0xffffffffu;
}

// ---- the inline PTX the kernels hold, each statement rewritten as a call by mnemonic,
// its operands in the order the template names them ----

inline void emulated_asm_lop3_b32(unsigned int& d, unsigned int a, unsigned int b,
                                  unsigned int c, unsigned int lut) {
    // Bit i of d is bit (a_i b_i c_i) of the table, a the most significant.
    unsigned int out = 0;
    for (unsigned int row = 0; row < 8; ++row) {
        if (!((lut >> row) & 1u)) continue;
        const unsigned int pick_a = (row & 4u) ? a : ~a;
        const unsigned int pick_b = (row & 2u) ? b : ~b;
        const unsigned int pick_c = (row & 1u) ? c : ~c;
        out |= pick_a & pick_b & pick_c;
    }
    d = out;
}
inline void emulated_asm_ex2_approx_ftz_f32(float& y, float x) {
    const float flushed_x = std::fpclassify(x) == FP_SUBNORMAL ? 0.0f : x;
    const float result = std::exp2(flushed_x);
    y = std::fpclassify(result) == FP_SUBNORMAL ? 0.0f : result;
}
inline void emulated_asm_cvt_rna_tf32_f32(unsigned int& d, float x) {
    // Nearest TF32, ties away from zero: 10 fraction bits kept, in a float32's bits.
    const unsigned int bits = __float_as_uint(x);
    d = std::isfinite(x) ? (bits + 0x1000u) & 0xFFFFE000u : bits;
}
// The MMAs: D in %0..%3, A in %4..%7, B in %8..%9, C in %10..%13, as the kernels write them.
#define EMULATED_MMA(MNEMONIC, K, ELEMENT)                                                  \
    inline void emulated_asm_##MNEMONIC(float& d0, float& d1, float& d2, float& d3,        \
                                        unsigned int a0, unsigned int a1, unsigned int a2, \
                                        unsigned int a3, unsigned int b0, unsigned int b1, \
                                        float c0, float c1, float c2, float c3) {          \
        emulated::mma<K, ELEMENT>(d0, d1, d2, d3, {a0, a1, a2, a3}, {b0, b1},              \
                                  {c0, c1, c2, c3});                                       \
    }
EMULATED_MMA(mma_sync_aligned_m16n8k8_row_col_f32_tf32_tf32_f32, 8, emulated::tf32_value)
EMULATED_MMA(mma_sync_aligned_m16n8k16_row_col_f32_bf16_bf16_f32, 16, emulated::bf16_value)
EMULATED_MMA(mma_sync_aligned_m16n8k16_row_col_f32_f16_f16_f32, 16, emulated::f16_value)
#undef EMULATED_MMA

// MLX's Shape and Strides (mlx/backend/cuda/device/config.h: MAX_NDIM 10).
namespace mlx::core::cu {
constexpr int MAX_NDIM = 10;
template <typename T>
struct Dims {
    T values[MAX_NDIM];
    T operator[](int i) const { return values[i]; }
    T& operator[](int i) { return values[i]; }
};
using Shape = Dims<int32_t>;
using Strides = Dims<int64_t>;
}  // namespace mlx::core::cu
namespace cooperative_groups {}
