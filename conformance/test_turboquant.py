"""The TurboQuant codec (TQ-1 .. TQ-13): backend vs reference bit for bit, the key
read-error bound, value distortion, rotation, packing, deferred-V attention, edge
cases and rejection of what the format cannot hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.backend import Backend, backend_of_side
from kvspec.conformance.bounds import turboquant_key_read_bound
from kvspec.conformance.compare import assert_same_bits
from kvspec.conformance.strategies import kv_pairs
from kvspec.reference import turboquant as reference
from kvspec.reference.dtypes import FLOAT16, FLOAT32, FLOAT_DTYPES

FIELDS = ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales")

#: Relative MSE of values on N(0, 1) at head_dim 128 (TQ-13), and the allowed drift.
VALUE_MSE = {2: 0.1117, 3: 0.03246, 4: 0.008928, 5: 0.002359}
VALUE_MSE_TOLERANCE = 0.03


@st.composite
def tq_cases(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray, int, int]:
    keys, values = draw(kv_pairs(reference.HEAD_DIMS, reference.BLOCK_SIZE))
    k_bits = draw(st.sampled_from(reference.KEY_BITS))
    v_bits = draw(st.sampled_from(reference.VALUE_BITS))
    return keys, values, k_bits, v_bits


def _numpy(backend, t) -> reference.TurboQuantTensor:
    return reference.TurboQuantTensor(*(backend.to_numpy(getattr(t, f)) for f in FIELDS))


@given(tq_cases(), st.booleans())
def test_stored_and_decoded_equal_reference(backend, case, defer_v) -> None:
    """TQ-10: the five stored arrays, and the float32 reads, hold the reference's bits."""
    k, v, k_bits, v_bits = case
    tq = backend.module("turboquant")
    expected = reference.encode(k, v, k_bits, v_bits)
    actual = tq.encode(backend.from_numpy(k), backend.from_numpy(v), k_bits, v_bits)
    for field in FIELDS:
        assert_same_bits(backend.to_numpy(getattr(actual, field)), getattr(expected, field), field)
    head_dim = k.shape[-1]
    up_to = k.shape[2] - 1
    read = tq.decode(actual, up_to, head_dim, defer_v)
    for name, a, e in zip(
        ("keys", "values"), read, reference.decode(expected, up_to, head_dim, defer_v), strict=True
    ):
        a = backend.to_numpy(a)
        assert_same_bits(a, e, name)
        assert np.all(np.isfinite(a)), f"{name}: finite input gave a non-finite read"
    for field in ("k_scales", "k_zeros", "v_scales"):
        assert np.all(np.isfinite(getattr(expected, field))), field


@given(tq_cases())
def test_key_read_error_within_bound(backend, case) -> None:
    """TQ-12 on every group kind, every width and dtype."""
    k, _, k_bits, _ = case
    tq = backend.module("turboquant")
    indices, scales, zeros = tq.encode_keys(backend.from_numpy(k), k_bits)
    read = backend.to_numpy(tq.decode_keys(indices, scales, zeros))
    error = np.abs(read.astype(np.float64) - k.astype(np.float64))
    bound = turboquant_key_read_bound(k, backend.to_numpy(scales), backend.to_numpy(zeros), k_bits)
    worst = np.unravel_index(np.argmax(error - bound), k.shape)
    assert np.all(error <= bound), f"error {error[worst]} > bound {bound[worst]} at {worst}"


def _relative_mse(backend, v: np.ndarray, bits: int) -> float:
    tq = backend.module("turboquant")
    indices, scales = tq.encode_values(backend.from_numpy(v), bits)
    read = backend.to_numpy(tq.decode_values(indices, scales, bits)).astype(np.float64)
    exact = v.astype(np.float64)
    return float(np.sum((read - exact) ** 2) / np.sum(exact**2))


# 16384 vectors of 128: the relative MSE's sampling spread is ~0.1%, well inside 3%.
@pytest.fixture(scope="module")
def gaussian_values() -> np.ndarray:
    return np.random.default_rng(20260).standard_normal((16384, 128)).astype(np.float32)


