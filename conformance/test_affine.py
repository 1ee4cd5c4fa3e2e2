"""The affine codec (AFF-1 .. AFF-9): backend vs reference, reference vs MLX's CPU
kernel, the read-error bound, and rejection of what the format cannot hold."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.backend import backend_of_side
from kvspec.conformance.bounds import affine_read_bound
from kvspec.conformance.compare import assert_same_bits
from kvspec.conformance.strategies import dtype_names, grouped_arrays, lead_shapes
from kvspec.reference import affine as reference
from kvspec.reference.dtypes import FLOAT_DTYPES


@st.composite
def affine_cases(draw: st.DrawFn) -> tuple[np.ndarray, int, int]:
    bits = draw(st.sampled_from(reference.SUPPORTED_BITS))
    group_size = draw(st.sampled_from(reference.SUPPORTED_GROUP_SIZES))
    groups_per_row = draw(st.integers(1, 4))
    lead = draw(lead_shapes)
    w = draw(grouped_arrays(draw(dtype_names), group_size * groups_per_row, group_size, lead))
    return w, group_size, bits


@given(affine_cases())
def test_stored_fields_equal_reference(backend, case) -> None:
    w, group_size, bits = case
    expected = reference.quantize(w, group_size, bits)
    actual = backend.module("affine").quantize(backend.from_numpy(w), group_size, bits)
    for name, a, e in zip(("wq", "scales", "biases"), actual, expected, strict=True):
        assert_same_bits(backend.to_numpy(a), e, name)


def _encoders(backend) -> list[str]:
    """The MLX backend's device-specific encoders (AFF-9); other backends have one."""
    if backend.name != "accelerated":
        return []
    return backend.module("affine").available_encoders()


@given(affine_cases())
def test_every_encoder_stores_reference_bits(backend, case) -> None:
    w, group_size, bits = case
    expected = reference.quantize(w, group_size, bits)
    for encoder in _encoders(backend):
        affine = backend.module("affine")
        actual = affine.quantize(backend.from_numpy(w), group_size, bits, encoder=encoder)
        for name, a, e in zip(("wq", "scales", "biases"), actual, expected, strict=True):
            assert_same_bits(backend.to_numpy(a), e, f"{encoder} {name}")


@pytest.mark.device_detection
def test_the_default_encoder_is_the_devices(backend, monkeypatch) -> None:
    """AFF-9's table: with no encoder named, the CPU takes `mlx_cpu` (MLX's own kernel) and
    a CUDA device `cuda`, never the slower `ops`."""
    if backend.name != "accelerated":
        pytest.skip("the encoders by device belong to the MLX backend")
    mx = pytest.importorskip("mlx.core")
    affine = backend.module("affine")

    ran: list[str] = []
    for name, encode in list(affine.ENCODERS.items()):
        monkeypatch.setitem(
            affine.ENCODERS, name, lambda w, g, b, name=name, encode=encode: ran.append(name)
        )
    expected = {mx.cpu: "mlx_cpu"} | ({mx.gpu: "cuda"} if mx.cuda.is_available() else {})
    was = mx.default_device()
    try:
        for device, name in expected.items():
            mx.set_default_device(device)
            affine.quantize(mx.ones((1, 64)), 64, 4)
            assert ran.pop() == name, device
    finally:
        mx.set_default_device(was)


@given(affine_cases())
def test_read_error_within_bound(backend, case) -> None:
    w, group_size, bits = case
    affine = backend.module("affine")
    wq, scales, biases = affine.quantize(backend.from_numpy(w), group_size, bits)
    read = backend.to_numpy(affine.dequantize(wq, scales, biases, group_size, bits))
    assert read.dtype == w.dtype and read.shape == w.shape
    error = np.abs(read.astype(np.float64) - w.astype(np.float64))
    bound = affine_read_bound(w, backend.to_numpy(scales), bits, group_size)
    worst = np.unravel_index(np.argmax(error - bound), w.shape)
    assert np.all(error <= bound), f"error {error[worst]} > bound {bound[worst]} at {worst}"


def _mlx_cpu(w: np.ndarray):
    from kvspec.accelerated.dtypes import from_numpy

    return from_numpy(w)


@given(affine_cases())
def test_reference_equals_mlx_cpu_kernel(case) -> None:
    """The oracle nobody here wrote: mx.quantize / mx.dequantize on MLX's CPU stream."""
    # Only this test and the MLX format check need MLX: a port without it runs the rest.
    mlx = pytest.importorskip("mlx.core")
    from kvspec.accelerated.dtypes import to_numpy

    w, group_size, bits = case
    expected = mlx.quantize(_mlx_cpu(w), group_size=group_size, bits=bits, stream=mlx.cpu)
    actual = reference.quantize(w, group_size, bits)
    for name, a, e in zip(("wq", "scales", "biases"), actual, expected, strict=True):
        assert_same_bits(a, to_numpy(e), name)
    read = mlx.dequantize(*expected, group_size=group_size, bits=bits, stream=mlx.cpu)
    assert_same_bits(reference.dequantize(*actual, group_size, bits), to_numpy(read), "read")


