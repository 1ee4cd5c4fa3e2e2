"""The accelerated backend's CUDA kernels run on a CPU: each custom kernel's source, as MLX
would hand it to NVRTC, compiled by the host's C++ compiler against emulated_cuda.h and
launched on NumPy copies of its inputs. The kernels' CUDA path then computes on any
machine, so the tests that hold it on a GPU (tools/gpu_suite.py's) can run here too:
`emulated_cuda_path()` for a block, or `KVSPEC_EMULATED_CUDA=1` for a whole pytest session
(conformance/conftest.py).

What it holds and what it cannot:
- every thread of a block runs, each as a fiber; barriers and warp collectives (shuffles,
  votes, MMAs) are met by all the threads they name, or the launch fails. Fibers switch
  only at barriers, one after another in increasing order of thread, or in decreasing order
  (`emulated_cuda_path(reversed_order=True)`): a race the barriers do not order shows where
  the two orders give different outputs, and otherwise goes unseen;
- arithmetic is IEEE single precision without contraction, so the encoders, which spell
  every rounding (`__fmul_rn` and kin), store the bits they store on a GPU; the reads,
  whose sums the compiler may contract and the tensor cores order as they do, are held
  to READ-1's bound as on a GPU;
- what a GPU faults on or leaves undefined and a CPU would not is checked (UBSan, the
  reports taken from the launch's standard error): loads at addresses their type's
  alignment does not divide (a GPU's "misaligned address"), shifts past a word, signed
  overflow, indices past a fixed array. A report fails the launch;
- inputs a kernel reads through their strides (`ensure_row_contiguous=False`) are handed
  to it with every stride but the last one's padded, and outputs start as NaN bytes, so
  that a kernel reading a row at the wrong stride, or an output it did not write, reads
  garbage;
- an evaluation inside `mx.compile` cannot run one (the launch needs its inputs' values), so
  a compiled decode step (COMPILE-6) runs its traced graph as traced, uncompiled: its
  kernels (the slot variant among them) and ops are the compiled graph's, but what
  `mx.compile` does to a graph (its replays, fused MLX ops) is held on a GPU alone.

Each kernel is built once per source (cached in KVSPEC_EMULATED_CUDA_CACHE, by default
~/.cache/kvspec/emulated-cuda) with g++ (or $CXX), about half a second each. The cache
keeps at most KVSPEC_EMULATED_CUDA_CACHE_MIB MiB (1024 by default; a whole emulated
session of the suite builds a few hundred): past it, the builds least recently used go.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import cache, partial
from pathlib import Path
from typing import Any
from unittest import mock

import mlx.core as mx
import numpy as np

from kvspec.accelerated.caches import compiled
from kvspec.accelerated.cuda_source import CUDA_DIR
from kvspec.conformance.stand_ins import KernelCall, cuda_patches
from kvspec.reference.caches import compiled as reference_compiled

#: The CUDA a kernel uses, for the host.
HEADER = Path(__file__).resolve().with_name("emulated_cuda.h")
#: The variable naming the folder of built kernels.
CACHE_ENV = "KVSPEC_EMULATED_CUDA_CACHE"
#: The variable naming the most MiB the folder keeps, and its default.
CACHE_LIMIT_ENV = "KVSPEC_EMULATED_CUDA_CACHE_MIB"
DEFAULT_CACHE_MIB = 1024
#: Flags of the build: IEEE arithmetic as written (no contraction, no fast math), and
#: checks of what a GPU faults on or leaves undefined where a CPU would not (UBSan): a
#: load at an address its type's alignment does not divide (a GPU's "misaligned
#: address"), shifts past a word, signed overflow, an index past a fixed array.
FLAGS = (
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-shared",
    "-ffp-contract=off",
    "-fno-strict-aliasing",
    "-fsanitize=alignment,shift,signed-integer-overflow,bounds,null",
)
#: Bytes of each thread's stack.
STACK_BYTES = 256 * 1024

_INCLUDE = re.compile(r'#include "([^"]+)"\n')
_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w:]+)\s+(\w+)\[\];")
_ASM = re.compile(r"\basm\s*(?:volatile\s*)?\(")
_OPERAND = re.compile(r'\s*"([=+&]*)(\w)"\s*\((.*)\)\s*$', re.S)
_TEMPLATE_OPERAND = re.compile(r"%(\d+)|\b(0x[0-9a-fA-F]+|\d+)\b")


@cache
def numpy_type(dtype: mx.Dtype) -> type:
    """The NumPy type holding an MLX dtype's values (bfloat16: its bits)."""
    return {
        mx.bool_: np.bool_,
        mx.int8: np.int8,
        mx.int32: np.int32,
        mx.uint8: np.uint8,
        mx.uint16: np.uint16,
        mx.uint32: np.uint32,
        mx.float16: np.float16,
        mx.bfloat16: np.uint16,
        mx.float32: np.float32,
    }[dtype]


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one opened just before `start`."""
    depth = 1
    at = start
    while depth:
        char = text[at]
        if char == '"':
            at = text.index('"', at + 1)
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        at += 1
    return at - 1


def _split_top(text: str, separator: str) -> list[str]:
    """`text` split at each `separator` outside strings and brackets."""
    parts, depth, start, in_string = [], 0, 0, False
    for at, char in enumerate(text):
        if char == '"':
            in_string = not in_string
        elif in_string:
            continue
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[start:at])
            start = at + 1
    parts.append(text[start:])
    return parts


def asm_as_call(statement: str) -> str:
    """An inline PTX statement's operands (`asm("template" : outputs : inputs)`) as a call of
    emulated_cuda.h's function for its mnemonic, with its operands in the order the
    template names them (immediates written in the template passed as they are)."""
    parts = _split_top(statement, ":")
    template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', parts[0]))
    operands = []
    for part in parts[1:3]:
        for operand in filter(str.strip, _split_top(part, ",")):
            found = _OPERAND.match(operand)
            if found is None:
                raise ValueError(f"an asm operand not understood: {operand!r}")
            operands.append(found.group(3).strip())
    mnemonic, _, rest = template.strip().partition(" ")
    arguments = [
        operands[int(number)] if number else f"{literal}u"
        for number, literal in _TEMPLATE_OPERAND.findall(rest)
    ]
    function = "emulated_asm_" + re.sub(r"\W", "_", mnemonic)
    return f"{function}({', '.join(arguments)})"


def host_code(text: str) -> str:
    """CUDA source made host code: each inline PTX statement a call (`asm_as_call`), each
    dynamic shared array a pointer to the launch's buffer."""
    text = _EXTERN_SHARED.sub(r"\1* \2 = reinterpret_cast<\1*>(emulated::dynamic_shared);", text)
    pieces, at = [], 0
    for found in _ASM.finditer(text):
        if found.start() < at:
            continue
        close = _closing(text, found.end())
        pieces += [text[at : found.start()], asm_as_call(text[found.end() : close])]
        at = close + 1
    return "".join(pieces) + text[at:]