@pytest.mark.parametrize("bits", sorted(VALUE_MSE))
def test_value_mse_on_gaussian(backend, gaussian_values, bits) -> None:
    """TQ-13: per-group rms scaling lands a little under plain Lloyd-Max."""
    mse = _relative_mse(backend, gaussian_values, bits)
    assert abs(mse / VALUE_MSE[bits] - 1) <= VALUE_MSE_TOLERANCE, f"{bits} bits: {mse:.6g}"


@pytest.mark.parametrize("bits", sorted(VALUE_MSE))
def test_value_mse_on_heavy_tails_with_outlier_channels(backend, bits) -> None:
    """TQ-13: the rotation spreads outlier channels; Student-t(3) input with four
    channels 20x larger does no worse than Gaussian input."""
    rng = np.random.default_rng(20261)
    v = rng.standard_t(3, (16384, 128)).astype(np.float32)
    v[:, rng.choice(128, 4, replace=False)] *= 20
    mse = _relative_mse(backend, v, bits)
    assert mse <= VALUE_MSE[bits] * (1 + VALUE_MSE_TOLERANCE), f"{bits} bits: {mse:.6g}"


def _transform_tolerance(head_dim: int, norms: np.ndarray) -> np.ndarray:
    """TQ-6: a float32 transform's error vector is at most (log2 D + 1) u32 ||x||."""
    return (math.log2(head_dim) + 1) * 2.0**-24 * norms


@pytest.mark.parametrize("head_dim", reference.HEAD_DIMS)
def test_rotation_is_orthonormal_and_self_inverse(backend, head_dim) -> None:
    tq = backend.module("turboquant")
    identity = np.eye(head_dim, dtype=np.float32)
    rotation = backend.to_numpy(tq.rotate(backend.from_numpy(identity))).astype(np.float64)
    gram = rotation @ rotation.T
    np.testing.assert_allclose(
        gram, np.eye(head_dim), rtol=0, atol=8 * 2.0**-24 * math.log2(head_dim)
    )
    x = np.random.default_rng(head_dim).standard_normal((64, head_dim)).astype(np.float32)
    back = backend.to_numpy(tq.unrotate(tq.rotate(backend.from_numpy(x))))
    norms = np.linalg.norm(x.astype(np.float64), axis=-1, keepdims=True)
    assert np.all(np.abs(back - x) <= 2 * _transform_tolerance(head_dim, norms))
    # The transform without signs is its own inverse.
    twice = backend.to_numpy(tq.hadamard(tq.hadamard(backend.from_numpy(x))))
    assert np.all(np.abs(twice - x) <= 2 * _transform_tolerance(head_dim, norms))


@st.composite
def code_vectors(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    bits = draw(st.sampled_from(sorted({*reference.KEY_BITS, *reference.VALUE_BITS})))
    dim = draw(st.sampled_from(reference.HEAD_DIMS))
    rows = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**32 - 1))
    codes = np.random.default_rng(seed).integers(0, 2**bits, (rows, dim), dtype=np.uint8)
    return codes, bits


@given(code_vectors())
def test_pack_round_trip(backend, case) -> None:
    """TQ-9: packing is the reference's byte stream and unpacking restores the codes."""
    codes, bits = case
    tq = backend.module("turboquant")
    dim = codes.shape[-1]
    expected = reference.pack_bits(codes, bits)
    assert expected.shape[-1] == reference.packed_dim(dim, bits) == dim * bits // 8
    packed = tq.pack_bits(backend.from_numpy(codes), bits)
    assert_same_bits(backend.to_numpy(packed), expected, "packed")
    assert_same_bits(backend.to_numpy(tq.unpack_bits(packed, bits, dim)), codes, "unpacked")


