"""Golden vectors: files a port can check itself against without running Python.

The files follow Wycheproof's shape (STYLE 12): a schema name, a header, notes that
define every flag, groups of tests sharing parameters, and tests with an id, a
comment, flags, hex inputs and outputs (raw little-endian bytes) and an expected
result. They are generated from the reference by `tools/golden.py`; the suite
checks that the committed files equal a fresh generation and that the backend under
test reproduces every stored field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvspec.conformance.strategies import edge_group
from kvspec.reference import affine
from kvspec.reference.dtypes import FLOAT_DTYPES

SCHEMA = "kvspec_vectors_v1"
SPEC_VERSION = "0.1"
VECTORS_DIR = Path(__file__).resolve().parents[1] / "docs" / "vectors"

AFFINE_NOTES = {
    "Normal": "Gaussian values: the common case.",
    "Wide": "Gaussian values scaled by a power of ten between 1e-6 and 1e4.",
    "Constant": "A constant non-zero group (AFF-7): the edge is on the grid, every code is 0 "
    "and the read is exact. A port that divides by the range fails here.",
    "Zeros": "Zeros of both signs (AFF-7): scale -1e-7 in the dtype, bias +0, codes 0.",
    "NonPositive": "No positive value (AFF-3): the minimum is the edge and the scale is "
    "positive. MLX's GPU kernels, which start the maximum at 0, store other bits here.",
    "Tiny": "Values near 1e-6 (AFF-3): the scale floor eps decides.",
    "Subnormal": "Multiples of the dtype's smallest subnormal (AFF-7): q0 is 0, bias 0.",
    "Large": "Large magnitudes that stay finite in the dtype and in float32 ranges.",
    "Ties": "Integers 0..2m with both ends: the scale is -2 and odd values tie (CONV-2). "
    "A port that rounds half away from zero fails here.",
    "NonFinite": "NaN or inf in the input (AFF-1): must be rejected.",
    "RangeOverflow": "max - min overflows float32 (AFF-2): must be rejected.",
    "EdgeOverflow": "A constant group near 1e35: edge / scale overflows (AFF-3): rejected.",
}
EDGE_FLAGS = {
    "normal": "Normal",
    "wide": "Wide",
    "constant": "Constant",
    "zeros": "Zeros",
    "signed_zeros": "Zeros",
    "non_positive": "NonPositive",
    "tiny": "Tiny",
    "subnormal": "Subnormal",
    "large": "Large",
    "ties": "Ties",
}


def to_hex(a: np.ndarray) -> str:
    """Raw little-endian bytes of an array, as hex."""
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes().hex()


def from_hex(text: str, dtype: np.dtype, shape: list[int]) -> np.ndarray:
    """Inverse of to_hex."""
    dtype = np.dtype(dtype)
    return np.frombuffer(bytes.fromhex(text), dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def _affine_valid(tc_id: int, w: np.ndarray, flag: str, group_size: int, bits: int) -> dict:
    wq, scales, biases = affine.quantize(w, group_size, bits)
    read = affine.dequantize(wq, scales, biases, group_size, bits)
    return {
        "tcId": tc_id,
        "comment": AFFINE_NOTES[flag].split(":")[0].split(" (")[0],
        "flags": [flag],
        "shape": list(w.shape),
        "w": to_hex(w),
        "wq": to_hex(wq),
        "scales": to_hex(scales),
        "biases": to_hex(biases),
        "read": to_hex(read),
        "result": "valid",
    }


def _affine_invalid(tc_id: int, w: np.ndarray, flag: str) -> dict:
    return {
        "tcId": tc_id,
        "comment": AFFINE_NOTES[flag].split(":")[0],
        "flags": [flag],
        "shape": list(w.shape),
        "w": to_hex(w),
        "result": "invalid",
    }


def _invalid_inputs(dtype: np.dtype, group_size: int) -> list[tuple[str, np.ndarray]]:
    nan = np.zeros((1, group_size), np.float32)
    nan[0, 3] = np.nan
    inf = np.zeros((1, group_size), np.float32)
    inf[0, 0] = -np.inf
    cases = [("NonFinite", nan), ("NonFinite", inf)]
    if dtype != FLOAT_DTYPES["float16"]:  # float16 cannot hold the magnitudes
        huge = np.zeros((1, group_size), np.float32)
        huge[0, :2] = [-3e38, 3e38]
        cases += [("RangeOverflow", huge), ("EdgeOverflow", np.full((1, group_size), 1e35))]
    return [(flag, w.astype(dtype)) for flag, w in cases]


def build_affine(seed: int = 2026) -> dict[str, Any]:
    """The affine vector file (AFF-1 .. AFF-7), generated from the reference."""
    rng = np.random.default_rng(seed)
    groups, tc_id = [], 0
    for dtype_name, dtype in FLOAT_DTYPES.items():
        for bits in affine.SUPPORTED_BITS:
            for group_size in affine.SUPPORTED_GROUP_SIZES:
                kinds = list(EDGE_FLAGS) if group_size == 32 else ["normal"]
                tests = []
                for kind in kinds:
                    tc_id += 1
                    w = edge_group(kind, group_size, dtype, rng).astype(dtype)[None]
                    tests.append(_affine_valid(tc_id, w, EDGE_FLAGS[kind], group_size, bits))
                if group_size == 32 and bits == 4:
                    for flag, w in _invalid_inputs(dtype, group_size):
                        tc_id += 1
                        tests.append(_affine_invalid(tc_id, w, flag))
                groups.append(
                    {"dtype": dtype_name, "bits": bits, "groupSize": group_size, "tests": tests}
                )
    return {
        "schema": SCHEMA,
        "algorithm": "affine",
        "specVersion": SPEC_VERSION,
        "header": [
            "MLX affine group quantization, docs/spec.md chapter 3.",
            "Arrays are hex of raw little-endian bytes: w, scales, biases, read in the "
            "group's dtype; wq as uint32 words of shape [rows, D * bits / 32].",
            "A valid test must store wq, scales and biases bit for bit; read is the "
            "AFF-6 read on MLX's CPU (other reads must stay within AFF-8).",
            "An invalid test must be rejected before anything is stored.",
        ],
        "notes": AFFINE_NOTES,
        "numberOfTests": tc_id,
        "testGroups": groups,
    }


BUILDERS = {"affine": build_affine}


def vector_path(name: str) -> Path:
    return VECTORS_DIR / f"{name}.json"


def render(vectors: dict[str, Any]) -> str:
    """The canonical text of a vector file."""
    return json.dumps(vectors, indent=1) + "\n"