def test_output_is_the_mlx_format(backend) -> None:
    """mx.dequantize and mx.quantized_matmul accept what the backend stores."""
    if backend.name != "accelerated":
        pytest.skip("MLX format check applies to the MLX backend")
    mlx = pytest.importorskip("mlx.core")
    rng = np.random.default_rng(7)
    for bits in reference.SUPPORTED_BITS:
        w = rng.standard_normal((16, 128)).astype(np.float32)
        wq, scales, biases = backend.module("affine").quantize(backend.from_numpy(w), 64, bits)
        x = rng.standard_normal((3, 128)).astype(np.float32)
        dense = np.array(mlx.dequantize(wq, scales, biases, group_size=64, bits=bits))
        product = mlx.quantized_matmul(
            mlx.array(x), wq, scales, biases, transpose=True, group_size=64, bits=bits
        )
        # The expected product in float64: GPU float32 matmuls may round through TF32.
        expected = x.astype(np.float64) @ dense.T.astype(np.float64)
        np.testing.assert_allclose(np.array(product), expected, rtol=1e-4, atol=1e-4)


def test_worked_example() -> None:
    """AFF-9's group, by hand: 4 bits, group 32, float32."""
    w = np.array([[0.0, 1.0, 2.0, 3.0] * 7 + [3.75, -0.5, 0.25, 1.5]], np.float32)
    wq, scales, biases = reference.quantize(w, 32, 4)
    # min -0.5, max 3.75: max has the larger magnitude, so scale = -(4.25 / 15) and
    # the edge is the max; q0 = rint(3.75 / -0.28333) = -13; scale = 3.75 / -13.
    assert scales.tolist() == [[np.float32(3.75) / np.float32(-13)]]
    assert biases.tolist() == [[3.75]]
    codes = reference.bitstream.unpack_words(wq, 4, 32)
    assert codes[0, :4].tolist() == [13, 10, 6, 3]
    assert codes[0, 28:].tolist() == [0, 15, 12, 8]


def _bad_inputs() -> list[tuple[str, np.ndarray, int, int, str]]:
    ok = np.zeros((2, 64), np.float32)
    nan = ok.copy()
    nan[1, 5] = np.nan
    inf = ok.copy()
    inf[0, 0] = -np.inf
    huge = ok.copy()
    huge[0, :2] = [-3e38, 3e38]
    far_constant = np.full((1, 64), 1e35, np.float32)
    return [
        ("nan", nan, 64, 4, "NaN or inf"),
        ("inf", inf, 64, 4, "NaN or inf"),
        ("one_dimensional", np.zeros(64, np.float32), 64, 4, "at least 2 dimensions"),
        ("indivisible", np.zeros((2, 96), np.float32), 64, 4, "not divisible by group_size"),
        ("bits", ok, 64, 7, "bits must be one of"),
        ("group_size", ok, 16, 4, "group_size must be one of"),
        ("integer", np.zeros((2, 64), np.int32), 64, 4, "unsupported dtype"),
        ("range_overflow", huge, 64, 4, "overflows float32"),
        ("edge_overflow", far_constant, 64, 4, "overflows float32"),
    ]


@pytest.mark.parametrize(
    ("w", "group_size", "bits", "message"),
    [case[1:] for case in _bad_inputs()],
    ids=[case[0] for case in _bad_inputs()],
)
@pytest.mark.parametrize("side", ["reference", "backend"])
def test_bad_input_is_rejected(backend, side, w, group_size, bits, message) -> None:
    before = w.copy()
    if side == "reference":
        with pytest.raises(ValueError, match=message):
            reference.quantize(w, group_size, bits)
    else:
        affine = backend.module("affine")
        for encoder in _encoders(backend) or [None]:
            options = {"encoder": encoder} if encoder else {}
            with pytest.raises(ValueError, match=message):
                affine.quantize(backend.from_numpy(w), group_size, bits, **options)
    np.testing.assert_array_equal(w, before)


@pytest.mark.parametrize("side", ["reference", "backend"])
def test_dequantize_refuses_biases_unlike_the_scales(backend, side) -> None:
    """AFF-6: scales and biases share one dtype and one shape; either differing alone
    raises."""
    checker = backend_of_side(backend, side)
    affine, from_numpy = checker.module("affine"), checker.from_numpy
    wq, scales, biases = reference.quantize(np.ones((2, 128), np.float32), 64, 4)
    args = (from_numpy(wq), from_numpy(scales))
    affine.dequantize(*args, from_numpy(biases), 64, 4)
    for bad in (biases.astype(np.float16), biases[:, :1]):
        with pytest.raises(ValueError, match="share one dtype and shape"):
            affine.dequantize(*args, from_numpy(bad), 64, 4)


def test_no_rows(backend) -> None:
    """An array with no rows stores empty fields of the right shapes (AFF-5)."""
    w = np.zeros((2, 0, 128), np.float32)
    expected = reference.quantize(w, 64, 3)
    affine = backend.module("affine")
    for encoder in _encoders(backend) or [None]:
        options = {"encoder": encoder} if encoder else {}
        stored = affine.quantize(backend.from_numpy(w), 64, 3, **options)
        for name, a, e in zip(("wq", "scales", "biases"), stored, expected, strict=True):
            assert_same_bits(backend.to_numpy(a), e, name)


@pytest.mark.parametrize("dtype_name", sorted(FLOAT_DTYPES))
def test_all_zero_group(dtype_name: str) -> None:
    """AFF-7: scale -1e-7 (in the dtype), bias +0, codes 0, read back as zeros."""
    w = np.zeros((1, 64), FLOAT_DTYPES[dtype_name])
    w[0, ::2] = -0.0
    wq, scales, biases = reference.quantize(w, 64, 4)
    assert not wq.any()
    assert scales[0, 0] == np.float32(-1e-7).astype(w.dtype)
    assert biases[0, 0] == 0 and not np.signbit(biases[0, 0])
    assert not reference.dequantize(wq, scales, biases, 64, 4).astype(np.float32).any()
