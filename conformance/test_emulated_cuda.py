"""The emulated CUDA (conformance/emulated_cuda.py) against what the PTX ISA and CUDA's
programming guide say of what it stands in for: warp shuffles and votes, the MMA fragment
layouts, 16-bit roundings, barriers that cannot open, strided inputs, unwritten outputs.
Without these, a kernel's pass under emulation would say nothing of its pass on a GPU."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from kvspec.conformance.emulated_cuda import asm_as_call, emulated_kernel, host_code  # noqa: E402

ALL = "0xffffffffu"


def launch(source: str, inputs: dict, outputs: dict, threads: int, blocks: int = 1, **kw):
    """Run `source` over `blocks` blocks of `threads` threads; outputs by name: (shape,
    dtype)."""
    kernel = emulated_kernel(
        "test_" + str(abs(hash(source)) % 10**8),
        list(inputs),
        list(outputs),
        source,
        **kw,
    )
    made = kernel(
        inputs=list(inputs.values()),
        output_shapes=[shape for shape, _ in outputs.values()],
        output_dtypes=[dtype for _, dtype in outputs.values()],
        grid=(threads * blocks, 1, 1),
        threadgroup=(threads, 1, 1),
    )
    return [np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a) for a in made]


@pytest.mark.parametrize("width", [32, 8])
def test_shuffles_read_the_lanes_cuda_names(width: int) -> None:
    source = f"""
    const int t = threadIdx.x;
    const int v = 100 * t;
    xor_out[t] = __shfl_xor_sync({ALL}, v, 5, {width});
    idx_out[t] = __shfl_sync({ALL}, v, 3, {width});
    down_out[t] = __shfl_down_sync({ALL}, v, 2, {width});
    up_out[t] = __shfl_up_sync({ALL}, v, 3, {width});
    """
    names = ["xor_out", "idx_out", "down_out", "up_out"]
    got = launch(source, {"unused": mx.zeros((1,))}, {n: ((64,), mx.int32) for n in names}, 64)
    lane = np.arange(64) % 32
    base = np.arange(64) - lane + (lane // width) * width  # the segment's first thread
    own = lane % width
    xor_src = np.where((own ^ 5) < width, base + (own ^ 5), np.arange(64))
    want = {
        "xor_out": 100 * xor_src,
        "idx_out": 100 * (base + 3 % width),
        "down_out": 100 * np.where(own + 2 < width, np.arange(64) + 2, np.arange(64)),
        "up_out": 100 * np.where(own >= 3, np.arange(64) - 3, np.arange(64)),
    }
    for name, array in zip(names, got, strict=True):
        np.testing.assert_array_equal(array, want[name], err_msg=name)


def test_votes_count_every_lane() -> None:
    source = f"""
    const int t = threadIdx.x;
    ballots[t] = __ballot_sync({ALL}, t % 3 == 0);
    anys[t] = __any_sync({ALL}, t == 37);
    alls[t] = __all_sync({ALL}, t != 5);
    """
    outputs = {n: ((64,), mx.uint32) for n in ("ballots", "anys", "alls")}
    ballots, anys, alls = launch(source, {"unused": mx.zeros((1,))}, outputs, 64)
    bits = [sum(1 << i for i in range(32) if (32 * w + i) % 3 == 0) for w in (0, 1)]
    np.testing.assert_array_equal(ballots, np.repeat(bits, 32))
    np.testing.assert_array_equal(anys, np.repeat([0, 1], 32))
    np.testing.assert_array_equal(alls, np.repeat([0, 1], 32))


def test_a_shuffle_from_a_lane_without_a_thread_is_nan() -> None:
    # A block of 16 threads: lanes 16..31 have none; what they would give is undefined.
    source = f"out[threadIdx.x] = __shfl_down_sync({ALL}, 1.0f, 8);"
    (out,) = launch(source, {"unused": mx.zeros((1,))}, {"out": ((16,), mx.float32)}, 16)
    np.testing.assert_array_equal(out[:8], 1.0)
    assert np.isnan(out[8:]).all()


MMA_SOURCE = """
    // A (16 x K) and B (K x 8) from row-major inputs into lane l's registers as the PTX
    // ISA lays out mma.m16n8k{K}; D back to a row-major output.
    const int l = threadIdx.x, g = l / 4, c = l % 4;
    unsigned int a[4], b[2];
    float d[4] = {cin[g * 8 + 2 * c], cin[g * 8 + 2 * c + 1],
                  cin[(g + 8) * 8 + 2 * c], cin[(g + 8) * 8 + 2 * c + 1]};
    BODY
    out[g * 8 + 2 * c] = d[0];
    out[g * 8 + 2 * c + 1] = d[1];
    out[(g + 8) * 8 + 2 * c] = d[2];
    out[(g + 8) * 8 + 2 * c + 1] = d[3];