def _softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("head_dim", reference.HEAD_DIMS)
@pytest.mark.parametrize("v_bits", reference.VALUE_BITS)
def test_deferred_v_attention(backend, head_dim, v_bits) -> None:
    """TQ-8: attention over rotated values, then unrotate, equals attention over the
    decoded values, within the two float32 transforms' error."""
    rng = np.random.default_rng(head_dim + v_bits)
    k = rng.standard_normal((1, 2, 24, head_dim)).astype(np.float32)
    v = rng.standard_normal((1, 2, 24, head_dim)).astype(np.float32)
    q = rng.standard_normal((1, 2, 3, head_dim))
    tq = backend.module("turboquant")
    stored = tq.encode(backend.from_numpy(k), backend.from_numpy(v), 4, v_bits)
    keys, values = (backend.to_numpy(a).astype(np.float64) for a in tq.decode(stored, 24, head_dim))
    _, rotated = tq.decode(stored, 24, head_dim, defer_v=True)
    rotated = backend.to_numpy(rotated).astype(np.float64)
    weights = _softmax(q @ np.swapaxes(keys, -1, -2) / math.sqrt(head_dim))
    dense = weights @ values
    deferred_rotated = (weights @ rotated).astype(np.float32)
    deferred = backend.to_numpy(tq.unrotate(backend.from_numpy(deferred_rotated)))
    largest = np.linalg.norm(rotated, axis=-1).max()
    # Rounding weights @ rotated to float32, then one transform on each side.
    tolerance = 2.0**-24 * largest + 2 * _transform_tolerance(head_dim, largest)
    assert np.max(np.abs(deferred - dense)) <= tolerance


# TQ-3: rejection, before anything is stored, by both backends.


def _bad_inputs() -> list[tuple[str, np.ndarray, np.ndarray, int, int, str]]:
    ok = np.zeros((1, 1, 2, 64), np.float32)
    nan = ok.copy()
    nan[0, 0, 1, 5] = np.nan
    inf = ok.copy()
    inf[0, 0, 0, 0] = -np.inf
    wide = ok.copy()
    wide[0, 0, 0, :2] = [-1e6, 1e6]  # 2-bit key scale 6.7e5
    far = ok.copy()
    far[0, 0, 0, :32] = 1000 + np.arange(32, dtype=np.float32) * 1e-4  # zero point ~1e7
    loud = np.full((1, 1, 2, 64), 1e5, np.float32)  # value rms 1e5 after rotation
    dims = "(64, 128, 256, 512)"
    return [
        ("nan_keys", nan, ok, 4, 4, "NaN or inf"),
        ("inf_values", ok, inf, 4, 4, "NaN or inf"),
        (
            "head_dim_96",
            np.zeros((1, 1, 1, 96), np.float32),
            np.zeros((1, 1, 1, 96), np.float32),
            4,
            4,
            dims,
        ),
        (
            "head_dim_1024",
            np.zeros((1, 1, 1, 1024), np.float32),
            np.zeros((1, 1, 1, 1024), np.float32),
            4,
            4,
            dims,
        ),
        ("key_scale", wide, ok, 2, 4, "key scale is beyond the float16 range"),
        ("key_zero", far, ok, 4, 4, "key zero point is beyond the float16 range"),
        ("value_scale", ok, loud, 4, 4, "value scale .* is beyond the float16 range"),
        ("key_bits", ok, ok, 6, 4, "key bits must be one of"),
        ("value_bits", ok, ok, 4, 1, "value bits must be one of"),
        ("integer", np.zeros((1, 1, 2, 64), np.int32), ok, 4, 4, "unsupported dtype"),
        ("shape", ok, ok[:, :, :1], 4, 4, r"share one \[B, H, L, D\] shape"),
    ]


@pytest.mark.parametrize(
    ("k", "v", "k_bits", "v_bits", "message"),
    [case[1:] for case in _bad_inputs()],
    ids=[case[0] for case in _bad_inputs()],
)
@pytest.mark.parametrize("side", ["reference", "backend"])
def test_bad_input_is_rejected(backend, side, k, v, k_bits, v_bits, message) -> None:
    before = (k.copy(), v.copy())
    if side == "reference":
        encode, args = reference.encode, (k, v)
    else:
        encode, args = (
            backend.module("turboquant").encode,
            (backend.from_numpy(k), backend.from_numpy(v)),
        )
    with pytest.raises(ValueError, match=message):
        encode(*args, k_bits, v_bits)
    np.testing.assert_array_equal(k, before[0])
    np.testing.assert_array_equal(v, before[1])


