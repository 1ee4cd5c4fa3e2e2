"""The MLX backend's CUDA kernels hand MLX a call into a file of `accelerated/cuda/`, which
their header includes (`accelerated/cuda_source.py`): MLX builds and hashes that source at
every call. These run on any device: the sources are text."""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvspec.conformance.backend import Backend
from kvspec.conformance.compare import assert_same_bits


def _calls() -> dict[str, tuple[str, str]]:
    """Each kernel's source (a call) and the file holding the function it calls."""
    from kvspec.accelerated import affine_kernels, attention_kernels, turboquant_kernels

    calls = {
        "attention merge": (attention_kernels._merge_call(False), "decode_attention.cuh"),
        "attention merge, rotated": (attention_kernels._merge_call(True), "decode_attention.cuh"),
        "turboquant decode": (turboquant_kernels._DECODE_CALL, "turboquant.cuh"),
        "turboquant encode": (turboquant_kernels._ENCODE_CALL, "turboquant.cuh"),
        "affine encode": (affine_kernels._ONE_TENSOR_CALL, "affine.cuh"),
        "affine encode, keys and values": (affine_kernels._PAIR_CALL, "affine.cuh"),
        "affine encode, keys and values, record": (affine_kernels._RECORD_CALL, "affine.cuh"),
    }
    for mma in (False, True):
        variants = ((False, False, False), (True, False, False), (True, True, False))
        for counted, slot, ordered in (*variants, (True, False, True)):
            for kind, (key_fmt, value_fmt) in _formats().items():
                codebook = value_fmt == attention_kernels.TURBO_VALUE
                inputs = attention_kernels._pass_inputs(
                    key_fmt, value_fmt, counted, slot, False, ordered
                )
                call = attention_kernels._partial_call(
                    mma, counted, slot, ordered, inputs, None, codebook
                )
                name = f"attention pass 1 {kind} mma={mma} counted={counted} slot={slot}"
                name += " ordered" if ordered else ""
                calls[name] = (call, "decode_attention.cuh")
                inputs = attention_kernels._pass_inputs(
                    key_fmt, value_fmt, counted, slot, True, ordered
                )
                offsets = _record_offsets(key_fmt, value_fmt)
                call = attention_kernels._partial_call(
                    mma, counted, slot, ordered, inputs, offsets, codebook
                )
                calls[f"{name} record"] = (call, "decode_attention.cuh")
    return calls


def _formats() -> dict[str, tuple[int, int]]:
    """The key and value formats of each kind of read."""
    from kvspec.accelerated import attention_kernels as kernels

    return {
        "plain": (kernels.PLAIN, kernels.PLAIN),
        "affine": (kernels.AFFINE, kernels.AFFINE),
        "turboquant": (kernels.TURBO_KEY, kernels.TURBO_VALUE),
    }


def _record_offsets(key_fmt: int, value_fmt: int) -> tuple[int, ...]:
    """Made-up byte offsets of the fields two formats store, 16 apart, as record_pass takes
    them (-1 for the fields they do not store)."""
    from kvspec.accelerated import attention_kernels

    names = attention_kernels._record_field_names(key_fmt, value_fmt)
    offsets = tuple(16 * (i + 1) for i in range(len(names)))
    return attention_kernels._record_offsets(key_fmt, value_fmt, offsets)


def _parameters(code: str, function: str) -> list[str]:
    """The parameter names of `function`'s definition in `code`."""
    start = code.index(f"void {function}(")
    signature = code[start : code.index(") {", start)].split("(", 1)[1]
    return [part.split()[-1].strip("&*") for part in signature.split(",")]