"""
SIXTEEN_BIT = """
    auto pair = [](const unsigned short* m, int i, int j) {
        return (unsigned int)m[i] | ((unsigned int)m[j] << 16);
    };
    a[0] = pair(abits, g * 16 + 2 * c, g * 16 + 2 * c + 1);
    a[1] = pair(abits, (g + 8) * 16 + 2 * c, (g + 8) * 16 + 2 * c + 1);
    a[2] = pair(abits, g * 16 + 2 * c + 8, g * 16 + 2 * c + 9);
    a[3] = pair(abits, (g + 8) * 16 + 2 * c + 8, (g + 8) * 16 + 2 * c + 9);
    b[0] = pair(bbits, (2 * c) * 8 + g, (2 * c + 1) * 8 + g);
    b[1] = pair(bbits, (2 * c + 8) * 8 + g, (2 * c + 9) * 8 + g);
    asm("mma.sync.aligned.m16n8k16.row.col.f32.TYPE.TYPE.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
"""
TF32 = """
    a[0] = abits[g * 8 + c];
    a[1] = abits[(g + 8) * 8 + c];
    a[2] = abits[g * 8 + c + 4];
    a[3] = abits[(g + 8) * 8 + c + 4];
    b[0] = bbits[c * 8 + g];
    b[1] = bbits[(c + 4) * 8 + g];
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
"""


@pytest.mark.parametrize("kind", ["bf16", "f16", "tf32"])
def test_mmas_multiply_the_fragments_ptx_lays_out(kind: int) -> None:
    rng = np.random.default_rng(3)
    k = 8 if kind == "tf32" else 16
    a = rng.standard_normal((16, k)).astype(np.float32)
    b = rng.standard_normal((k, 8)).astype(np.float32)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    if kind == "tf32":
        # Low bits the tensor cores do not read: the product must not see them.
        a_bits = a.view(np.uint32) | np.uint32(0x1FFF)
        b_bits = b.view(np.uint32) | np.uint32(0x1FFF)
        a = (a_bits & np.uint32(0xFFFFE000)).view(np.float32)
        b = (b_bits & np.uint32(0xFFFFE000)).view(np.float32)
        body = TF32
        inputs = {"abits": mx.array(a_bits.ravel()), "bbits": mx.array(b_bits.ravel())}
    else:
        dtype = ml_dtypes.bfloat16 if kind == "bf16" else np.float16
        a, b = a.astype(dtype), b.astype(dtype)
        body = SIXTEEN_BIT.replace("TYPE", kind)
        inputs = {
            "abits": mx.array(a.view(np.uint16).ravel()),
            "bbits": mx.array(b.view(np.uint16).ravel()),
        }
    inputs["cin"] = mx.array(c.ravel())
    source = MMA_SOURCE.replace("BODY", body).replace("{K}", str(k))
    (out,) = launch(source, inputs, {"out": ((128,), mx.float32)}, 32)
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(out.reshape(16, 8), want, rtol=1e-6, atol=1e-6)


def test_sixteen_bit_conversions_round_to_nearest_even() -> None:
    values = np.array(
        [
            1.0 + 2.0**-8,  # a bfloat16 tie: stays 1
            1.0 + 3 * 2.0**-8,  # a tie: rounds up to even
            1.0 + 2.0**-11,  # a float16 tie
            65520.0,  # float16 overflows
            2.0**-25,  # float16 subnormal tie: 0
            3 * 2.0**-26,
            np.inf,
            -0.0,
            np.nan,
            1e-40,  # a float32 subnormal
        ],
        np.float32,
    )
    source = """
    const int t = threadIdx.x;
    bf[t] = __float2bfloat16_rn(x[t]);
    hf[t] = __float2half_rn(x[t]);
    """
    n = len(values)
    bf, hf = launch(
        source,
        {"x": mx.array(values)},
        {"bf": ((n,), mx.bfloat16), "hf": ((n,), mx.float16)},
        n,
    )
    want_bf = values.astype(ml_dtypes.bfloat16).view(np.uint16)
    got_bf = bf
    finite = ~np.isnan(values)
    np.testing.assert_array_equal(got_bf[finite], want_bf[finite])
    assert np.isnan(values.astype(ml_dtypes.bfloat16)[~finite]).all()
    with np.errstate(over="ignore"):  # 65520 overflows float16, as it should
        want_hf = values.astype(np.float16)
    np.testing.assert_array_equal(hf[finite], want_hf[finite])


def test_a_barrier_no_thread_can_open_stops_the_launch() -> None:
    # Lane 0 of the second warp waits for its warp; the rest of the block for the block.
    source = """
    if (threadIdx.x == 32) {
        __syncwarp();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
    """
    with pytest.raises(RuntimeError, match="barrier no thread can open"):
        launch(source, {"unused": mx.zeros((1,))}, {"out": ((64,), mx.float32)}, 64)


def test_returned_threads_do_not_hold_a_barrier() -> None:
    source = """
    __shared__ float seen[64];
    if (threadIdx.x >= 40) return;
    seen[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = seen[39 - threadIdx.x];
    """
    (out,) = launch(source, {"unused": mx.zeros((1,))}, {"out": ((64,), mx.float32)}, 64)
    np.testing.assert_array_equal(out[:40], np.arange(39, -1, -1))
    assert np.isnan(out[40:]).all()  # outputs start as NaN bytes


def test_strided_inputs_come_padded() -> None:
    x = mx.arange(24, dtype=mx.float32).reshape(2, 3, 4)
    reads_strides = """
    const int t = threadIdx.x, i = t / 12, j = (t / 4) % 3, k = t % 4;
    out[t] = x[i * x_strides[0] + j * x_strides[1] + k * x_strides[2]];
    """
    ignores_strides = "out[threadIdx.x] = x[threadIdx.x]; (void)x_strides;"
    outputs = {"out": ((24,), mx.float32)}
    (good,) = launch(reads_strides, {"x": x}, outputs, 24, ensure_row_contiguous=False)
    np.testing.assert_array_equal(good, np.arange(24))
    (bad,) = launch(ignores_strides, {"x": x}, outputs, 24, ensure_row_contiguous=False)
    assert np.isnan(bad).any()
    (plain,) = launch(ignores_strides, {"x": x}, outputs, 24)
    np.testing.assert_array_equal(plain, np.arange(24))


def test_dynamic_shared_memory_and_blocks() -> None:
    source = """
    extern __shared__ __align__(16) float shared[];
    shared[threadIdx.x] = blockIdx.x * 10 + threadIdx.x;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = shared[blockDim.x - 1 - threadIdx.x];
    """
    (out,) = launch(
        source,
        {"unused": mx.zeros((1,))},
        {"out": ((96,), mx.float32)},
        32,
        blocks=3,
        shared_memory=32 * 4,
    )
    want = [10 * b + 31 - t for b in range(3) for t in range(32)]
    np.testing.assert_array_equal(out, want)


def test_inline_ptx_becomes_a_call_by_mnemonic() -> None:
    statement = 'asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(out) : "r"(x), "n"(MASK), "r"(m))'
    assert host_code(statement) == "emulated_asm_lop3_b32(out, x, MASK, m, 0xEAu)"
    mma = (
        '"mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "\n'
        '"{%0, %1}, {%2}, {%3}, {%0, %1};" : "+f"(d[0]), "+f"(d[1]) : "r"(a), "r"(b)'
    )
    assert asm_as_call(mma) == (
        "emulated_asm_mma_sync_aligned_m16n8k8_row_col_f32_tf32_tf32_f32"
        "(d[0], d[1], a, b, d[0], d[1])"
    )


def test_lop3_and_ex2_and_tf32_rounding() -> None:
    source = """
    const int t = threadIdx.x;
    unsigned int r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;"
        : "=r"(r) : "r"(bits[t]), "n"(0x0F0F0F0Fu), "r"(0x30000000u));
    lop[t] = r;
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x[t]));
    ex2[t] = y;
    unsigned int tf;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(tf) : "f"(x[t]));
    tf32[t] = tf;
    """
    bits = np.array([0x12345678, 0xFFFFFFFF, 0, 0xA5A5A5A5], np.uint32)
    x = np.array([3.0, -130.0, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11], np.float32)
    lop, ex2, tf32 = launch(
        source,
        {"bits": mx.array(bits), "x": mx.array(x)},
        {"lop": ((4,), mx.uint32), "ex2": ((4,), mx.float32), "tf32": ((4,), mx.uint32)},
        4,
    )
    np.testing.assert_array_equal(lop, (bits & 0x0F0F0F0F) | 0x30000000)
    np.testing.assert_array_equal(ex2[:2], [8.0, 0.0])
    np.testing.assert_allclose(ex2[2:], np.exp2(x[2:].astype(np.float64)), rtol=2e-7)
    # Ties go away from zero: 1 + 2^-11 up to 1 + 2^-10, 1 + 3 2^-11 up to 1 + 2^-9.
    np.testing.assert_array_equal(tf32.view(np.float32), [3.0, -130.0, 1 + 2.0**-10, 1 + 2.0**-9])


RACE = """
    __shared__ float seen[64];
    seen[threadIdx.x] = threadIdx.x;
    BARRIER
    out[threadIdx.x] = seen[(threadIdx.x + 1) % 64];
