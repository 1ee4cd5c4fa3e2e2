"""Deliberately wrong ports of the codecs: what the golden vectors must catch.

`Port(fault)` implements chapters 3 and 4 of docs/spec.md in plain NumPy, written from
the spec's steps and not from the reference (only the frozen tables are shared, and
`conformance/test_spec_tables.py` holds them to the spec). With `fault=None` it is a
faithful port and reproduces every vector; each name in FAULTS switches on one mistake
a porter could make, and `conformance/test_vector_mutants.py` requires that each of them
fails at least one vector.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvspec.conformance.compare import first_difference
from kvspec.conformance.vector_inputs import WRONG_SUM_ORDERS, halving_tree
from kvspec.conformance.vectors import field_array
from kvspec.reference.turboquant_tables import INV_SQRT_BITS, POSITIVE_CENTROID_BITS, SIGN_HEX

F32 = np.float32
AFFINE_EPS = F32(1e-7)
TURBOQUANT_EPS = F32(1e-8)
HEAD_DIMS = (64, 128, 256, 512)

FAULTS: dict[str, str] = {
    "affine_half_away": "AFF-3/AFF-4 round half away from zero (C's round)",
    "affine_max_seeded_at_zero": "AFF-2's maximum starts at 0, as MLX's GPU kernels do",
    "affine_eps_dropped": "AFF-3 without the scale floor eps",
    "affine_edge_not_snapped": "AFF-3 without q0: scale span / n, bias the minimum",
    "affine_scale_from_storage": "AFF-4 codes with the stored T(scale), not the float32 one",
    "affine_reciprocal": "AFF-4 multiplies by 1 / scale instead of dividing",
    "affine_words_msb_first": "BITS-2 streams filled from each byte's most significant bit",
    "affine_range_unchecked": "AFF-2's range overflow not rejected",
    "key_half_away": "TQ-4 rounds half away from zero",
    "key_eps_dropped": "TQ-4 step = scale, without EPS",
    "key_negative_zero_kept": "TQ-4 stores a zero point of -0",
    "key_constant_rule_dropped": "TQ-11's constant-group rule dropped",
    "key_scale_from_storage": "TQ-4 codes with f16(scale) + EPS",
    "key_signed_levels_255": "TQ-4 8-bit keys with n = 255 instead of 254",
    "key_decode_distributed": "TQ-5 decodes code * scale + zero * scale",
    "signs_msb_first": "TQ-1 sign bits read from each byte's most significant bit",
    "hadamard_scale_first": "TQ-6 multiplies by 1/sqrt(D) before the butterflies",
    "transform_in_input_dtype": "TQ-6 butterflies rounded to the input's float16/bfloat16",
    **{f"rms_{name}": f"TQ-7 sums the squares {name}" for name in WRONG_SUM_ORDERS},
    "rms_from_storage": "TQ-7 divides by f16(rms) + EPS",
    "value_eps_dropped": "TQ-7 divides by rms, without EPS",
    "boundary_inclusive": "TQ-7 counts boundaries b <= u (ties go up)",
    "values_packed_msb_first": "TQ-9 packs values from each byte's most significant bit",
}


def _half_away(x: np.ndarray) -> np.ndarray:
    return np.copysign(np.floor(np.abs(x) + F32(0.5)), x).astype(F32)


def _float32_from_bits(patterns: tuple[int, ...] | int) -> np.ndarray:
    return np.array(patterns, np.uint32).view(F32)


class Port:
    """The codecs with at most one fault (a key of FAULTS) switched on."""

    def __init__(self, fault: str | None = None) -> None:
        if fault is not None and fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; expected one of {sorted(FAULTS)}")
        self.fault = fault

    def _rint(self, x: np.ndarray, fault: str) -> np.ndarray:
        return _half_away(x) if self.fault == fault else np.rint(x)

    def _bit_order(self, fault: str | None) -> str:
        return "big" if fault is not None and self.fault == fault else "little"

    def _stream(self, codes: np.ndarray, bits: int, fault: str | None) -> np.ndarray:
        """BITS-1: codes [..., count] as one LSB-first byte stream per row."""
        *lead, count = codes.shape
        weights = np.arange(bits, dtype=np.uint32)
        stream = ((codes.astype(np.uint32)[..., None] >> weights) & 1).astype(np.uint8)
        return np.packbits(stream.reshape(*lead, count * bits), -1, self._bit_order(fault))

    # Chapter 3

    def affine_quantize(
        self, w: np.ndarray, group_size: int, bits: int
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(wq, scales, biases), AFF-1 .. AFF-5."""
        x = w.astype(F32)
        if not np.all(np.isfinite(x)):
            raise ValueError("non-finite input")
        x = x.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
        n = F32(2**bits - 1)
        w_min = x.min(axis=-1)
        w_max = x.max(axis=-1)
        if self.fault == "affine_max_seeded_at_zero":
            w_max = np.maximum(w_max, F32(0))
        with np.errstate(all="ignore"):
            span = w_max - w_min
            if self.fault != "affine_range_unchecked" and not np.all(np.isfinite(span)):
                raise ValueError("range overflow")
            scale = span / n
            if self.fault != "affine_eps_dropped":
                scale = np.maximum(scale, AFFINE_EPS)
            if self.fault == "affine_edge_not_snapped":
                bias = w_min
            else:
                negative = np.abs(w_min) > np.abs(w_max)
                scale = np.where(negative, scale, -scale)
                edge = np.where(negative, w_min, w_max)
                q0 = self._rint(edge / scale, "affine_half_away")
                if not np.all(np.isfinite(q0)):
                    raise ValueError("edge overflow")
                snapped = q0 != 0
                scale = np.where(snapped, edge / np.where(snapped, q0, F32(1)), scale)
                bias = np.where(snapped, edge, F32(0))
            scales, biases = scale.astype(w.dtype), bias.astype(w.dtype)
            if self.fault == "affine_scale_from_storage":
                scale = scales.astype(F32)
            shifted = x - bias[..., None]
            if self.fault == "affine_reciprocal":
                quotient = shifted * (F32(1) / scale)[..., None]
            else:
                quotient = shifted / scale[..., None]
            codes = np.clip(self._rint(quotient, "affine_half_away"), 0, n)
        codes = np.nan_to_num(codes).astype(np.uint32).reshape(w.shape)
        stream = self._stream(codes, bits, "affine_words_msb_first")
        return stream.view("<u4"), scales, biases

    # Chapter 4

    def _signs(self, head_dim: int) -> np.ndarray:
        table = np.frombuffer(bytes.fromhex(SIGN_HEX[head_dim]), np.uint8)
        negative = np.unpackbits(table, bitorder=self._bit_order("signs_msb_first"))
        return np.where(negative == 1, F32(-1), F32(1))

    def _hadamard(self, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
        *lead, D = x.shape
        scale = _float32_from_bits(INV_SQRT_BITS[D])
        narrow = self.fault == "transform_in_input_dtype" and dtype != F32
        if self.fault == "hadamard_scale_first":
            x = x * scale
        h = 1
        while h < D:
            pairs = x.reshape(*lead, D // (2 * h), 2, h)
            x = np.stack(
                [pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]], -2
            )
            x = x.reshape(*lead, D)
            if narrow:
                x = x.astype(dtype).astype(F32)
            h *= 2
        return x if self.fault == "hadamard_scale_first" else x * scale

    def _centroids(self, bits: int) -> np.ndarray:
        positive = _float32_from_bits(POSITIVE_CENTROID_BITS[bits])
        return np.concatenate([-positive[::-1], positive])

    def _encode_keys(self, x: np.ndarray, bits: int) -> tuple[np.ndarray, ...]:
        signed = bits == 8
        if signed:
            n = F32(255 if self.fault == "key_signed_levels_255" else 254)
        else:
            n = F32(2**bits - 1)
        top, bottom = x.max(axis=-1), x.min(axis=-1)
        with np.errstate(all="ignore"):
            span = top - bottom
            scale = span / n
            step = scale if self.fault == "key_eps_dropped" else scale + TURBOQUANT_EPS
            if signed:
                zero = self._rint((top + bottom) / (step * F32(2)), "key_half_away")
            else:
                zero = self._rint(bottom / step, "key_half_away")
            if self.fault != "key_negative_zero_kept":
                zero = zero + F32(0)
            constant = span == 0
            if self.fault == "key_constant_rule_dropped":
                constant = np.zeros_like(constant)
            sign = np.sign(top).astype(F32)
            scale = np.where(constant, np.abs(top), scale)
            zero = np.where(constant, F32(0) if signed else np.minimum(sign, F32(0)), zero)
            scales, zeros = scale.astype(np.float16), zero.astype(np.float16)
            if not (np.all(np.isfinite(scales)) and np.all(np.isfinite(zeros))):
                raise ValueError("key scale or zero point beyond float16")
            if self.fault == "key_scale_from_storage":
                step = scales.astype(F32) + TURBOQUANT_EPS
            codes = self._rint(x / step[..., None] - zero[..., None], "key_half_away")
        codes = np.where(constant[..., None], (sign - zero)[..., None], codes)
        if signed:
            return np.clip(codes, -127, 127).astype(np.int8), scales, zeros
        return np.clip(codes, 0, n).astype(np.uint8), scales, zeros

    def _encode_values(self, y: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
        order = self.fault.removeprefix("rms_") if self.fault else None
        total = WRONG_SUM_ORDERS[order](y) if order in WRONG_SUM_ORDERS else halving_tree(y)
        with np.errstate(all="ignore"):
            rms = np.sqrt(total / F32(32))
            scales = rms.astype(np.float16)
            if not np.all(np.isfinite(scales)):
                raise ValueError("value rms beyond float16")
            if self.fault == "rms_from_storage":
                rms = scales.astype(F32)
            denominator = rms if self.fault == "value_eps_dropped" else rms + TURBOQUANT_EPS
            u = y / denominator[..., None]
        c = self._centroids(bits)
        boundaries = (c[:-1] + c[1:]) * F32(0.5)
        if self.fault == "boundary_inclusive":
            below = boundaries <= u[..., None]
        else:
            below = boundaries < u[..., None]
        return np.count_nonzero(below, axis=-1).astype(np.uint8), scales

    def turboquant(
        self, k: np.ndarray, v: np.ndarray, k_bits: int, v_bits: int
    ) -> dict[str, np.ndarray]:
        """The five stored fields (TQ-10) and the three reads of the vectors."""
        B, H, L, D = k.shape
        if D not in HEAD_DIMS:
            raise ValueError(f"head_dim {D}")
        x, values = k.astype(F32), v.astype(F32)
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(values))):
            raise ValueError("non-finite input")
        signs = self._signs(D)
        key_codes, k_scales, k_zeros = self._encode_keys(x.reshape(B, H, L, D // 32, 32), k_bits)
        y = self._hadamard(values * signs, v.dtype).reshape(B, H, L, D // 32, 32)
        value_codes, v_scales = self._encode_values(y, v_bits)
        # Reads (TQ-5, TQ-8).
        code_values = key_codes.astype(F32)
        zeros32, scales32 = k_zeros.astype(F32)[..., None], k_scales.astype(F32)[..., None]
        if self.fault == "key_decode_distributed":
            keys = code_values * scales32 + zeros32 * scales32
        else:
            keys = (code_values + zeros32) * scales32
        rotated = self._centroids(v_bits)[value_codes] * v_scales.astype(F32)[..., None]
        rotated = rotated.reshape(B, H, L, D)
        return {
            "k_idx": self._packed(key_codes.reshape(B, H, L, D), k_bits, None),
            "k_scales": k_scales,
            "k_zeros": k_zeros,
            "v_packed": self._packed(
                value_codes.reshape(B, H, L, D), v_bits, "values_packed_msb_first"
            ),
            "v_scales": v_scales,
            "keysRead": keys.reshape(B, H, L, D),
            "valuesRead": self._hadamard(rotated, F32) * signs,
            "valuesRotated": rotated,
        }

    def _packed(self, codes: np.ndarray, bits: int, fault: str | None) -> np.ndarray:
        """TQ-9: packed below 8 bits, unchanged at 8."""
        return codes if bits == 8 else self._stream(codes, bits, fault)


def run_port(port: Port, vectors: dict[str, Any], schema: dict[str, Any]) -> str | None:
    """None if `port` reproduces every test of a vector file, else the first failure."""
    algorithm = vectors["algorithm"]
    for group in vectors["testGroups"]:
        for test in group["tests"]:
            where = f"{algorithm} tcId {test['tcId']} ({', '.join(test['flags'])})"
            inputs = ["w"] if algorithm == "affine" else ["k", "v"]
            arrays = [field_array(schema, algorithm, group, test, name) for name in inputs]
            try:
                if algorithm == "affine":
                    stored = port.affine_quantize(*arrays, group["groupSize"], group["bits"])
                    produced = dict(zip(("wq", "scales", "biases"), stored, strict=True))
                else:
                    produced = port.turboquant(*arrays, group["kBits"], group["vBits"])
            except ValueError as error:
                if test["result"] == "invalid":
                    continue
                return f"{where}: rejected a valid test ({error})"
            if test["result"] == "invalid":
                return f"{where}: accepted an invalid test"
            for field, actual in produced.items():
                expected = field_array(schema, algorithm, group, test, field)
                difference = first_difference(np.asarray(actual), expected)
                if difference is not None:
                    return f"{where} {field}: {difference}"
    return None
