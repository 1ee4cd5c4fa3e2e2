"""Bit streams (BITS-1 .. BITS-3): layout by hand, round trips, and backend equality."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.backend import backend_of_side
from kvspec.conformance.compare import assert_same_bits
from kvspec.reference import bits as reference_bits


def test_three_bit_codes_by_hand() -> None:
    # BITS-1: codes 5, 3, 7, 1, 0, 6, 2, 4, each written LSB first, give the stream
    # 101 110 111 100 000 011 010 001; bytes take 8 stream bits each, LSB first.
    codes = np.array([[5, 3, 7, 1, 0, 6, 2, 4]], np.uint8)
    packed = reference_bits.pack_bytes(codes, 3)
    assert packed.tolist() == [[0xDD, 0x03, 0x8B]]


def test_words_are_little_endian() -> None:
    # BITS-2: eight 4-bit codes 1..8 fill one word, code 0 in the lowest nibble.
    codes = np.arange(1, 9, dtype=np.uint32)[None]
    assert reference_bits.pack_words(codes, 4).tolist() == [[0x87654321]]


@st.composite
def code_rows(draw: st.DrawFn, unit: int) -> tuple[np.ndarray, int]:
    bits = draw(st.integers(1, 8))
    per_unit = unit // np.gcd(unit, bits)  # codes needed to fill whole units
    count = per_unit * draw(st.integers(1, 4))
    rows = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    codes = np.random.default_rng(seed).integers(0, 2**bits, (rows, count), dtype=np.uint32)
    return codes, bits


@given(code_rows(8))
def test_bytes_round_trip(case: tuple[np.ndarray, int]) -> None:
    codes, bits = case
    packed = reference_bits.pack_bytes(codes, bits)
    assert packed.shape[-1] == codes.shape[-1] * bits // 8
    unpacked = reference_bits.unpack_bytes(packed, bits, codes.shape[-1])
    np.testing.assert_array_equal(unpacked, codes)


@given(code_rows(32))
def test_backend_packs_the_reference_bits(backend, case: tuple[np.ndarray, int]) -> None:
    codes, bits = case
    count = codes.shape[-1]
    backend_bits = backend.module("bits")
    for pack, unpack, dtype in (
        ("pack_words", "unpack_words", np.uint32),
        ("pack_bytes", "unpack_bytes", np.uint8),
    ):
        expected = getattr(reference_bits, pack)(codes, bits)
        packed = getattr(backend_bits, pack)(backend.from_numpy(codes), bits)
        assert_same_bits(backend.to_numpy(packed), expected, pack)
        unpacked = getattr(backend_bits, unpack)(packed, bits, count)
        assert_same_bits(backend.to_numpy(unpacked), codes.astype(dtype), unpack)


@pytest.mark.parametrize("bits", [0, 9])
def test_unsupported_width_is_rejected(bits: int) -> None:
    with pytest.raises(ValueError, match=r"bits must be in 1\.\.8"):
        reference_bits.pack_bytes(np.zeros((1, 8), np.uint8), bits)


@pytest.mark.parametrize("side", ["reference", "backend"])
def test_unpacking_takes_rows_of_its_dtype_and_length_alone(backend, side: str) -> None:
    """BITS-1, BITS-2: a packed row is count * bits / 8 uint8 bytes, or count * bits / 32
    uint32 words; another dtype alone, or another length alone, raises."""
    checker = backend_of_side(backend, side)
    bits, to = checker.module("bits"), checker.from_numpy
    streams = [
        (bits.unpack_bytes, np.zeros((1, 3), np.uint8), np.int8, np.zeros((1, 4), np.uint8)),
        (bits.unpack_words, np.zeros((1, 3), np.uint32), np.int32, np.zeros((1, 2), np.uint32)),
    ]
    for unpack, row, other_dtype, other_length in streams:
        unpack(to(row), 3, row.itemsize * 8)
        for bad in (row.astype(other_dtype), other_length):
            with pytest.raises(ValueError, match="expected"):
                unpack(to(bad), 3, row.itemsize * 8)


def test_bytes_become_words_from_whole_uint8_words_alone() -> None:
    """BITS-2: four uint8 bytes a word; int8 bytes, or a row not of whole words, raise."""
    reference_bits.bytes_to_words(np.zeros((1, 8), np.uint8))
    for bad in (np.zeros((1, 8), np.int8), np.zeros((1, 6), np.uint8)):
        with pytest.raises(ValueError, match="multiple of 4"):
            reference_bits.bytes_to_words(bad)