def test_each_kernel_hands_mlx_a_short_call_of_its_function(backend: Backend) -> None:
    """Every argument is its parameter's namesake (so MLX, which passes an input's shape or
    strides only when the source names them, passes what the function reads), a stand-in
    for an input the variant does not have (a null pointer, the key codes' strides), or
    the array of TurboQuant's constants that the kernel's header holds for it."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's CUDA sources")
    from kvspec.accelerated import turboquant_kernels as tq
    from kvspec.accelerated.cuda_source import CUDA_DIR

    held = {"table": tq.CODEBOOK, "boundaries": tq.BOUNDARIES, "signs": tq.SIGNS}

    for name, (call, file) in _calls().items():
        assert len(call) < 1024, name
        function = re.match(r"\w+::(\w+)<", call)
        assert function is not None, name
        parameters = _parameters((CUDA_DIR / file).read_text(), function.group(1))
        arguments = [a.strip() for a in call.split(">(", 1)[1].removesuffix(");").split(",")]
        assert len(arguments) == len(parameters), name
        for parameter, argument in zip(parameters, arguments, strict=True):
            stand_ins = (
                "nullptr",
                "record_strides" if name.endswith("record") else "k_codes_strides",
            )
            assert argument in (parameter, *stand_ins, held.get(parameter)), (name, parameter)
    calls = _calls()
    pass1 = calls["attention pass 1 turboquant mma=True counted=False slot=False"][0]
    assert "rows" not in pass1 and "slot_row" not in pass1
    counted_slot = calls["attention pass 1 turboquant mma=True counted=True slot=True"][0]
    assert "rows," in counted_slot and "slot_row," in counted_slot
    # A format's absent fields are null pointers, not inputs (each costs the host time).
    plain = calls["attention pass 1 plain mma=True counted=True slot=True"][0]
    assert "k_scales" not in plain and "table" not in plain and "new_v_biases" not in plain
    turbo = calls["attention pass 1 turboquant mma=True counted=True slot=True"][0]
    assert f"{tq.CODEBOOK}," in turbo and "new_k_biases," in turbo and "v_biases" not in turbo
    assert "signs" not in calls["attention merge"][0]
    assert f"{tq.SIGNS}," in calls["attention merge, rotated"][0]
    # A record variant reads every field of the record at its offset: TurboQuant values have
    # no biases (-1). Its only stored inputs are the record and the slot's record row.
    record = calls["attention pass 1 turboquant mma=True counted=True slot=True record"][0]
    assert "SCALED, MIN_SPLIT, MOST_SPLITS, 16, 32, 48, 64, 80, -1>(" in record
    assert "new_record, new_record_strides" in record and "k_codes" not in record
    plain = calls["attention pass 1 plain mma=False counted=False slot=False record"][0]
    assert (
        "SCALED, MIN_SPLIT, MOST_SPLITS, 16, -1, -1, 32, -1, -1>(" in plain
        and "nullptr, record_strides" in plain
    )


def test_an_included_file_is_named_by_its_path_and_its_contents(
    backend: Backend, tmp_path, monkeypatch
) -> None:
    """MLX keys a built kernel by a hash of the source it builds (in memory and in its PTX
    cache on disk): a header that includes a file must change when the file does."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's CUDA sources")
    from kvspec.accelerated import cuda_source

    monkeypatch.setattr(cuda_source, "CUDA_DIR", tmp_path)
    cuda_source.included.cache_clear()
    try:
        (tmp_path / "a.cuh").write_text("__device__ int one() { return 1; }\n")
        first = cuda_source.included("a.cuh")
        assert f'#include "{tmp_path / "a.cuh"}"' in first.splitlines()
        cuda_source.included.cache_clear()
        (tmp_path / "a.cuh").write_text("__device__ int one() { return 2; }\n")
        assert cuda_source.included("a.cuh") != first
        with pytest.raises(FileNotFoundError):
            cuda_source.included("missing.cuh")
        # A path an #include line cannot name: a quote, or a newline, alone.
        for folder in ('with"quote', "with\nnewline"):
            (tmp_path / folder).mkdir()
            (tmp_path / folder / "a.cuh").write_text("__device__ int one() { return 1; }\n")
            with pytest.raises(ValueError, match="cannot be named in an #include"):
                cuda_source.included(f"{folder}/a.cuh")
    finally:
        cuda_source.included.cache_clear()


