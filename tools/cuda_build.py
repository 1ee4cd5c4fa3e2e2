"""Every custom kernel the CUDA path launches for bench's kinds, built offline as MLX builds
it (nvcc in place of NVRTC, for the same architecture): the registers a thread, the bytes
spilled, the static shared memory of each kernel and the dynamic shared memory the path
launches it with, without a GPU; with --sass, the instructions of each kernel's main loop
(for a decode-attention pass, one chunk of positions) and the opcodes they are, from
cuobjdump's SASS.

MLX (0.32, `mlx/backend/cuda/custom_kernel.cpp`) writes a custom kernel's source as its
default header (MLX's device utilities), the kernel's header, then in namespace
mlx::core::cu a `__global__ void custom_kernel_NAME(...)` taking each input as `const T*`
followed by its Shape, Strides and ndim where the source names them (arrays of at least one
dimension), then each output as `T*`, with the source as its body; NVRTC compiles it for
the device's architecture (`sm_90a` on an H200). Here a short preamble stands in for MLX's
header (the kernels' files need only its Shape and Strides, MAX_NDIM = 10), and ptxas
reports what each compiled kernel uses. The kernels are the ones the path makes for a
prefill of PREFILL positions, an eager decode step, a left-padded batch's (the ordered
variant, which a ring's read takes once it wraps) and a compiled step (its slot variant,
ordered for a ring), 32 query heads over 8 KV heads, found by running the path with
stand-in kernels (`kvspec.conformance.stand_ins`).

    python tools/cuda_build.py                            # bench's step kinds, head dim 128
    python tools/cuda_build.py --kinds TurboQuant --head-dim 64 --keep /tmp/kernels
    python tools/cuda_build.py --quick                    # one small kernel
    python tools/cuda_build.py --kinds Quantized --sass   # and each main loop's instructions
    python tools/cuda_build.py --cuda-cores --sass        # the reads' CUDA-core bodies

cuobjdump comes with the CUDA toolkit, or from PyPI (`nvidia-cuda-cuobjdump` with
`nvidia-cuda-nvdisasm`, which the test extra installs on x86-64 Linux); --sass takes the one
on the PATH, else the package's.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path

import mlx.core as mx
from bench import KINDS, TARGET_KINDS, add_kinds_option, picked_kinds

from kvspec.accelerated.caches.compiled import compile_decode
from kvspec.conformance.stand_ins import KernelCall, cuda_path

#: Positions of the prefill (an encode of many positions) before the decode steps.
PREFILL = 64
#: The opcodes --sass prints of each main loop, the most frequent first.
OPCODES_SHOWN = 14
#: What stands in for MLX's default header (`mlx/backend/cuda/device/utils.cuh`, config.h).
PREAMBLE = """#include <cooperative_groups.h>
#include <cuda/std/array>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace mlx::core::cu {
constexpr int MAX_NDIM = 10;
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
"""


@dataclass(frozen=True)
class Usage:
    """What ptxas reports of one compiled kernel."""

    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    #: The dynamic shared memory the path launches a block with (the kernel's `shared_memory`).
    dynamic_shared_bytes: int
    #: Instructions of the kernel's main loop in its SASS (`main_loop`: 0 without a loop) and
    #: how many of each opcode it holds, most first; None unasked.
    loop_instructions: int | None = None
    loop_opcodes: dict[str, int] | None = None
    #: The whole kernel's floating-point instructions by opcode (ARITHMETIC); None unasked.
    arithmetic: dict[str, int] | None = None


def collect(
    kinds: Sequence[str], head_dim: int, tensor_cores: bool | None = None
) -> dict[str, KernelCall]:
    """The kernels the CUDA path makes for each kind: a prefill, an eager decode step, a
    padded batch's decode step and a compiled decode step, by kernel name; each read's pass 1
    in the body `tensor_cores` picks (the attend's argument: None, tensor cores where they
    take the read)."""
    scale = head_dim**-0.5
    with cuda_path() as launches:
        for kind in kinds:
            cache = KINDS[kind](PREFILL + 8)
            kv = mx.zeros((1, 8, PREFILL, head_dim), mx.bfloat16)
            one = mx.ones((1, 8, 1, head_dim), mx.bfloat16)
            queries = mx.ones((1, 32, 1, head_dim), mx.bfloat16)
            cache.append_window(kv, kv)
            cache.append_decode(one, one).attend(queries, scale, tensor_cores)
            padded = KINDS[kind](PREFILL + 8)
            padded.prepare(left_padding=[0, 1])
            two = [mx.concatenate([array, array]) for array in (kv, one, queries)]
            padded.append_window(two[0], two[0])
            padded.append_decode(two[1], two[1]).attend(two[2], scale, tensor_cores)

            def step_fn(traces: list, k: mx.array, v: mx.array, q: mx.array) -> list:
                return [
                    trace.append_decode(k, v).attend(q, scale, tensor_cores) for trace in traces
                ]

            compile_decode(step_fn, [cache])(one, one, queries)
        return dict(launches.kernels)


def kernel_source(call: KernelCall) -> str:
    """The kernel's whole CUDA source as MLX writes it, PREAMBLE for MLX's header."""
    parameters = [f"    {kind} {name}" for kind, name in call.parameters()]
    signature = ",\n".join(parameters)
    return (
        f"{PREAMBLE}{call.header}namespace mlx::core::cu {{\n\n"
        "namespace cg = cooperative_groups;\n\n"
        f"__global__ void custom_kernel_{call.name}(\n{signature}) {{\n"
        f"{call.source}\n}}\n\n}} // namespace mlx::core::cu\n"
    )


_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_SHARED = re.compile(r"(\d+) bytes smem")


#: One SASS instruction as cuobjdump prints it: its address, then its text up to the `;`.
_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
#: A branch and its target address.
_BRANCH = re.compile(r"\bBRA(?:\.\w+)*\s+(?:[^,]*,\s*)?(0x[0-9a-f]+)")
#: An instruction's predicate (`@P0`, `@!UP1`).
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


@dataclass(frozen=True)
class Loop:
    """A loop of a kernel's SASS: the instructions from the target of a backward branch to
    the branch, every path of a branch in it counted."""

    instructions: tuple[str, ...]

    @property
    def mmas(self) -> int:
        """Its tensor-core MMAs (HMMA)."""
        return sum(instruction.startswith("HMMA") for instruction in self.opcodes())

    def opcodes(self) -> list[str]:
        """Each instruction's opcode, its predicate left out."""
        return [_PREDICATE.sub("", text).split()[0] for text in self.instructions]


