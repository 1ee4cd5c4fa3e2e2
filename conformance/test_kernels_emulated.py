"""The CUDA kernels' own source, run on the CPU (conformance/emulated_cuda.py) in every run
of the suite, so that a change to a kernel meets its tests where no GPU is: a selection of
the GPU half's tests (docs/gpu.md), each called with the MLX backend on its CUDA path, its
kernels emulated. The encoders are held to the reference's bits, the reads to READ-7's
bounds, as on a GPU. Skipped where the kernels already run (on a GPU, or in a session
under KVSPEC_EMULATED_CUDA=1): the GPU half's tests themselves reach them there."""

from __future__ import annotations

from collections.abc import Iterator

import ml_dtypes
import numpy as np
import pytest

from kvspec.conformance import test_compiled_step as compiled_step
from kvspec.conformance import test_decode_step as decode_step
from kvspec.conformance.backend import Backend
from kvspec.conformance.compare import assert_same_bits


def _skip_unless_emulating(backend: Backend) -> None:
    """Skip but for the MLX backend where its kernels do not already run."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's kernels")
    from kvspec.accelerated.device import fused_kernels_enabled

    if fused_kernels_enabled():
        pytest.skip("the kernels run in this session: the GPU half's tests reach them")


@pytest.fixture
def emulated(backend: Backend) -> Iterator[Backend]:
    """The MLX backend with its CUDA kernels emulated, as a GPU session sees it."""
    _skip_unless_emulating(backend)
    from kvspec.conformance.backend import accelerated_backend
    from kvspec.conformance.emulated_cuda import emulated_cuda_path

    with emulated_cuda_path():
        yield accelerated_backend()


@pytest.mark.parametrize("kind", sorted(decode_step.READ_KINDS))
@pytest.mark.parametrize("body", ["default", "cuda-cores"])
def test_reads_of_stored_fields_are_within_bound(emulated: Backend, kind: str, body: str) -> None:
    decode_step.test_decode_read_of_stored_fields_is_within_bound(emulated, kind, 4, body)


@pytest.mark.parametrize("kind", sorted(decode_step.READ_KINDS))
def test_reads_of_a_few_one_hot_rows_are_within_bound(emulated: Backend, kind: str) -> None:
    decode_step.test_a_read_of_a_few_one_hot_rows_is_within_bound(emulated, kind, 4)


@pytest.mark.parametrize("kind", sorted(decode_step.READ_KINDS))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_steps_do_not_race(backend: Backend, kind: str, compiled: bool) -> None:
    """A window and three decode steps (eager, or compiled: pass 1's slot variant), each
    block's threads run in increasing order between barriers and then in decreasing order:
    the kernels' outputs and the stored state are the same bits (a race the barriers do not
    order would make them differ)."""
    _skip_unless_emulating(backend)
    from kvspec.conformance.emulated_cuda import emulated_cuda_path

    runs = []
    for reversed_order in (False, True):
        with emulated_cuda_path(reversed_order):
            runs.append(_steps(backend, kind, compiled))
    for index, (forward, backward) in enumerate(zip(*runs, strict=True)):
        assert_same_bits(forward, backward, f"array {index}")


def _steps(backend: Backend, kind: str, compiled: bool) -> list[np.ndarray]:
    """The reads' outputs and the state's arrays of a window and three decode steps."""
    head_dim = 256 if kind.endswith("head256") else 128
    scale = head_dim**-0.5
    rng = np.random.default_rng(11)
    cache = decode_step.READ_KINDS[kind](backend.module("caches"))

    def rows(length: int, heads: int = 2):
        values = rng.standard_normal((1, heads, length, head_dim)).astype(np.float32)
        return backend.from_numpy(values.astype(ml_dtypes.bfloat16))

    def eager(k, v, queries):
        return [cache.append_decode(k, v).attend(queries, scale)]

    def step_fn(traces, k, v, queries):
        return [trace.append_decode(k, v).attend(queries, scale) for trace in traces]

    cache.append_window(rows(45), rows(45))
    compile_decode = backend.module("caches.compiled").compile_decode
    decode = compile_decode(step_fn, [cache]) if compiled else eager
    outputs = []
    for _ in range(3):
        (output,) = decode(rows(1), rows(1), rows(1, heads=8))
        outputs.append(backend.to_numpy(output))
    return [*outputs, *(backend.to_numpy(array) for array in cache.state().arrays)]


@pytest.mark.parametrize("kind", ["affine-4-64", "turbo-k8v4-dense"])
def test_equal_rows_read_alike_from_other_buffers(emulated: Backend, kind: str) -> None:
    decode_step.test_equal_rows_read_alike_whatever_buffer_holds_them(emulated, kind)


@pytest.mark.parametrize("kind", ["affine-4-64", "turbo-k8v4-dense"])
def test_rows_of_a_batch_read_as_alone(emulated: Backend, kind: str) -> None:
    decode_step.test_rows_of_a_batch_read_as_each_alone(emulated, kind)


@pytest.mark.parametrize("kind", decode_step.PADDED_ROWS_KINDS)
def test_rows_of_a_padded_batch_read_as_alone(emulated: Backend, kind: str) -> None:
    decode_step.test_rows_of_a_padded_batch_read_as_each_alone(emulated, kind)


@pytest.mark.parametrize("kind", decode_step.RING_KINDS)
def test_a_ring_reads_oldest_first(emulated: Backend, kind: str) -> None:
    decode_step.test_a_ring_reads_its_rows_oldest_first(emulated, kind)


def test_a_ring_filling_its_kept_rows_reads_as_growable_storage(emulated: Backend) -> None:
    decode_step.test_a_ring_filling_its_kept_rows_reads_as_growable_storage(emulated)


@pytest.mark.parametrize("kind", decode_step.RING_KINDS)
def test_a_compiled_ring_reads_as_the_eager_ring(emulated: Backend, kind: str) -> None:
    compiled_step.test_a_compiled_ring_reads_as_the_eager_ring(emulated, kind)


#: The compiled step's kinds whose steps run emulated in every run: growable storage, rings
#: and a bf16-first switch, over each pass-1 format's slot variant.
COMPILED_KINDS = ("kv", "affine 4/64", "turbo k8v4 deferred", "bf16-first affine ring 8/32")


@pytest.mark.parametrize("kind", COMPILED_KINDS)
def test_compiled_steps_read_as_eager_steps(emulated: Backend, kind: str) -> None:
    """COMPILE-1 on the kernels: compiled steps store the eager bits and read as the eager
    read of the same cache, bit for bit (the traced graph uncompiled, emulated_cuda.py)."""
    (factory, head_dim) = next(k[1:] for k in compiled_step.KINDS if k[0] == kind)
    compiled_step.test_compiled_steps_store_the_eager_bits(emulated, factory, head_dim, "deferred")


@pytest.mark.parametrize("kind", sorted(decode_step.READ_KINDS))
def test_one_row_reads_return_its_values(emulated: Backend, kind: str) -> None:
    decode_step.test_a_decode_read_of_one_row_returns_its_values_as_decoded(
        emulated, kind, "default"
    )


@pytest.mark.parametrize("kind", ["kv", "affine-4-64", "affine-8-32", "turbo-k8v4-dense"])
def test_reads_whose_maxima_rise_are_within_bound(emulated: Backend, kind: str) -> None:
    decode_step.test_a_read_whose_maxima_rise_at_every_chunk_is_within_bound(emulated, kind)


@pytest.mark.parametrize(
    ("kernels", "head_dim", "dtype", "magnitude"),
    [
        ("dense", 128, "bfloat16", 1e-6),
        ("deferred", 64, "bfloat16", 1e2),
        ("deferred", 64, "float32", 3e3),
    ],
)
def test_turboquant_far_zero_reads_are_within_bound(
    emulated: Backend, kernels: str, head_dim: int, dtype: str, magnitude: float
) -> None:
    decode_step.test_turboquant_reads_of_far_zero_points_and_extreme_queries_are_within_bound(
        emulated, kernels, head_dim, dtype, magnitude
    )


@pytest.mark.parametrize("kind", ["affine-4-64", "turbo-k8v4-dense", "bf16-first-turbo"])
def test_bad_deferred_appends_read_nan(emulated: Backend, kind: str) -> None:
    decode_step.test_a_bad_deferred_append_reads_nan_and_is_raised_once(emulated, kind)


@pytest.mark.parametrize(("bits", "group_size"), [(4, 64), (3, 128), (8, 32)])
def test_affine_encodes_store_the_reference_bits(
    emulated: Backend, bits: int, group_size: int
) -> None:
    decode_step.test_affine_deferred_quantize_stores_the_reference_bits(
        emulated, bits, group_size, "bfloat16"
    )


@pytest.mark.parametrize("failing_side", ["keys", "values"])
# One block, and a prefill's many whose ranks one more op folds.
@pytest.mark.parametrize("shape", [(2, 3, 5, 128), (1, 8, 300, 128)])
def test_affine_pair_encodes_store_the_reference_bits(
    emulated: Backend, shape: tuple[int, ...], failing_side: str
) -> None:
    decode_step.test_affine_deferred_pair_stores_what_two_quantizes_store(
        emulated, shape, 4, 64, "bfloat16", failing_side
    )


@pytest.mark.parametrize("head_dim", [64, 128])
def test_turboquant_deferred_encodes_store_the_reference_bits(
    emulated: Backend, head_dim: int
) -> None:
    decode_step.test_turboquant_deferred_encode_stores_the_reference_bits(
        emulated, head_dim, (8, 4), "float32"
    )


def test_turboquant_encodes_store_the_reference_bits(emulated: Backend) -> None:
    decode_step.test_turboquant_eager_encode_on_fused_path_stores_the_reference_bits(emulated, 128)
