"""The JSON lines protocol between `python -m kvspec.conformance.port` and a port's command
(docs/porting.md, section 2).

The runner writes one request per line to the command's stdin and reads one response
per line from its stdout, in order:

    {"id": 7, "op": "affine.quantize", "inputs": {"w": ARRAY, "groupSize": 64, "bits": 4}}
    {"id": 7, "outputs": {"wq": ARRAY, "scales": ARRAY, "biases": ARRAY}}

ARRAY is {"dtype": "bfloat16", "shape": [2, 64], "hex": "..."}: the raw little-endian
bytes, as in the golden vectors. A request the port rejects (CONV-5) is answered
{"id": 7, "error": "message"}. Operations:
- "affine.quantize" {w, groupSize, bits} -> {wq, scales, biases} (AFF-5);
- "turboquant.encode" {k, v, kBits, vBits} -> the five fields of TQ-10 and the reads
  {keysRead, valuesRead, valuesRotated} (TQ-5, TQ-8);
- "cache.run" {cache, arguments, dtype, steps} -> {outcomes}: a cache scenario's steps
  (conformance/cache_scenarios.py) without their recorded results, and per step
  {rejected, trimmed (trims only), after}.
A port that does not implement an operation answers {"id": 7, "unsupported": true}.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvspec.reference.dtypes import FLOAT_DTYPES

OPERATIONS = ("affine.quantize", "turboquant.encode", "cache.run")
AFFINE_OUTPUTS = ("wq", "scales", "biases")
TURBOQUANT_OUTPUTS = (
    *("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales"),
    *("keysRead", "valuesRead", "valuesRotated"),
)


def encode_array(a: np.ndarray) -> dict[str, Any]:
    """ARRAY of the protocol: dtype name, shape and raw little-endian bytes as hex."""
    a = np.ascontiguousarray(a)
    little = a.astype(a.dtype.newbyteorder("<"))
    return {"dtype": a.dtype.name, "shape": list(a.shape), "hex": little.tobytes().hex()}


def decode_array(message: dict[str, Any]) -> np.ndarray:
    """Inverse of encode_array; ValueError for an unknown dtype or a wrong byte count."""
    name = message["dtype"]
    dtype = np.dtype(FLOAT_DTYPES.get(name, name))
    raw = bytes.fromhex(message["hex"])
    count = int(np.prod(message["shape"], dtype=np.int64))
    if len(raw) != count * dtype.itemsize:
        raise ValueError(f"{len(raw)} bytes cannot hold {name} {message['shape']}")
    return np.frombuffer(raw, dtype.newbyteorder("<")).astype(dtype).reshape(message["shape"])
