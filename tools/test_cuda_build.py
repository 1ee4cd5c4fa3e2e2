"""tools/cuda_build.py: the kernels the CUDA path makes are found on the CPU and written as
MLX writes them; where nvcc is on the PATH they compile, and every decode-attention pass of
bench's step kinds fits the blocks an SM that its split counts on (registers and shared
memory)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import bench
import cuda_build
import pytest

from kvspec.accelerated.attention_kernels import BLOCKS_PER_SM, WARPS
from kvspec.accelerated.cuda_source import cuda_type

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on the PATH")
needs_cuobjdump = pytest.mark.skipif(
    shutil.which("nvcc") is None or cuda_build.cuobjdump() is None,
    reason="no nvcc on the PATH, or no cuobjdump",
)
#: The shared memory of an H200's SM (compute capability 9.0: 228 KiB), and what the device
#: reserves of it for each resident block.
SM_SHARED = 228 * 1024
BLOCK_RESERVED = 1024

#: SASS as cuobjdump prints it: a loop of 5 instructions (0x0020 .. 0x0060) holding a
#: forward branch, one of 3 (0x0080 .. 0x00a0), and the closing branch to itself.
SASS = """
        /*0000*/                   S2R R0, SR_TID.X ;                 /* 0x0000000000007919 */
        /*0010*/                   ISETP.GE.AND P0, PT, R0, 0x8, PT ; /* 0x000000000000780c */
        /*0020*/                   IADD3 R0, R0, 0x1, RZ ;            /* 0x0000000100007810 */
        /*0030*/              @P0 BRA 0x50 ;                          /* 0x0000000000000947 */
        /*0040*/                   FADD R1, R1, R1 ;                  /* 0x0000000101017221 */
        /*0050*/                   ISETP.LT.AND P1, PT, R0, 0x20, PT ;
        /*0060*/              @P1 BRA 0x20 ;                          /* 0x0000000000001947 */
        /*0070*/                   NOP ;
        /*0080*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0090*/                   VIADD R4, R4, 0x4 ;
        /*00a0*/              @P1 BRA.U UR5, 0x80 ;
        /*00b0*/                   EXIT ;
        /*00c0*/                   BRA 0xc0;