def loops(sass: str) -> list[Loop]:
    """Every loop of `sass` (cuobjdump -sass), in the order their branches come."""
    lines: list[tuple[int, str]] = []
    found_loops = []
    for line in sass.splitlines():
        found = _SASS_LINE.search(line)
        if found is None:
            continue
        address, text = int(found.group(1), 16), found.group(2).strip()
        lines.append((address, text))
        branch = _BRANCH.search(text)
        if branch is not None and int(branch.group(1), 16) < address:
            target = int(branch.group(1), 16)
            found_loops.append(Loop(tuple(t for at, t in lines if target <= at <= address)))
    return found_loops


def main_loop(sass: str) -> Loop | None:
    """A kernel's main loop: the shortest loop that holds a tensor-core MMA, where one does
    (a decode-attention pass: one chunk of positions; a branch back from a block the
    compiler placed after the loop makes a longer one around it), else the longest loop;
    None without a loop."""
    found = loops(sass)
    with_mmas = [loop for loop in found if loop.mmas]
    if with_mmas:
        return min(with_mmas, key=lambda loop: len(loop.instructions))
    return max(found, key=lambda loop: len(loop.instructions), default=None)


@cache
def cuobjdump() -> str | None:
    """cuobjdump on the PATH, else the binary of PyPI's nvidia-cuda-cuobjdump
    (`nvidia/cu*/bin`, beside nvidia-cuda-nvdisasm's, which it runs); None where neither is."""
    found = shutil.which("cuobjdump")
    if found is not None:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in nvidia.__path__:
        for binary in sorted(Path(root).glob("cu*/bin/cuobjdump")):
            return str(binary)
    return None