def test_decode_rejects_a_mismatched_head_dim(backend) -> None:
    tq = backend.module("turboquant")
    x = backend.from_numpy(np.ones((1, 1, 2, 128), np.float32))
    stored = tq.encode(x, x, 4, 4)
    with pytest.raises(ValueError, match="no key code width"):
        tq.decode(stored, 2, 64)
    with pytest.raises(ValueError, match="outside the 2 stored positions"):
        tq.decode(stored, 3, 128)


@pytest.fixture(params=["reference", "backend"])
def side(backend, request) -> Backend:
    """Each of the tests below on both sides: the reference, then the backend."""
    return backend_of_side(backend, request.param)


def _with_field(stored, name: str, value: np.ndarray, from_numpy):
    fields = {field: getattr(stored, field) for field in FIELDS}
    return type(stored)(**{**fields, name: from_numpy(value)})


def _malformed_fields() -> list[tuple[str, str, np.ndarray, str]]:
    """One condition of TQ-10's acceptance broken alone, at head_dim 128: 8-bit keys
    (int8, 128 bytes) and 4-bit values (uint8, 64 bytes) are the well-formed ones."""
    return [
        ("keys_8_bit_as_uint8", "k_idx", np.zeros((1, 1, 2, 128), np.uint8), "key"),
        ("keys_3_bit_as_int8", "k_idx", np.zeros((1, 1, 2, 48), np.int8), "key"),
        ("keys_width_off_by_one", "k_idx", np.zeros((1, 1, 2, 49), np.uint8), "key"),
        ("keys_of_6_bits", "k_idx", np.zeros((1, 1, 2, 96), np.uint8), "key"),
        ("values_as_int8", "v_packed", np.zeros((1, 1, 2, 64), np.int8), "value"),
        ("values_width_off_by_one", "v_packed", np.zeros((1, 1, 2, 49), np.uint8), "value"),
        ("values_of_6_bits", "v_packed", np.zeros((1, 1, 2, 96), np.uint8), "value"),
    ]


@pytest.mark.parametrize(
    ("field", "value", "side_named"),
    [case[1:] for case in _malformed_fields()],
    ids=[case[0] for case in _malformed_fields()],
)
def test_a_stored_tensor_is_refused_for_each_condition_alone(
    side, field, value, side_named
) -> None:
    """TQ-10: the widths follow from the fields, and a field is accepted only with the
    dtype and width of its width; each condition broken alone raises."""
    tq, from_numpy = side.module("turboquant"), side.from_numpy
    x = from_numpy(np.ones((1, 1, 2, 128), np.float32))
    stored = tq.encode(x, x, 8, 4)
    assert tq.stored_bits(stored, 128) == (8, 4)
    malformed = _with_field(stored, field, value, from_numpy)
    with pytest.raises(ValueError, match=f"is no {side_named} code width"):
        tq.stored_bits(malformed, 128)
    with pytest.raises(ValueError, match=f"is no {side_named} code width"):
        tq.decode(malformed, 2, 128)


def test_group_fields_are_float16_with_one_per_block(side) -> None:
    """TQ-5, TQ-8: scales and zero points are float16, D / 32 of them per vector."""
    tq, from_numpy = side.module("turboquant"), side.from_numpy
    indices = from_numpy(np.zeros((2, 64), np.uint8))
    good = np.ones((2, 2), np.float16)
    tq.decode_keys(indices, from_numpy(good), from_numpy(good))
    tq.decode_values_rotated(indices, from_numpy(good), 4)
    for bad in (good.astype(np.float32), np.ones((2, 3), np.float16)):
        with pytest.raises(ValueError, match="expected float16 group fields of 2"):
            tq.decode_keys(indices, from_numpy(good), from_numpy(bad))
        with pytest.raises(ValueError, match="expected float16 group fields of 2"):
            tq.decode_keys(indices, from_numpy(bad), from_numpy(good))
        with pytest.raises(ValueError, match="expected float16 group fields of 2"):
            tq.decode_values_rotated(indices, from_numpy(bad), 4)