"""


def test_the_path_makes_the_encode_pass_and_merge_of_each_step() -> None:
    calls = cuda_build.collect(["TurboQuantKVCache k8v4 dense"], 128)
    names = list(calls)
    assert any(name.startswith("kvspec_turboquant_encode") for name in names)
    passes = [name for name in names if name.startswith("kvspec_decode_attention")]
    assert sum("_slot_" in name for name in passes) == 1  # the compiled step's
    assert sum("_ordered_" in name for name in passes) == 1  # the padded batch's
    assert len(passes) == 3  # and the eager read's
    assert any(name.startswith("kvspec_decode_merge_rotated") for name in names)


def test_a_kernel_is_written_as_mlx_writes_it() -> None:
    calls = cuda_build.collect(["KVCache"], 64)
    call = next(call for name, call in calls.items() if "_slot_" in name)
    source = cuda_build.kernel_source(call)
    assert source.startswith(cuda_build.PREAMBLE + call.header)
    assert f"__global__ void custom_kernel_{call.name}(\n" in source
    for name, array in zip(call.input_names, call.inputs, strict=True):
        assert f"    const {cuda_type(array.dtype)}* {name}" in source
        # Shape and strides only where the body names them (MLX's rule).
        assert (f"Shape {name}_shape" in source) == (f"{name}_shape" in call.source)
    for name in call.output_names:
        assert f"* {name}" in source
    assert source.endswith(call.source + "\n}\n\n} // namespace mlx::core::cu\n")


@needs_nvcc
def test_quick_run_compiles_one_kernel(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    assert cuda_build.main(["--quick", "--keep", str(tmp_path), "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["registers"] > 0 and row["spill_stores"] >= 0
    assert (tmp_path / f"{row['kernel']}.cubin").stat().st_size > 0


#: The kinds whose passes the builds below hold: bench's target kinds, and the rings, which add
#: the ordered slot variant of their formats (their other passes are those of KVCache and
#: affine 4-bit).
BUILT_KINDS = [*bench.TARGET_KINDS, *bench.RING_KINDS]


@pytest.fixture(scope="module", params=["tensor-cores", "cuda-cores"])
def built_passes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list:
    """Every decode-attention pass of BUILT_KINDS in one body, compiled once for the tests
    below (with each kernel's SASS where cuobjdump is found)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on the PATH")
    out = tmp_path_factory.mktemp("build") / "rows.json"
    body = ["--cuda-cores"] if request.param == "cuda-cores" else []
    sass = ["--sass"] if cuda_build.cuobjdump() is not None else []
    assert cuda_build.main(["--kinds", *BUILT_KINDS, *body, *sass, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    return [row for row in rows if row["kernel"].startswith("kvspec_decode_attention")]


def test_every_attention_pass_fits_the_blocks_an_sm_its_split_counts_on(built_passes: list) -> None:
    """READ-7 on CUDA: the split (TARGET_BLOCKS) counts on BLOCKS_PER_SM blocks of WARPS
    warps resident per SM, in either body; a pass compiled to more registers a thread than
    an SM's 65536 allow for them runs a block fewer (the affine 8-bit slot variant did, at
    139; the tensor-core ordered variant's first version at 144 and 160; the CUDA-core
    ordered variant of affine 4-bit at 136 before it was bounded)."""
    # Eager, ordered and slot variants, and the rings' ordered slot variants.
    assert len(built_passes) == 3 * len(bench.TARGET_KINDS) + len(bench.RING_KINDS)
    ordered_slots = sum("_slot_ordered_" in row["kernel"] for row in built_passes)
    assert ordered_slots == len(bench.RING_KINDS)
    limit = 65536 // (BLOCKS_PER_SM * WARPS * 32)
    assert all(row["registers"] <= limit for row in built_passes), built_passes
    # And in an SM's shared memory: a block takes its static and dynamic bytes and the 1 KiB
    # the device reserves for each block.
    blocks = [
        row["shared_bytes"] + row["dynamic_shared_bytes"] + BLOCK_RESERVED for row in built_passes
    ]
    assert all(0 < block * BLOCKS_PER_SM <= SM_SHARED for block in blocks), built_passes


def test_a_loop_counts_every_instruction_from_its_target_to_its_branch() -> None:
    assert [len(loop.instructions) for loop in cuda_build.loops(SASS)] == [5, 3]
    # Without a tensor-core MMA the main loop is the longest.
    assert len(cuda_build.main_loop(SASS).instructions) == 5
    assert cuda_build.main_loop(SASS.split("/*0070*/")[1]).opcodes() == ["LDG.E", "VIADD", "BRA.U"]
    assert cuda_build.main_loop("") is None


def test_the_main_loop_is_the_shortest_that_holds_an_mma() -> None:
    """A decode-attention pass's chunk loop, not the longer loop that a block placed after
    it and branching back makes around it."""
    mma = SASS.replace("FADD R1, R1, R1", "HMMA.16816.F32 R4, R8, R12, R4")
    outer = mma.replace("/*00b0*/                   EXIT ;", "/*00b0*/              @P2 BRA 0x10 ;")
    sizes = sorted(len(loop.instructions) for loop in cuda_build.loops(outer))
    assert sizes == [3, 5, 11]
    main = cuda_build.main_loop(outer)
    assert main is not None and len(main.instructions) == 5 and main.mmas == 1
    assert main.opcodes().count("HMMA.16816.F32") == 1


@needs_cuobjdump
def test_each_attention_pass_has_a_main_loop(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    kinds = ["--kinds", "KVCache"]
    assert cuda_build.main([*kinds, "--sass", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    passes = [row for row in rows if row["kernel"].startswith("kvspec_decode_attention")]
    assert passes and all(row["loop_instructions"] > 100 for row in passes), passes
    # One chunk: its 8 positions' score and value MMAs at head dim 128.
    for row in passes:
        mmas = sum(count for opcode, count in row["loop_opcodes"].items() if "HMMA" in opcode)
        assert mmas == 16, row
        assert sum(row["loop_opcodes"].values()) == row["loop_instructions"], row


@needs_cuobjdump
def test_the_variants_of_a_read_compute_alike(built_passes: list) -> None:
    """READ-7, ROWS-6, COMPILE-4: pass 1's variants (counted, ordered, slot, ordered slot)
    differ in which rows they load and from where, not in how they compute: each format's
    variants compile to the same floating-point instructions, in either body. The suite
    holds their reads to one another bit for bit (a padded or wrapped read to a read in
    temporal order, a compiled read to the eager one) on the emulator, which builds without
    contraction; a product and sum that NVRTC fused in one variant and not another would
    part them on a GPU alone."""
    formats: dict[str, list[dict]] = {}
    for row in built_passes:
        name = re.sub(r"_(counted|slot|ordered)(?=_)", "", row["kernel"])
        formats.setdefault(name, []).append(row)
    # Plain and affine 4-bit rows (growable storage and rings alike) in four variants, affine
    # 8-bit and TurboQuant in three (no ring).
    assert sorted(len(variants) for variants in formats.values()) == [3, 3, 4, 4]
    for name, variants in formats.items():
        counts = [row["arithmetic"] for row in variants]
        assert counts[0] and all(count == counts[0] for count in counts), (name, counts)


def test_constant_moves_are_not_arithmetic() -> None:
    """The compiler moves constants into registers as 16-bit products of zeros; how many
    it moves differs between variants that compute alike."""
    moves = SASS.replace("NOP", "HFMA2.MMA R3, -RZ, RZ, 0, 1.1920928955078125e-07").replace(
        "EXIT", "@P1 HFMA2 R5, -RZ, RZ, 1.875, 0"
    )
    fused = SASS.replace("NOP", "HFMA2.MMA R3, R4, R5, -RZ")
    assert cuda_build.arithmetic(SASS) == {"FADD": 1}
    assert cuda_build.arithmetic(moves) == {"FADD": 1}
    assert cuda_build.arithmetic(fused) == {"FADD": 1, "HFMA2.MMA": 1}
