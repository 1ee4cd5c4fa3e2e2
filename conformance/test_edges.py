"""Fixed edge cases the spec names, where random draws are too rare to rely on (CONV-2,
CONV-3, CONV-4, AFF-4, AFF-6, AFF-7, TQ-4, TQ-11): exact ties at every key and value width,
-0 inside a nonzero group, constant groups, and the affine decode's two roundings.

Expected codes come from Python's `round`, which rounds half to even on its own, not from
the reference; the backend must then store the reference's bits.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvspec.conformance.compare import assert_same_bits
from kvspec.reference import affine, turboquant
from kvspec.reference.bits import unpack_words
from kvspec.reference.dtypes import FLOAT_DTYPES

DTYPES = sorted(FLOAT_DTYPES)


def _affine_tie_group(bits: int, group_size: int) -> np.ndarray:
    """0, 2n and odd integers up to n (n = 2^bits - 1): the scale is exactly -2 with bias
    2n (AFF-3), so each odd value's code (2n - w) / 2 is an exact tie. All values are exact
    in every format (at most 8 significant bits)."""
    n = 2**bits - 1
    odd = np.arange(1, n + 1, 2, dtype=np.float32)
    group = np.resize(odd, group_size)
    group[0], group[-1] = 0, 2 * n
    return group


def _affine_codes(wq: np.ndarray, bits: int, D: int) -> list[int]:
    return [int(c) for c in unpack_words(wq, bits, D).reshape(-1)]


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("group_size", affine.SUPPORTED_GROUP_SIZES)
@pytest.mark.parametrize("bits", affine.SUPPORTED_BITS)
def test_affine_ties_round_half_to_even(backend, bits, group_size, dtype_name) -> None:
    """AFF-4, CONV-2: every odd value of the group sits on a tie; codes round it to even."""
    group = _affine_tie_group(bits, group_size)
    w = group.reshape(1, group_size).astype(FLOAT_DTYPES[dtype_name])
    n = 2**bits - 1
    expected = [round((2 * n - float(x)) / 2) for x in group]
    assert sum(((2 * n - float(x)) / 2) % 1 == 0.5 for x in group) >= group_size // 2
    fields = affine.quantize(w, group_size, bits)
    assert _affine_codes(fields[0], bits, group_size) == expected
    _assert_every_encoder_stores(backend, w, group_size, bits)


def _encoders(backend) -> list[dict[str, str]]:
    """Options naming each encoder the backend has (AFF-9), or none for a backend of one."""
    available = getattr(backend.module("affine"), "available_encoders", None)
    return [{"encoder": name} for name in available()] if available else [{}]


def _assert_every_encoder_stores(backend, w: np.ndarray, group_size: int, bits: int) -> None:
    """Every encoder of the backend stores the reference's fields of `w` (AFF-9)."""
    expected = affine.quantize(w, group_size, bits)
    quantize = backend.module("affine").quantize
    for options in _encoders(backend):
        stored = quantize(backend.from_numpy(w), group_size, bits, **options)
        for name, got, want in zip(("wq", "scales", "biases"), stored, expected, strict=True):
            assert_same_bits(backend.to_numpy(got), want, f"{name} {options}")


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("bits", affine.SUPPORTED_BITS)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_affine_negative_zero_in_a_nonzero_group(backend, bits, dtype_name, sign) -> None:
    """CONV-2, AFF-7: -0 beside nonzero values is an ordinary zero; a constant group and
    an all -0 group store AFF-7's fields."""
    dtype = FLOAT_DTYPES[dtype_name]
    rows = np.zeros((3, 32), np.float32)
    rows[0] = sign * np.arange(32) / 4
    rows[0, ::5] = -0.0
    rows[1] = sign * 0.375
    rows[2] = -0.0
    w = rows.astype(dtype)
    fields = affine.quantize(w, 32, bits)
    assert fields[1][2, 0] == np.float32(-1e-7).astype(dtype) and fields[2][2, 0] == 0
    _assert_every_encoder_stores(backend, w, 32, bits)
    read = backend.to_numpy(
        backend.module("affine").dequantize(*map(backend.from_numpy, fields), 32, bits)
    )
    assert_same_bits(read[1], w[1], "a constant group reads back exactly")


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("bits", affine.SUPPORTED_BITS)
def test_affine_decode_rounds_twice(backend, bits, dtype_name) -> None:
    """AFF-6, CONV-3: code * scale is rounded to the format, then + bias rounded again; no
    fused multiply-add. Where the backend says its decode is exact (QKV-2), bit for bit."""
    if not backend.exact_affine_decode:
        pytest.skip("this backend's affine decode is held to AFF-8's bound only (QKV-2)")
    dtype = FLOAT_DTYPES[dtype_name]
    rng = np.random.default_rng(bits)
    w = (rng.standard_normal((64, 128)) * 3).astype(dtype)
    fields = affine.quantize(w, 64, bits)
    codes = np.array(_affine_codes(fields[0], bits, 128), np.float64).reshape(64, 2, 64)
    scales = fields[1].astype(np.float64)[..., None]
    biases = fields[2].astype(np.float64)[..., None]
    product = (codes * scales).astype(np.float32).astype(dtype).astype(np.float64)
    expected = (product + biases).astype(np.float32).astype(dtype).reshape(64, 128)
    assert_same_bits(affine.dequantize(*fields, 64, bits), expected, "reference decode")
    got = backend.module("affine").dequantize(*map(backend.from_numpy, fields), 64, bits)
    assert_same_bits(backend.to_numpy(got), expected, "backend decode")