def test_a_kernels_constants_are_written_as_mlx_writes_template_arguments(
    backend: Backend, monkeypatch
) -> None:
    """`cuda_kernel` declares each constant at the top of the kernel's source and appends its
    value to the kernel's name, as MLX does with template arguments (custom_kernel.cpp), so
    that a call passes none and each set of constants names its own build."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's CUDA sources")
    import mlx.core as mx

    from kvspec.accelerated import cuda_source

    made = {}
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **options: made.update(options))
    constants = (("T", mx.bfloat16), ("D", 128), ("OFF", -1), ("ROTATED", True), ("F", False))
    cuda_source.cuda_kernel("k", "call();", constants, input_names=["x"], header="// h\n")
    assert made["name"] == "k_bfloat16_t_128_n1_t_f"
    assert made["source"] == (
        "  using T = __nv_bfloat16;\n  constexpr int D = 128;\n  constexpr int OFF = -1;\n"
        "  constexpr bool ROTATED = true;\n  constexpr bool F = false;\n\ncall();"
    )
    assert made["input_names"] == ["x"] and made["header"] == "// h\n"
    cuda_source.cuda_kernel("k", "call();", (), input_names=["x"])
    assert made["name"] == "k" and made["source"] == "call();"


def _pass_one_options(monkeypatch, key_dim: int, value_dim: int, group: int) -> dict:
    """The options each variant of pass 1 (either body; counted, slot, ordered, both) is
    made with for affine 8-bit keys and values of these head dims, by kernel name."""
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels as kernels

    made = {}

    def stand_in(**options):
        made[options["name"]] = options

    monkeypatch.setattr(mx.fast, "cuda_kernel", stand_in)
    keys = (kernels.AFFINE, mx.uint32, mx.bfloat16, 8, 64, key_dim)
    values = (kernels.AFFINE, mx.uint32, mx.bfloat16, 8, 64, value_dim)
    plan = kernels._plan(mx.bfloat16, keys, values, 8, group, 16, 0, mx.bfloat16)
    variants = [
        (mma, slot, ordered)
        for mma in (False, True)
        for slot in (False, True)
        for ordered in (False, True)
    ]
    kernels._partial_kernel.cache_clear()
    try:
        for mma, slot, ordered in variants:
            kernels._partial_kernel(
                plan, True, mma, slot, ordered, kernels.AFFINE, kernels.AFFINE, None
            )
    finally:
        kernels._partial_kernel.cache_clear()
    assert len(made) == len(variants)
    return made


@pytest.mark.parametrize(
    ("key_dim", "value_dim", "group", "bounded"),
    [
        (128, 128, 4, True),
        (64, 64, 2, True),
        (256, 256, 4, False),
        (128, 128, 8, False),
        (256, 128, 4, False),
        (128, 256, 2, False),
    ],
)
def test_the_variants_that_outgrew_it_are_held_to_the_blocks_an_sm_the_split_counts_on(
    backend: Backend, monkeypatch, key_dim: int, value_dim: int, group: int, bounded: bool
) -> None:
    """The compiled step's slot variant of pass 1 (either body) and the CUDA-core body's
    ordered variant are declared with launch bounds of WARPS * 32 threads and BLOCKS_PER_SM
    blocks, where the eager variant was measured to fit them (head dims up to BOUNDED_DIM,
    up to BOUNDED_GROUP query heads per KV head); no other kernel: built without bounds,
    those two took more registers than the blocks leave a thread, and the others fit."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's CUDA sources")
    from kvspec.accelerated import attention_kernels as kernels

    made = _pass_one_options(monkeypatch, key_dim, value_dim, group)
    bounds = f"__launch_bounds__({kernels.WARPS * 32}, {kernels.BLOCKS_PER_SM})"
    for name, options in made.items():
        header = options["header"]
        outgrew = "_slot" in name or ("_ordered" in name and "_mma" not in name)
        assert (bounds in header) is (outgrew and bounded), name
        if bounds in header:
            # MLX declares the kernel after the header: `__global__` carries the bounds there.
            assert header.endswith(f"#define __global__ __location__(global) {bounds}\n")


def test_pass_one_reads_its_inputs_where_they_lie(backend: Backend, monkeypatch) -> None:
    """READ-7 on CUDA: pass 1 takes each input's strides and reads it where it lies; made
    with MLX's default (`ensure_row_contiguous`), a view that is not row contiguous (a
    sliced buffer) would be copied whole at every launch first."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's CUDA sources")
    made = _pass_one_options(monkeypatch, 128, 128, 4)
    assert all(options["ensure_row_contiguous"] is False for options in made.values())


def test_the_kernels_hold_turboquants_tables_bit_for_bit(backend: Backend) -> None:
    """TQ-1, TQ-2 on CUDA: the codebook, its boundaries and the sign vector that the
    kernels' headers declare (instead of taking them as inputs at every launch) read back as
    the reference's float32 tables, bit for bit, for every width and head dim."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's CUDA sources")
    from kvspec.accelerated import turboquant_kernels as tq
    from kvspec.reference import turboquant as reference

    def declared(header: str, name: str) -> np.ndarray:
        match = re.search(rf"__device__ const float {name}\[(\d+)\] = \{{([^}}]*)\}};", header)
        assert match is not None, name
        values = [float(literal.removesuffix("f")) for literal in match.group(2).split(", ")]
        assert len(values) == int(match.group(1))
        return np.array(values, np.float32)

    for bits in reference.VALUE_BITS:
        header = tq.constants_header(codebook_bits=bits, boundary_bits=bits)
        assert_same_bits(declared(header, tq.CODEBOOK), reference.centroids(bits), "codebook")
        assert_same_bits(declared(header, tq.BOUNDARIES), reference.boundaries(bits), "bounds")
    for head_dim in reference.SIGN_HEX:
        header = tq.constants_header(signs_dim=head_dim)
        assert_same_bits(declared(header, tq.SIGNS), reference.signs(head_dim), "signs")
    assert tq.constants_header() == ""
