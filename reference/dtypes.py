"""Floating-point formats and exact conversions between them (spec CONV-1, CONV-2).

Every codec computes in float32. Inputs arrive in float32, float16 or bfloat16 and
widen to float32 exactly; stored fields narrow to their format by round to nearest,
ties to even. NumPy's float16 and ml_dtypes' bfloat16 both narrow that way.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FLOAT32 = np.dtype(np.float32)
FLOAT16 = np.dtype(np.float16)
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

#: The input formats every codec accepts, by the names the spec uses.
FLOAT_DTYPES: dict[str, np.dtype] = {
    "float32": FLOAT32,
    "float16": FLOAT16,
    "bfloat16": BFLOAT16,
}


def dtype_name(dtype: np.dtype) -> str:
    """The spec's name of a supported float format; ValueError for anything else (CONV-1)."""
    for name, candidate in FLOAT_DTYPES.items():
        if np.dtype(dtype) == candidate:
            return name
    supported = ", ".join(FLOAT_DTYPES)
    raise ValueError(f"unsupported dtype {np.dtype(dtype)}: expected one of {supported}")


def widen(x: np.ndarray) -> np.ndarray:
    """float32 copy of a float32/float16/bfloat16 array; exact (CONV-1)."""
    dtype_name(x.dtype)
    return x.astype(FLOAT32)


def narrow(x32: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Round a float32 array to `dtype`, to nearest, ties to even (CONV-2)."""
    assert x32.dtype == FLOAT32
    dtype_name(dtype)
    return x32.astype(dtype)


#: The quiet NaN each format stores for a field it could not hold (DEFER-1), as bits.
QUIET_NAN_BITS = {"float32": 0x7FC00000, "float16": 0x7E00, "bfloat16": 0x7FC0}


def quiet_nan(dtype: np.dtype) -> np.ndarray:
    """The 0-d array of `dtype` holding QUIET_NAN_BITS (DEFER-1)."""
    name = dtype_name(dtype)
    unsigned = np.uint32 if name == "float32" else np.uint16
    return np.array(QUIET_NAN_BITS[name], unsigned).view(np.dtype(dtype))


def unit_roundoff(dtype: np.dtype) -> float:
    """Half the distance from 1 to the next value: the relative error of one rounding (CONV-2)."""
    return float(ml_dtypes.finfo(dtype).eps) / 2


def smallest_subnormal(dtype: np.dtype) -> float:
    """The smallest positive value of `dtype`; absolute rounding error is at most half of it
    in the subnormal range (CONV-2)."""
    return float(ml_dtypes.finfo(dtype).smallest_subnormal)


def largest_finite(dtype: np.dtype) -> float:
    """The largest finite value of `dtype` (CONV-1)."""
    return float(ml_dtypes.finfo(dtype).max)