"""


def test_the_two_orders_show_a_race_the_barriers_do_not_order() -> None:
    # Without the barrier, thread t reads what thread t + 1 has yet to write in one order
    # and has written in the other.
    def both(source: str) -> list[np.ndarray]:
        outputs = {"out": ((64,), mx.float32)}
        return [
            launch(source, {"unused": mx.zeros((1,))}, outputs, 64, reversed_order=order)[0]
            for order in (False, True)
        ]

    forward, backward = both(RACE.replace("BARRIER", ""))
    assert not np.array_equal(forward, backward, equal_nan=True)
    forward, backward = both(RACE.replace("BARRIER", "__syncthreads();"))
    np.testing.assert_array_equal(forward, (np.arange(64) + 1) % 64)
    np.testing.assert_array_equal(backward, forward)


def test_a_misaligned_vector_load_fails_the_launch() -> None:
    # A GPU faults on a 16-byte load from an address 16 does not divide; the CPU would not.
    source = """
    const unsigned char* bytes = reinterpret_cast<const unsigned char*>(x);
    const uint4 word = *reinterpret_cast<const uint4*>(bytes + 16 * threadIdx.x + OFFSET);
    out[threadIdx.x] = word.x;
    """
    inputs = {"x": mx.zeros((64,), mx.uint32)}
    outputs = {"out": ((4,), mx.uint32)}
    (aligned,) = launch(source.replace("OFFSET", "16"), inputs, outputs, 4)
    np.testing.assert_array_equal(aligned, 0)
    with pytest.raises(RuntimeError, match="misaligned address"):
        launch(source.replace("OFFSET", "4"), inputs, outputs, 4)


def test_the_build_cache_keeps_its_limit_dropping_the_least_recently_used(tmp_path) -> None:
    from kvspec.conformance.emulated_cuda import prune

    sizes = {"a": 300, "b": 200, "c": 400, "d": 100}
    for age, (name, size) in enumerate(sizes.items()):
        library = tmp_path / f"{name}.so"
        library.write_bytes(b"\0" * size)
        os.utime(library, ns=(age * 10**9, age * 10**9))  # a oldest, d newest
    (tmp_path / "notes.txt").write_text("not a build")
    prune(tmp_path, 500, keep=tmp_path / "a.so")
    # b (200) and c (400) go, oldest first past the kept one: a and d (400) are left.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.so", "d.so", "notes.txt"]
    prune(tmp_path, 0, keep=tmp_path / "d.so")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.so", "notes.txt"]


def test_a_build_is_touched_when_used_and_the_cache_pruned_when_it_grows(
    tmp_path, monkeypatch
) -> None:
    from kvspec.conformance import emulated_cuda

    monkeypatch.setenv(emulated_cuda.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(emulated_cuda.CACHE_LIMIT_ENV, "0")
    stale = tmp_path / "stale.so"
    stale.write_bytes(b"\0" * 64)
    os.utime(stale, ns=(0, 0))
    emulated_cuda.built.cache_clear()  # each build is loaded once a process
    source = "out[threadIdx.x] = 2.0f;"
    (out,) = launch(source, {"unused": mx.zeros((1,))}, {"out": ((4,), mx.float32)}, 4)
    np.testing.assert_array_equal(out, 2.0)
    (kept,) = tmp_path.glob("*.so")  # the stale build went; the new one stays
    os.utime(kept, ns=(0, 0))
    emulated_cuda.built.cache_clear()
    launch(source, {"unused": mx.zeros((1,))}, {"out": ((4,), mx.float32)}, 4)
    assert kept.stat().st_mtime_ns > 0  # used again: touched, not rebuilt
    monkeypatch.setenv(emulated_cuda.CACHE_LIMIT_ENV, "lots")
    with pytest.raises(ValueError, match="whole number of MiB"):
        emulated_cuda.cache_limit()
