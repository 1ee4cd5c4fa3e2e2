"""Float formats on MLX, and exact moves between mx.array and NumPy (spec CONV-1, CONV-2)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvspec.reference import dtypes as reference_dtypes

FLOAT32 = mx.float32
FLOAT16 = mx.float16
BFLOAT16 = mx.bfloat16

#: The input formats every codec accepts, by the names the spec uses.
FLOAT_DTYPES: dict[str, mx.Dtype] = {
    "float32": FLOAT32,
    "float16": FLOAT16,
    "bfloat16": BFLOAT16,
}

_BITS_VIEW = {mx.bfloat16: mx.uint16}


_NAMES = {dtype: name for name, dtype in FLOAT_DTYPES.items()}


def dtype_name(dtype: mx.Dtype) -> str:
    """The spec's name of a supported float format; ValueError for anything else (CONV-1)."""
    name = _NAMES.get(dtype) if isinstance(dtype, mx.Dtype) else None
    if name is None:
        raise ValueError(f"unsupported dtype {dtype}: expected one of {', '.join(FLOAT_DTYPES)}")
    return name


def widen(x: mx.array) -> mx.array:
    """float32 copy of a float32/float16/bfloat16 array; exact (CONV-1)."""
    dtype_name(x.dtype)
    return x.astype(FLOAT32)


def narrow(x32: mx.array, dtype: mx.Dtype) -> mx.array:
    """Round a float32 array to `dtype`, to nearest, ties to even (CONV-2)."""
    dtype_name(dtype)
    return x32.astype(dtype)


def quiet_nan(dtype: mx.Dtype) -> mx.array:
    """The 0-d array of `dtype` holding the spec's quiet NaN bits (DEFER-1); built from the
    bits, since MLX's own float16 NaN conversion sets other ones."""
    name = dtype_name(dtype)
    unsigned = mx.uint32 if name == "float32" else mx.uint16
    return mx.array(reference_dtypes.QUIET_NAN_BITS[name], unsigned).view(dtype)


def to_numpy(x: mx.array) -> np.ndarray:
    """The same bits as a NumPy array (bfloat16 through ml_dtypes)."""
    if x.dtype in _BITS_VIEW:
        return np.array(x.view(_BITS_VIEW[x.dtype])).view(reference_dtypes.BFLOAT16)
    return np.array(x)


def from_numpy(a: np.ndarray) -> mx.array:
    """The same bits as an mx.array."""
    return mx.array(a)