def sass_of(cubin: Path) -> str:
    """A compiled kernel's SASS, as cuobjdump prints it."""
    binary = cuobjdump()
    if binary is None:
        raise RuntimeError("no cuobjdump: the CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump")
    done = subprocess.run([binary, "-sass", str(cubin)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"cuobjdump failed on {cubin.name}:\n{done.stderr[-2000:]}")
    return done.stdout


#: The opcodes that compute a read's floating-point values: products, sums and their fusions,
#: maxima, exp2 and the MMAs, in 32 and 16 bits (each with its modifiers). Not MUFU.RCP, which
#: an integer division takes too.
ARITHMETIC = ("FADD", "FFMA", "FMUL", "FMNMX", "MUFU.EX2", "HADD2", "HFMA2", "HMUL2", "HMMA")
#: A 16-bit fused product of zeros plus an immediate (`HFMA2.MMA R2, -RZ, RZ, 0, 1.2e-07`):
#: the compiler's way of moving a constant into a register, which computes nothing.
_CONSTANT_MOVE = re.compile(r"^HFMA2\S*\s+\w+,\s*-RZ,\s*RZ,")


def arithmetic(sass: str) -> dict[str, int]:
    """How many of each floating-point opcode of ARITHMETIC `sass` holds (constant moves
    left out)."""
    instructions = [
        _PREDICATE.sub("", found.group(2).strip())
        for found in map(_SASS_LINE.search, sass.splitlines())
        if found is not None
    ]
    opcodes = [
        instruction.split()[0]
        for instruction in instructions
        if not _CONSTANT_MOVE.match(instruction)
    ]
    computing = [op for op in opcodes if any(op == a or op.startswith(f"{a}.") for a in ARITHMETIC)]
    return dict(sorted(Counter(computing).items()))


def build(call: KernelCall, arch: str, directory: Path, sass: bool = False) -> Usage:
    """Compile the kernel with nvcc (its source and cubin kept in `directory`) and read
    ptxas's report of it; with `sass`, its main loop too."""
    source = directory / f"{call.name}.cu"
    source.write_text(kernel_source(call))
    command = [
        "nvcc",
        "-cubin",
        f"-arch={arch}",
        "-std=c++17",
        # NVRTC compiles MLX's kernels with --device-as-default-execution-space, under
        # which the files' unannotated constexpr functions are device functions too.
        "--expt-relaxed-constexpr",
        "--resource-usage",
        "-o",
        str(directory / f"{call.name}.cubin"),
        str(source),
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed on {call.name}:\n{done.stderr[-4000:]}")
    report = done.stdout + done.stderr
    registers = _REGISTERS.search(report)
    spills = _SPILLS.search(report)
    shared = _SHARED.search(report)
    if registers is None or spills is None:
        raise RuntimeError(f"no ptxas report for {call.name}:\n{report[-2000:]}")
    usage = Usage(
        call.name,
        int(registers.group(1)),
        int(spills.group(1)),
        int(spills.group(2)),
        int(shared.group(1)) if shared else 0,
        call.shared_memory,
    )
    if not sass:
        return usage
    sass_text = sass_of(directory / f"{call.name}.cubin")
    loop = main_loop(sass_text)
    opcodes = [] if loop is None else loop.opcodes()
    return replace(
        usage,
        loop_instructions=len(opcodes),
        loop_opcodes=dict(Counter(opcodes).most_common()),
        arithmetic=arithmetic(sass_text),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_kinds_option(parser, TARGET_KINDS)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arch", default="sm_90a", help="nvcc's -arch (MLX's on an H200)")
    parser.add_argument("--jobs", type=int, default=2, help="nvcc processes at once")
    parser.add_argument("--keep", help="write each kernel's .cu and .cubin here")
    parser.add_argument("--json", help="write the rows to this file")
    parser.add_argument(
        "--quick", action="store_true", help="only the smallest kernel of the first kind"
    )
    parser.add_argument(
        "--sass", action="store_true", help="each kernel's main loop, from cuobjdump"
    )
    parser.add_argument(
        "--cuda-cores",
        action="store_true",
        help="each read's pass 1 in the CUDA-core body (default: tensor cores where they fit)",
    )
    args = parser.parse_args(argv)
    kinds = picked_kinds(parser, args.kinds, TARGET_KINDS)
    if shutil.which("nvcc") is None:
        parser.error("nvcc is not on the PATH")
    if args.sass and cuobjdump() is None:
        parser.error("--sass needs cuobjdump: the CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump")
    tensor_cores = False if args.cuda_cores else None
    calls = collect(kinds[:1] if args.quick else kinds, args.head_dim, tensor_cores)
    if args.quick:
        smallest = min(calls.values(), key=lambda call: len(call.inputs))
        calls = {smallest.name: smallest}
    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(args.keep or scratch)
        directory.mkdir(parents=True, exist_ok=True)
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            usages = list(
                pool.map(lambda call: build(call, args.arch, directory, args.sass), calls.values())
            )
    loop = f"  {'loop':>5}" if args.sass else ""
    header = f"{'kernel':96}  {'registers':>9}  {'spill st/ld B':>13}  {'smem B':>7}  {'dyn B':>6}"
    print(header + loop)
    for usage in sorted(usages, key=lambda usage: usage.kernel):
        spills = f"{usage.spill_stores}/{usage.spill_loads}"
        loop = f"  {usage.loop_instructions:5d}" if args.sass else ""
        print(
            f"{usage.kernel:96}  {usage.registers:9d}  {spills:>13}  {usage.shared_bytes:7d}"
            f"  {usage.dynamic_shared_bytes:6d}{loop}"
        )
    if args.sass:
        # What each main loop spends its instructions on (the most frequent opcodes).
        for usage in sorted(usages, key=lambda usage: usage.kernel):
            if usage.loop_opcodes:
                common = list(usage.loop_opcodes.items())[:OPCODES_SHOWN]
                counts = ", ".join(f"{count} {opcode}" for opcode, count in common)
                print(f"{usage.kernel}: {usage.loop_instructions} | {counts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": args.arch, "rows": [asdict(usage) for usage in usages]}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