def _inlined(header: str, seen: set[Path]) -> str:
    """`header` with each of its includes of CUDA_DIR's files replaced by the file (once)."""

    def include(found: re.Match) -> str:
        path = Path(found.group(1))
        if path.parent != CUDA_DIR:
            return found.group(0)
        if path in seen:
            return ""
        seen.add(path)
        text = path.read_text().replace("#pragma once\n", "")  # once is by `seen` here
        return _inlined(text, seen) + "\n"

    return _INCLUDE.sub(include, header)


def host_source(call: KernelCall) -> str:
    """The kernel's whole source for the host: emulated_cuda.h, its header and its
    `__global__` function as MLX writes them (`KernelCall.parameters`), and
    `emulated_body`, which calls it with a launch's arguments, and `emulated_run`."""
    parameters = call.parameters()
    unpacked = []
    for index, (kind, _) in enumerate(parameters):
        ctype = kind.removeprefix("const ").removeprefix("__grid_constant__ ")
        if ctype.endswith("*"):
            unpacked.append(f"static_cast<{ctype}>(a[{index}])")
        else:
            unpacked.append(f"*static_cast<const {ctype}*>(a[{index}])")
    signature = ",\n".join(f"    {kind} {name}" for kind, name in parameters)
    kernel = f"custom_kernel_{call.name}"
    text = (
        f"{_inlined(call.header, set())}namespace mlx::core::cu {{\n\n"
        "namespace cg = cooperative_groups;\n\n"
        f"__global__ void {kernel}(\n{signature}) {{\n{call.source}\n}}\n\n"
        "}  // namespace mlx::core::cu\n"
    )
    unpacking = ",\n        ".join(unpacked)
    return (
        f'#include "{HEADER}"\n'
        "using namespace mlx::core::cu;\n"
        f"{host_code(text)}\n"
        'extern "C" void emulated_body(void* const* a) {\n'
        f"    mlx::core::cu::{kernel}(\n        {unpacking});\n}}\n\n"
        'extern "C" const char* emulated_run(void* const* a, const unsigned int* blocks,\n'
        "        const unsigned int* threads, unsigned char* shared, size_t stack,\n"
        "        bool reversed) {\n"
        "    return emulated::launch(emulated_body, a, blocks, threads, shared, stack, "
        "reversed);\n}\n"
    )