def test_a_value_index_past_the_codebook_is_refused(side) -> None:
    """TQ-8: an index reads a centroid of the codebook; 2^bits or more raises."""
    tq, from_numpy = side.module("turboquant"), side.from_numpy
    scales = from_numpy(np.ones((1, 2), np.float16))
    last = np.zeros((1, 64), np.uint8)
    last[0, 7] = 3
    tq.decode_values_rotated(from_numpy(last), scales, 2)
    past = last.copy()
    past[0, 7] = 4
    with pytest.raises(ValueError, match="beyond the 4 centroids"):
        tq.decode_values_rotated(from_numpy(past), scales, 2)


@pytest.mark.parametrize("bits", [0, 1, 6, 7, 9])
def test_packing_takes_only_the_formats_widths(side, bits) -> None:
    """TQ-9: packed_dim, pack_bits and unpack_bits take the widths of KEY_BITS and
    VALUE_BITS alone."""
    tq, from_numpy = side.module("turboquant"), side.from_numpy
    codes = from_numpy(np.zeros((1, 64), np.uint8))
    with pytest.raises(ValueError, match="bits must be one of"):
        tq.packed_dim(64, bits)
    with pytest.raises(ValueError, match="bits must be one of"):
        tq.pack_bits(codes, bits)
    with pytest.raises(ValueError, match="bits must be one of"):
        tq.unpack_bits(codes, bits, 64)


def test_one_vector_is_encoded_as_a_row_of_one(side) -> None:
    """TQ-3: encode_keys and encode_values take any array whose last axis is D, a single
    vector included; an array with no axis is refused."""
    tq, from_numpy, to_numpy = side.module("turboquant"), side.from_numpy, side.to_numpy
    vector = np.linspace(-1.0, 1.0, 64, dtype=np.float32)
    for encode in (lambda x: tq.encode_keys(x, 4), lambda x: tq.encode_values(x, 4)):
        alone = encode(from_numpy(vector))
        as_row = encode(from_numpy(vector[None]))
        for got, expected in zip(alone, as_row, strict=True):
            assert_same_bits(to_numpy(got), to_numpy(expected)[0], "a vector alone")
        with pytest.raises(ValueError, match="must have a head_dim axis"):
            encode(from_numpy(np.float32(1.0)))


# TQ-11: edge cases.


@pytest.mark.parametrize("dtype_name", sorted(FLOAT_DTYPES))
@pytest.mark.parametrize("bits", reference.KEY_BITS)
@pytest.mark.parametrize("c", [0.75, -3.5, 6.5e-4, -1e-3, 1000.0, -60000.0, 1e-6, 0.0, -0.0])
def test_constant_key_group_reads_as_the_float16_constant(backend, dtype_name, bits, c) -> None:
    """vllm-metal stores zero point round(c / 1e-8) here (inf in float16, a NaN read)."""
    k = np.full((1, 1, 1, 64), c, np.float32).astype(FLOAT_DTYPES[dtype_name])
    tq = backend.module("turboquant")
    read = backend.to_numpy(tq.decode_keys(*tq.encode_keys(backend.from_numpy(k), bits)))
    expected = k.astype(FLOAT32).astype(FLOAT16).astype(FLOAT32)
    np.testing.assert_array_equal(read, expected)


def test_all_zero_value_vector(backend) -> None:
    """A zero vector rotates to zero groups: rms +0, index 2^(b-1) - 1 (ties go down,
    u = 0 sits on the middle boundary), read back as (signed) zeros."""
    tq = backend.module("turboquant")
    for bits in reference.VALUE_BITS:
        v = np.zeros((2, 128), np.float32)
        indices, scales = tq.encode_values(backend.from_numpy(v), bits)
        assert np.all(backend.to_numpy(indices) == 2 ** (bits - 1) - 1)
        scales = backend.to_numpy(scales)
        assert np.all(scales == 0) and not np.any(np.signbit(scales))
        read = backend.to_numpy(
            tq.decode_values(
                backend.from_numpy(backend.to_numpy(indices)), backend.from_numpy(scales), bits
            )
        )
        assert np.all(read == 0)


