"""Golden vectors: files a port can check itself against without running Python.

The files follow Wycheproof's shape (STYLE 12): a schema name, a header, notes that
define every flag, groups of tests sharing parameters, and tests with an id, a
comment, flags, hex inputs and outputs (raw little-endian bytes) and an expected
result. They are generated from the reference by `tools/golden.py`; the suite
checks that the committed files equal a fresh generation and that the backend under
test reproduces every stored field.
"""

from __future__ import annotations

import ast
import json
import operator
from pathlib import Path
from typing import Any

import numpy as np

from kvspec.conformance.cache_scenarios import build_caches
from kvspec.conformance.strategies import edge_group
from kvspec.conformance.vector_inputs import WRONG_SUM_ORDERS, all_centroid_values, rms_order_values
from kvspec.reference import affine, turboquant
from kvspec.reference.dtypes import FLOAT_DTYPES

SCHEMA = "kvspec_vectors_v1"
SPEC_VERSION = "0.4"
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
    "MultiGroup": "Several rows of several groups, each group of another kind (AFF-5): "
    "pins the order of groups, scales and biases and the row strides. A port that mixes "
    "up rows and groups, or packs across rows, fails here.",
}
#: Group kinds cycled through the groups of a MultiGroup test, so neighbours differ.
MULTI_GROUP_KINDS = ("normal", "non_positive", "ties", "constant", "wide", "tiny")
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