@contextmanager
def stderr_kept() -> Iterator[list[str]]:
    """For the time of the block, what is written to the process's standard error (file
    descriptor 2, where UBSan reports) is kept, and handed over in the list at its end."""
    kept: list[str] = []
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(2)
        os.dup2(sink.fileno(), 2)
        try:
            yield kept
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            kept.append(sink.read().decode(errors="replace"))


def cache_dir() -> Path:
    """Where built kernels are kept."""
    found = os.environ.get(CACHE_ENV)
    return Path(found) if found else Path.home() / ".cache" / "kvspec" / "emulated-cuda"


def cache_limit() -> int:
    """The most bytes the cache keeps (CACHE_LIMIT_ENV, in MiB)."""
    found = os.environ.get(CACHE_LIMIT_ENV, str(DEFAULT_CACHE_MIB))
    try:
        mib = int(found)
    except ValueError:
        mib = -1
    if mib < 0:
        raise ValueError(f"{CACHE_LIMIT_ENV} must be a whole number of MiB, got {found!r}")
    return mib << 20


def prune(folder: Path, limit: int, keep: Path) -> None:
    """Delete the builds of `folder` least recently used (oldest modified: a build is
    touched when loaded), never `keep`, until the rest take at most `limit` bytes."""
    builds = []
    for library in folder.glob("*.so"):
        try:
            found = library.stat()
        except FileNotFoundError:  # pruned by another process meanwhile
            continue
        builds.append((found.st_mtime_ns, found.st_size, library))
    total = sum(size for _, size, _ in builds)
    for _, size, library in sorted(builds, key=lambda build: build[0]):
        if total <= limit:
            break
        if library == keep:
            continue
        library.unlink(missing_ok=True)
        total -= size


@cache
def built(source: str) -> ctypes.CDLL:
    """The shared library of a host source, built once (kept in `cache_dir()` by the hash
    of the source, the shim and the flags) and loaded once a process."""
    compiler = os.environ.get("CXX", "g++")
    digest = hashlib.sha256(
        "\0".join([source, HEADER.read_text(), compiler, *FLAGS]).encode()
    ).hexdigest()[:32]
    folder = cache_dir()
    library = folder / f"{digest}.so"
    limit = cache_limit()
    if library.exists():
        os.utime(library)  # its last use, which pruning goes by
    else:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as work:
            source_path = Path(work) / "kernel.cpp"
            source_path.write_text(source)
            done = subprocess.run(
                [compiler, *FLAGS, str(source_path), "-o", str(Path(work) / "kernel.so")],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"the kernel's host build failed:\n{done.stderr[-4000:]}")
            os.replace(Path(work) / "kernel.so", library)
        prune(folder, limit, library)
    loaded = ctypes.CDLL(str(library))
    loaded.emulated_run.restype = ctypes.c_char_p
    loaded.emulated_run.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.POINTER(ctypes.c_uint),
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_bool,
    ]
    return loaded