def test_zero_point_past_2048_is_rounded(backend) -> None:
    """A group 3001..3016 at 4 bits: step 1, zero point 3001, stored as float16 3000
    (spacing 2 above 2048): the whole group reads one step low, within TQ-12."""
    k = (3001 + np.arange(64, dtype=np.float32) % 16).reshape(1, 64)
    tq = backend.module("turboquant")
    indices, scales, zeros = tq.encode_keys(backend.from_numpy(k), 4)
    assert backend.to_numpy(scales).tolist() == [[1.0, 1.0]]
    assert backend.to_numpy(zeros).tolist() == [[3000.0, 3000.0]]
    read = backend.to_numpy(tq.decode_keys(indices, scales, zeros))
    np.testing.assert_array_equal(read, k - 1)
    bound = turboquant_key_read_bound(k, backend.to_numpy(scales), backend.to_numpy(zeros), 4)
    assert np.all(np.abs(read - k) <= bound)


@pytest.mark.parametrize("dtype_name", sorted(FLOAT_DTYPES))
def test_subnormal_inputs(backend, dtype_name) -> None:
    """Subnormal keys read back within TQ-12; subnormal values square to zero, so their
    groups have rms 0 and read back as zeros. Nothing is NaN or inf."""
    dtype = FLOAT_DTYPES[dtype_name]
    tiny = float(np.finfo(np.float32).smallest_subnormal) if dtype == FLOAT32 else 0.0
    tiny = tiny or float(__import__("ml_dtypes").finfo(dtype).smallest_subnormal)
    steps = np.random.default_rng(5).integers(-64, 64, (1, 1, 3, 128))
    x = (steps * tiny).astype(np.float32).astype(dtype)
    tq = backend.module("turboquant")
    stored = tq.encode(backend.from_numpy(x), backend.from_numpy(x), 4, 4)
    keys, values = (backend.to_numpy(a) for a in tq.decode(stored, 3, 128))
    assert np.all(np.isfinite(keys)) and np.all(np.isfinite(values))
    scales, zeros = backend.to_numpy(stored.k_scales), backend.to_numpy(stored.k_zeros)
    error = np.abs(keys.astype(np.float64) - x.astype(np.float64))
    assert np.all(error <= turboquant_key_read_bound(x, scales, zeros, 4))
    if dtype != FLOAT16:  # float16 subnormals are ~6e-8: their squares are float32 normals
        assert np.all(backend.to_numpy(stored.v_scales) == 0)
        assert np.all(values == 0)


# TQ-1, TQ-2: constants.


def test_constants() -> None:
    for head_dim in reference.HEAD_DIMS:
        assert reference.inv_sqrt(head_dim) == np.float32(1 / math.sqrt(head_dim))
        signs = reference.signs(head_dim)
        assert signs.dtype == FLOAT32 and set(signs.tolist()) == {-1.0, 1.0}
    assert reference.signs(64)[:8].tolist() == [1, -1, -1, -1, 1, 1, 1, -1]  # byte 0x8e
    for bits in reference.VALUE_BITS:
        c = reference.centroids(bits)
        b = reference.boundaries(bits)
        assert c.size == 2**bits and b.size == 2**bits - 1
        assert np.all(np.diff(c) > 0) and np.array_equal(c, -c[::-1])
        assert np.array_equal(b, (c[:-1] + c[1:]) * np.float32(0.5))
        assert b[2 ** (bits - 1) - 1] == 0
    assert reference.centroids(3)[4:].tolist() == pytest.approx(
        [0.2450941789, 0.7560052812, 1.3439092785, 2.1519457045], rel=1e-7
    )