def _affine_invalid(tc_id: int, w: np.ndarray, flag: str, group_size: int, bits: int) -> dict:
    """A rejected input, with what a deferred encode stores and ranks instead (DEFER-1,
    DEFER-2)."""
    wq, scales, biases, failure = affine.quantize_deferred(w, group_size, bits)
    return {
        "tcId": tc_id,
        "comment": AFFINE_NOTES[flag].split(":")[0],
        "flags": [flag],
        "shape": list(w.shape),
        "w": to_hex(w),
        "deferredWq": to_hex(wq),
        "deferredScales": to_hex(scales),
        "deferredBiases": to_hex(biases),
        "failureRank": int(failure),
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


def _mixed_groups(
    lead: tuple[int, ...], n_groups: int, group_size: int, dtype: np.dtype, rng
) -> np.ndarray:
    """float32 [*lead, n_groups * group_size], the kinds of MULTI_GROUP_KINDS in turn."""
    count = int(np.prod(lead)) * n_groups
    kinds = [MULTI_GROUP_KINDS[i % len(MULTI_GROUP_KINDS)] for i in range(count)]
    groups = [edge_group(kind, group_size, dtype, rng) for kind in kinds]
    return np.concatenate(groups).reshape(*lead, n_groups * group_size)


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
                tc_id += 1
                w = _mixed_groups((2, 3), 2, group_size, dtype, rng).astype(dtype)
                tests.append(_affine_valid(tc_id, w, "MultiGroup", group_size, bits))
                if group_size == 32 and bits == 4:
                    for flag, w in _invalid_inputs(dtype, group_size):
                        tc_id += 1
                        tests.append(_affine_invalid(tc_id, w, flag, group_size, bits))
                groups.append(
                    {"dtype": dtype_name, "bits": bits, "groupSize": group_size, "tests": tests}
                )
    return {
        "schema": SCHEMA,
        "algorithm": "affine",
        "specVersion": SPEC_VERSION,
        "header": [
            "MLX affine group quantization, docs/spec.md chapter 3.",
            "Arrays are hex of raw little-endian bytes, each field's dtype and shape as "
            "schema.json says: w, scales, biases, read in the group's dtype; wq as uint32 "
            "words of shape [..., D * bits / 32], `shape` being w's [..., D].",
            "A valid test must store wq, scales and biases bit for bit; read is the "
            "AFF-6 read on MLX's CPU (other reads must stay within AFF-8).",
            "An invalid test must be rejected before anything is stored; a deferred encode "
            "(DEFER-1, DEFER-2) must store its deferred fields bit for bit and return its "
            "failureRank.",
        ],
        "notes": AFFINE_NOTES,
        "numberOfTests": tc_id,
        "testGroups": groups,
    }


TURBOQUANT_NOTES = {
    "Normal": "Gaussian keys and values: the common case.",
    "OutlierChannels": "Gaussian with four channels 20x larger, as real keys have.",
    "ConstantKey": "Constant key groups (TQ-11): they read back as f16(c), never NaN "
    "(vllm-metal stores an infinite zero point there).",
    "Zeros": "All-zero keys and values (TQ-11): zero scales, codes at the zero point.",
    "NonPositive": "Key groups with no positive value.",
    "Tiny": "Values near 1e-6: EPS = 1e-8 is small against the scale but not negligible.",
    "Subnormal": "Multiples of the dtype's smallest subnormal (TQ-11).",
    "Ties": "Small integers: key codes and the rms land on exact values.",
    "ZeroPointPast2048": "Key groups far from zero (TQ-11): the float16 zero point is "
    "rounded, so the read is off by whole steps; the stored bits are still exact.",
    "NonFinite": "NaN or inf in keys or values (TQ-3): must be rejected.",
    "UnsupportedHeadDim": "head_dim 96 (TQ-1): must be rejected. Its group says headDim 96.",
    "MultiRow": "Several batch rows, heads and positions whose groups are of different "
    "kinds (TQ-10): pins the order of vectors, groups and their scales.",
    "RmsOrder": "Values crafted so that summing a group's squares in another order than "
    "TQ-7's halving tree changes a stored bit; row j defeats the j-th of: "
    + ", ".join(WRONG_SUM_ORDERS)
    + " (sequential left to right; a float64 sum; NumPy's float32 sum; an FMA in the "
    "first level).",
    "AllCentroids": "Values whose codes use every centroid of the value codebook (TQ-2): a "
    "wrong table entry fails here.",
    "ZeroPointOverflow": "A key zero point beyond float16 (TQ-3): must be rejected.",
    "ValueScaleOverflow": "A value group rms beyond float16 from finite values (TQ-3): must "
    "be rejected; deferred, its codes are 0 (DEFER-1).",
}
TURBOQUANT_EDGE_FLAGS = {
    "normal": "Normal",
    "constant": "ConstantKey",
    "zeros": "Zeros",
    "non_positive": "NonPositive",
    "tiny": "Tiny",
    "subnormal": "Subnormal",
    "ties": "Ties",
}
TURBOQUANT_FIELDS = ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales")
#: [B, H, L] of a MultiRow test per head_dim: several of each, within the size budget.
MULTI_ROW_SHAPES = {64: (2, 2, 2), 128: (1, 2, 2), 256: (1, 2, 1), 512: (1, 2, 1)}


def _vector_of(kind: str, head_dim: int, dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    """One float32 vector whose 32-groups are all of one kind."""
    groups = [edge_group(kind, turboquant.BLOCK_SIZE, dtype, rng) for _ in range(head_dim // 32)]
    return np.concatenate(groups)


def _turboquant_inputs(
    flag: str, head_dim: int, dtype: np.dtype, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Keys and values [1, 1, 2, head_dim] for one flag, in `dtype`."""
    if flag == "OutlierChannels":
        kv = rng.standard_normal((2, 1, 1, 2, head_dim)).astype(np.float32)
        kv[..., rng.choice(head_dim, 4, replace=False)] *= 20.0
        return kv[0].astype(dtype), kv[1].astype(dtype)
    if flag == "ZeroPointPast2048":
        keys = (100 + rng.uniform(0, 0.5, (1, 1, 2, head_dim))).astype(np.float32)
        values = rng.standard_normal((1, 1, 2, head_dim)).astype(np.float32)
        return keys.astype(dtype), values.astype(dtype)
    kind = {v: k for k, v in TURBOQUANT_EDGE_FLAGS.items()}[flag]
    rows = [_vector_of(kind, head_dim, dtype, rng) for _ in range(4)]
    kv = np.stack(rows).reshape(2, 1, 1, 2, head_dim)
    return kv[0].astype(dtype), kv[1].astype(dtype)


def _crafted_inputs(
    flag: str, v_bits: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """float32 keys and values [1, 1, L, 64] of an RmsOrder or AllCentroids test."""
    values = rms_order_values(v_bits, rng) if flag == "RmsOrder" else all_centroid_values(v_bits)
    keys = rng.standard_normal(values.shape).astype(np.float32)
    return keys[None, None], values[None, None]


#: Each TurboQuant field's name when an invalid test carries its deferred encoding.
DEFERRED_TURBOQUANT_FIELDS = {
    "k_idx": "deferredKIdx",
    "k_scales": "deferredKScales",
    "k_zeros": "deferredKZeros",
    "v_packed": "deferredVPacked",
    "v_scales": "deferredVScales",
}


def _turboquant_valid(tc_id: int, flag: str, k: np.ndarray, v: np.ndarray, bits: tuple) -> dict:
    t = turboquant.encode(k, v, *bits)
    keys, values = turboquant.decode(t, k.shape[2], k.shape[3])
    _, rotated = turboquant.decode(t, k.shape[2], k.shape[3], defer_v=True)
    return {
        "tcId": tc_id,
        "comment": TURBOQUANT_NOTES[flag].split(":")[0].split(" (")[0],
        "flags": [flag],
        "shape": list(k.shape),
        "k": to_hex(k),
        "v": to_hex(v),
        **{field: to_hex(getattr(t, field)) for field in TURBOQUANT_FIELDS},
        "keysRead": to_hex(keys),
        "valuesRead": to_hex(values),
        "valuesRotated": to_hex(rotated),
        "result": "valid",
    }


def _turboquant_invalid(
    tc_id: int, flag: str, k: np.ndarray, v: np.ndarray, bits: tuple[int, int] | None
) -> dict:
    """A rejected input; with `bits`, what a deferred encode of those widths stores and
    ranks instead (DEFER-1, DEFER-2)."""
    test = {
        "tcId": tc_id,
        "comment": TURBOQUANT_NOTES[flag].split(":")[0],
        "flags": [flag],
        "shape": list(k.shape),
        "k": to_hex(k),
        "v": to_hex(v),
    }
    if bits is not None:
        t, failure = turboquant.encode_deferred(k, v, *bits)
        for field in TURBOQUANT_FIELDS:
            test[DEFERRED_TURBOQUANT_FIELDS[field]] = to_hex(getattr(t, field))
        test["failureRank"] = failure
    return test | {"result": "invalid"}


def build_turboquant(seed: int = 2026) -> dict[str, Any]:
    """The TurboQuant vector file (TQ-1 .. TQ-11), generated from the reference."""
    rng = np.random.default_rng(seed)
    bit_pairs = [(2, 2), (3, 3), (4, 4), (5, 5), (8, 8), (8, 4), (4, 2)]
    edge_flags = [*TURBOQUANT_EDGE_FLAGS.values(), "OutlierChannels", "ZeroPointPast2048"]
    groups, tc_id = [], 0
    for dtype_name, dtype in FLOAT_DTYPES.items():
        for head_dim in turboquant.HEAD_DIMS:
            for k_bits, v_bits in bit_pairs:
                if head_dim > 128 and (k_bits, v_bits) != (4, 4):
                    continue  # the larger head dims only change the rotation's length
                edges = head_dim == 64 and k_bits == v_bits and k_bits in (2, 4, 8)
                flags = edge_flags if edges else ["Normal"]
                tests = []
                for flag in flags:
                    tc_id += 1
                    k, v = _turboquant_inputs(flag, head_dim, dtype, rng)
                    tests.append(_turboquant_valid(tc_id, flag, k, v, (k_bits, v_bits)))
                tc_id += 1
                k, v = _mixed_groups(
                    (2, *MULTI_ROW_SHAPES[head_dim]), head_dim // 32, 32, dtype, rng
                )
                tests.append(
                    _turboquant_valid(
                        tc_id, "MultiRow", k.astype(dtype), v.astype(dtype), (k_bits, v_bits)
                    )
                )
                if dtype_name == "float32" and head_dim == 64 and k_bits == v_bits:
                    for flag in ("RmsOrder", "AllCentroids"):
                        tc_id += 1
                        k, v = _crafted_inputs(flag, v_bits, rng)
                        tests.append(_turboquant_valid(tc_id, flag, k, v, (k_bits, v_bits)))
                groups.append(
                    {
                        "dtype": dtype_name,
                        "headDim": head_dim,
                        "kBits": k_bits,
                        "vBits": v_bits,
                        "tests": tests,
                    }
                )
        invalid = []
        normal = rng.standard_normal((2, 1, 1, 2, 64)).astype(np.float32)
        nan_keys = normal[0].copy()
        nan_keys[0, 0, 1, 5] = np.nan
        inf_values = normal[1].copy()
        inf_values[0, 0, 0, 0] = np.inf
        odd = rng.standard_normal((2, 1, 1, 2, 96)).astype(np.float32)
        cases = [
            ("NonFinite", nan_keys, normal[1]),
            ("NonFinite", normal[0], inf_values),
        ]
        if dtype_name == "float32":  # the other dtypes cannot hold such keys
            far = (1e6 + rng.uniform(0, 1, (1, 1, 2, 64))).astype(np.float32)
            cases.append(("ZeroPointOverflow", far, normal[1]))
            loud = normal[1].copy()
            loud[0, 0, 1] *= 1e5  # a row whose group rms is beyond float16
            cases.append(("ValueScaleOverflow", normal[0], loud))
        for flag, k, v in cases:
            tc_id += 1
            invalid.append(
                _turboquant_invalid(tc_id, flag, k.astype(dtype), v.astype(dtype), (4, 4))
            )
        groups.append(
            {"dtype": dtype_name, "headDim": 64, "kBits": 4, "vBits": 4, "tests": invalid}
        )
        tc_id += 1
        unsupported = _turboquant_invalid(
            tc_id, "UnsupportedHeadDim", odd[0].astype(dtype), odd[1].astype(dtype), None
        )
        groups.append(
            {"dtype": dtype_name, "headDim": 96, "kBits": 4, "vBits": 4, "tests": [unsupported]}
        )
    return {
        "schema": SCHEMA,
        "algorithm": "turboquant",
        "specVersion": SPEC_VERSION,
        "header": [
            "TurboQuant keys and values, docs/spec.md chapter 4.",
            "Arrays are hex of raw little-endian bytes. k, v: the group's dtype, shape "
            "[B, H, L, D]; k_idx: int8 [B, H, L, D] at 8 key bits, else uint8 "
            "[B, H, L, D * kBits / 8]; k_scales, k_zeros, v_scales: float16 "
            "[B, H, L, D / 32]; v_packed: uint8 [B, H, L, D * vBits / 8]; keysRead, "
            "valuesRead, valuesRotated: float32 [B, H, L, D] (TQ-10).",
            "A valid test must store the five fields and read the three arrays bit for bit.",
            "An invalid test must be rejected before anything is stored; one whose input "
            "the format judges (not its shape) also carries what a deferred encode stores "
            "(the deferred* fields, bit for bit) and its failureRank (DEFER-1, DEFER-2).",
        ],
        "notes": TURBOQUANT_NOTES,
        "numberOfTests": tc_id,
        "testGroups": groups,
    }


def build_cache_scenarios(seed: int = 2026) -> dict[str, Any]:
    """The cache scenario file (chapter 5), generated from the reference."""
    return build_caches(seed, SPEC_VERSION, SCHEMA)


BUILDERS = {
    "affine": build_affine,
    "turboquant": build_turboquant,
    "caches": build_cache_scenarios,
}
#: The vector files of the codecs (chapters 3 and 4); "caches" holds chapter 5's scenarios.
CODEC_FILES = ("affine", "turboquant")
_OPERATORS = {ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv, ast.Add: operator.add}


def _evaluate(node: ast.AST, names: dict[str, Any]) -> Any:
    """An expression of schema.json's `kvspecArray` (integer arithmetic, `x if a == b else
    y`); a name that is no parameter stands for itself (a dtype name)."""
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, names)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return names.get(node.id, node.id)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.left, names), _evaluate(node.right, names))
    if isinstance(node, ast.IfExp):
        chosen = node.body if _evaluate(node.test, names) else node.orelse
        return _evaluate(chosen, names)
    if isinstance(node, ast.Compare) and [type(op) for op in node.ops] == [ast.Eq]:
        return _evaluate(node.left, names) == _evaluate(node.comparators[0], names)
    raise ValueError(f"unsupported expression in schema.json: {ast.dump(node)}")


def load_schema() -> dict[str, Any]:
    return json.loads((VECTORS_DIR / "schema.json").read_text())


def array_layout(
    schema: dict[str, Any], algorithm: str, group: dict[str, Any], test: dict[str, Any], field: str
) -> tuple[np.dtype, list[int]]:
    """dtype and shape of an array field of a test, as schema.json's `kvspecArray` says."""
    layout = schema["$defs"][f"{algorithm}Test"]["properties"][field]["kvspecArray"]
    *lead, D = test["shape"]
    names = {key: value for key, value in group.items() if key != "tests"} | {"D": D}
    if algorithm == "turboquant":
        names |= dict(zip("BHL", lead, strict=True))
    if layout["dtype"] == "dtype":
        dtype = FLOAT_DTYPES[group["dtype"]]
    else:
        dtype = np.dtype(_evaluate(ast.parse(layout["dtype"], mode="eval"), names))
    shape: list[int] = []
    for entry in layout["shape"]:
        shape += lead if entry == "..." else [_evaluate(ast.parse(entry, mode="eval"), names)]
    return dtype, shape


def array_fields(schema: dict[str, Any], algorithm: str) -> list[str]:
    """The fields of a test that hold arrays, in schema order."""
    properties = schema["$defs"][f"{algorithm}Test"]["properties"]
    return [name for name, value in properties.items() if "kvspecArray" in value]


def field_array(
    schema: dict[str, Any], algorithm: str, group: dict[str, Any], test: dict[str, Any], field: str
) -> np.ndarray:
    """An array field of a test, decoded with its schema layout."""
    dtype, shape = array_layout(schema, algorithm, group, test, field)
    return from_hex(test[field], dtype, shape)


def vector_path(name: str) -> Path:
    return VECTORS_DIR / f"{name}.json"


def render(vectors: dict[str, Any]) -> str:
    """The canonical text of a vector file."""
    return json.dumps(vectors, indent=1) + "\n"