def _key_tie_group(bits: int) -> np.ndarray:
    """32 keys whose code quotient x / step - zero is exactly k + 1/2 for most of them:
    8 bits spans [-127, 127] (scale 1, zero 0), b bits spans [0, 2^b - 1] (scale 1, zero
    0); the step scale + EPS rounds to 1 in float32 (TQ-4)."""
    if bits == turboquant.SIGNED_KEY_BITS:
        ties = [2.5, -3.5, 0.5, -0.5, 1.5, -1.5, 126.5, -126.5, 64.5, -64.5]
        ends = [-127.0, 127.0]
    else:
        top = 2**bits - 1
        ties = [i + 0.5 for i in range(top)]
        ends = [0.0, float(top)]
    return np.resize(np.array(ends + ties, np.float32), 32)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("bits", turboquant.KEY_BITS)
def test_turboquant_key_ties_round_half_to_even(backend, bits, dtype_name) -> None:
    """TQ-4, CONV-2: key codes of exact ties round half to even at every key width (8-bit
    signed included: 2.5 -> 2, -3.5 -> -4)."""
    group = _key_tie_group(bits)
    k = np.tile(group, 2).reshape(1, 1, 1, 64).astype(FLOAT_DTYPES[dtype_name])
    v = np.zeros_like(k)
    expected = [round(float(x)) for x in np.tile(group, 2)]
    stored = turboquant.encode(k, v, bits, 2)
    indices = turboquant.unpack_bits(stored.k_idx, bits, 64)
    assert [int(i) for i in indices.reshape(-1)] == expected
    assert np.all(stored.k_scales == 1) and np.all(stored.k_zeros == 0)
    got = backend.module("turboquant").encode(backend.from_numpy(k), backend.from_numpy(v), bits, 2)
    for name in ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales"):
        assert_same_bits(backend.to_numpy(getattr(got, name)), getattr(stored, name), name)


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("bits", turboquant.KEY_BITS)
def test_turboquant_negative_zero_and_constant_key_groups(backend, bits, dtype_name) -> None:
    """TQ-11, CONV-4: groups are 32 consecutive elements of head_dim; -0 beside nonzero
    keys, a constant group and an all -0 group store the reference's bits; the constant
    reads back as itself in float16, the zeros as +0."""
    dtype = FLOAT_DTYPES[dtype_name]
    k = np.zeros((1, 1, 1, 128), np.float32)
    k[..., :32] = np.linspace(-1, 2, 32)
    k[..., 0:32:7] = -0.0
    k[..., 32:64] = 0.625
    k[..., 64:96] = -0.0
    k[..., 96:] = -0.25
    k = k.astype(dtype)
    v = np.ones_like(k)
    stored = turboquant.encode(k, v, bits, 3)
    keys, _ = turboquant.decode(stored, 1, 128)
    assert np.all(keys[..., 32:64] == 0.625) and np.all(keys[..., 96:] == -0.25)
    assert_same_bits(keys[..., 64:96], np.zeros((1, 1, 1, 32), np.float32), "zeros read +0")
    got = backend.module("turboquant").encode(backend.from_numpy(k), backend.from_numpy(v), bits, 3)
    for name in ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales"):
        assert_same_bits(backend.to_numpy(getattr(got, name)), getattr(stored, name), name)


@pytest.mark.parametrize("bits", turboquant.KEY_BITS)
def test_turboquant_near_the_float16_limit(backend, bits) -> None:
    """TQ-3, TQ-11: keys and values up to float16's largest finite value store the
    reference's bits; a key scale beyond float16 is rejected by both."""
    k = np.linspace(-65504, 65504, 64).astype(np.float16).reshape(1, 1, 1, 64)
    v = k[..., ::-1].copy()
    stored = turboquant.encode(k, v, bits, 4)
    assert all(np.all(np.isfinite(getattr(stored, f))) for f in ("k_scales", "v_scales"))
    got = backend.module("turboquant").encode(backend.from_numpy(k), backend.from_numpy(v), bits, 4)
    for name in ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales"):
        assert_same_bits(backend.to_numpy(getattr(got, name)), getattr(stored, name), name)
    wide = np.linspace(-3e7, 3e7, 64, dtype=np.float32).reshape(1, 1, 1, 64)
    small = np.ones_like(wide)
    with pytest.raises(ValueError, match="float16"):
        turboquant.encode(wide, small, bits, 4)
    with pytest.raises(ValueError, match="float16"):
        backend.module("turboquant").encode(
            backend.from_numpy(wide), backend.from_numpy(small), bits, 4
        )