def host_array(array: mx.array, strided: bool) -> np.ndarray:
    """`array`'s values in a NumPy array (bfloat16 as its bits); with `strided`, a view of a
    larger buffer whose rows are apart by more than their length (a multiple of 16 bytes),
    the rest NaN bytes."""
    values = np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
    values = values.astype(numpy_type(array.dtype), copy=False)
    if not strided or values.ndim < 2:
        return np.ascontiguousarray(values)
    width = values.shape[-1]
    unit = max(1, 16 // values.itemsize)  # rows stay 16-byte aligned, as a buffer's are
    padded = np.empty((*values.shape[:-1], -(-(2 * width + 1) // unit) * unit), values.dtype)
    padded.view(np.uint8)[...] = 0xFF
    view = padded[..., :width]
    view[...] = values
    return view


def _dims(values: Sequence[int], ctype: type) -> Any:
    dims = (ctype * 10)()
    dims[: len(values)] = list(values)
    return dims


def emulated_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    shared_memory: int = 0,
    reversed_order: bool = False,
    **_: object,
) -> Any:
    """`mx.fast.cuda_kernel` run on the CPU: the kernel object, whose call launches it.
    With `reversed_order`, a block's threads run in decreasing order between barriers."""

    def launch(
        *,
        inputs: Sequence[mx.array],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: Sequence[int],
        threadgroup: Sequence[int],
        init_value: float | None = None,
        template: object = None,
        **__: object,
    ) -> list[mx.array]:
        if template:
            # The backend writes its constants into the source (cuda_source.cuda_kernel).
            raise ValueError(f"{name}: template arguments are not emulated")
        call = KernelCall.made(
            name, input_names, output_names, source, header, shared_memory, inputs, output_dtypes
        )
        library = built(host_source(call))
        held: list[Any] = []
        for input_name, array in zip(input_names, inputs, strict=True):
            strided = not ensure_row_contiguous and f"{input_name}_strides" in source
            values = host_array(array, strided)
            held.append(values)
            if array.ndim > 0:
                for suffix in ("shape", "strides", "ndim"):
                    if f"{input_name}_{suffix}" not in source:
                        continue
                    if suffix == "shape":
                        held.append(_dims(values.shape, ctypes.c_int32))
                    elif suffix == "strides":
                        steps = [stride // values.itemsize for stride in values.strides]
                        held.append(_dims(steps, ctypes.c_int64))
                    else:
                        held.append(ctypes.c_int(values.ndim))
        outputs = []
        for shape, dtype in zip(output_shapes, output_dtypes, strict=True):
            output = np.empty(tuple(shape), numpy_type(dtype))
            if init_value is None:
                output.view(np.uint8)[...] = 0xFF
            elif dtype == mx.bfloat16:
                output[...] = np.array(mx.array(init_value, mx.bfloat16).view(mx.uint16))
            else:
                output[...] = init_value
            outputs.append(output)
            held.append(output)
        pointers = (ctypes.c_void_p * len(held))(
            *[
                item.ctypes.data if isinstance(item, np.ndarray) else ctypes.addressof(item)
                for item in held
            ]
        )
        if min(threadgroup) < 1:
            raise ValueError(f"{name}: blocks of {threadgroup} threads")
        # As MLX launches it: enough blocks to cover the grid's threads in each dimension.
        blocks = [
            -(-total // per_block) for total, per_block in zip(grid, threadgroup, strict=True)
        ]
        shared = np.full(max(shared_memory, 1), 0xFF, np.uint8)
        with stderr_kept() as written:
            error = library.emulated_run(
                pointers,
                (ctypes.c_uint * 3)(*blocks),
                (ctypes.c_uint * 3)(*threadgroup),
                shared.ctypes.data,
                STACK_BYTES,
                reversed_order,
            )
        if error is not None:
            raise RuntimeError(f"{name}: {error.decode()}")
        if "runtime error:" in written[0]:
            raise RuntimeError(f"{name}: {written[0].strip()}")
        made = [mx.array(output) for output in outputs]
        return [
            array.view(mx.bfloat16) if dtype == mx.bfloat16 else array
            for array, dtype in zip(made, output_dtypes, strict=True)
        ]

    return launch


@contextmanager
def emulated_cuda_path(reversed_order: bool = False) -> Iterator[None]:
    """The CUDA path, its kernels run on the CPU and compiled decode steps uncompiled (above),
    for the time of the block; with `reversed_order`, each block's threads in decreasing
    order between barriers (a kernel whose outputs change with it holds a race)."""
    uncompiled = staticmethod(reference_compiled.CompiledDecode.compile_graph)
    with (
        cuda_patches(partial(emulated_kernel, reversed_order=reversed_order)),
        mock.patch.object(compiled.CompiledDecode, "compile_graph", uncompiled),
    ):
        yield