def test_backend_constants_match(backend) -> None:
    tq = backend.module("turboquant")
    for name in ("BLOCK_SIZE", "HEAD_DIMS", "KEY_BITS", "VALUE_BITS"):
        assert getattr(tq, name) == getattr(reference, name), name
    for head_dim in reference.HEAD_DIMS:
        assert_same_bits(backend.to_numpy(tq.signs(head_dim)), reference.signs(head_dim), "signs")
    for bits in reference.VALUE_BITS:
        assert tq.codebook_id(bits) == reference.codebook_id(bits)
        assert_same_bits(backend.to_numpy(tq.centroids(bits)), reference.centroids(bits), "c")
        assert_same_bits(backend.to_numpy(tq.boundaries(bits)), reference.boundaries(bits), "b")


def test_worked_example() -> None:
    """TQ-14's key group and value vector, by hand."""
    k = np.array([[-1.0, 0.0, 0.5, 2.0] * 16], np.float32)
    indices, scales, zeros = reference.encode_keys(k, 2)
    # span 3, scale 1, step f32(1 + 1e-8) = 1, zero rint(-1 / 1) = -1, codes rint(x + 1)
    # with 1.5 tying to 2.
    assert scales.tolist() == [[1.0, 1.0]] and zeros.tolist() == [[-1.0, -1.0]]
    assert indices[0, :4].tolist() == [0, 1, 2, 3]
    assert reference.decode_keys(indices, scales, zeros)[0, :4].tolist() == [-1, 0, 1, 2]
    assert reference.pack_bits(indices, 2)[0, :1].tolist() == [0b11100100]
    v = np.zeros((1, 64), np.float32)
    v[0, :2] = 8.0, 4.0
    # Signs +1, -1: (8, -4) butterflies to (4, 12), copied by later stages, times 1/8.
    assert reference.rotate(v)[0].tolist() == [0.5, 1.5] * 32
    indices, scales = reference.encode_values(v, 2)
    # rms sqrt(1.25); u = 0.447 and 1.342 against boundaries (-0.98159, 0, 0.98159).
    assert scales.tolist() == [[np.float16(1.118), np.float16(1.118)]]
    assert indices[0].tolist() == [2, 3] * 32
    rotated = reference.decode_values_rotated(indices, scales, 2)
    c = reference.centroids(2)
    assert rotated[0, :2].tolist() == [c[2] * scales[0, 0], c[3] * scales[0, 0]]
    read = reference.decode_values(indices, scales, 2)
    assert read[0, :2].tolist() == [np.float32(8.780708), np.float32(4.7304487)]
    assert not read[0, 2:].any()


# TQ-14: the fused CUDA decode.


def test_fused_decode_equals_plain_decode(backend) -> None:
    if backend.name != "accelerated":
        pytest.skip("the fused decode belongs to the MLX backend")
    mx = pytest.importorskip("mlx.core")
    from kvspec.accelerated.device import fused_kernels_enabled

    if not fused_kernels_enabled():
        pytest.skip("needs MLX's CUDA backend")
    from kvspec.accelerated import turboquant as tq
    from kvspec.accelerated.turboquant_kernels import fused_decode

    rng = np.random.default_rng(11)
    for head_dim in reference.HEAD_DIMS:
        for k_bits in reference.KEY_BITS:
            for v_bits in reference.VALUE_BITS:
                k = rng.standard_normal((2, 3, 9, head_dim)).astype(np.float32)
                v = rng.standard_normal((2, 3, 9, head_dim)).astype(np.float32)
                stored = tq.encode(mx.array(k), mx.array(v), k_bits, v_bits)
                fields = [getattr(stored, f)[:, :, :7] for f in FIELDS]
                for defer_v in (False, True):
                    plain = tq.decode_plain(*fields, k_bits, v_bits, head_dim, defer_v)
                    fused = fused_decode(
                        *fields,
                        tq.centroids(v_bits),
                        tq.signs(head_dim),
                        k_bits,
                        v_bits,
                        head_dim,
                        defer_v,
                    )
                    label = f"D={head_dim} k{k_bits} v{v_bits} defer={defer_v}"
                    for name, a, e in zip(("keys", "values"), fused, plain, strict=True):
                        assert_same_bits(np.array(a), np.array(e), f"{label} {name}")
