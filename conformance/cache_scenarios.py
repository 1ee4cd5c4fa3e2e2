"""Cache scenarios for the golden vectors (chapter 5): per cache kind, a sequence of
operations with the state after each step, so a port of the caches can be checked
without Python.

A scenario's steps are JSON objects. `op` is one of:
- "append": `update_and_fetch(k, v)` of hex inputs of shape [B, H, L, D] in the group's
  dtype (L = 1 is a decode);
- "trim": `trim(n)`, which returns `trimmed`;
- "restore": `state()`, then a new cache built as the current one was, `restore_state`
  of that state; the scenario goes on with the new cache;
- "convert": `to_quantized(groupSize, bits)` of a KVCache or RotatingKVCache, or
  `TurboQuantKVCache.from_kv_cache(cache, kBits, vBits)`; the scenario goes on with the
  result, the source is consumed.
A step with `"rejected": true` must raise ValueError and change nothing; the scenario
goes on with the cache as it was. Every step records `after`: the cache's signature,
offset, ring index, minimum reusable offset, bytes per token and its state arrays
(CACHE-8, RING-6), each with name, dtype, shape and hex bytes. `play` runs a scenario
on any backend; the builder runs it on the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np

from kvspec.reference import caches as reference_caches
from kvspec.reference.dtypes import FLOAT_DTYPES

AFFINE_FIELDS = ("k_words", "k_scales", "k_biases", "v_words", "v_scales", "v_biases")
TURBOQUANT_FIELDS = ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales")

#: State slot names by storage kind (CACHE-8, RING-6, TQC-5).
SLOT_NAMES = {
    "kv": ("keys", "values"),
    "kv:rotating": ("keys", "values"),
    "kv:affine": AFFINE_FIELDS,
    "kv:rotating-affine": AFFINE_FIELDS,
    "kv:turboquant": TURBOQUANT_FIELDS,
}

CACHE_NOTES = {
    "Growable": "Growable storage (CACHE-3 .. CACHE-5, CACHE-8): appends of several "
    "lengths, decodes, trims, a restored state.",
    "Ring": "A ring (RING-1 .. RING-6): the window wraps, multi-position appends after the "
    "wrap reorder the buffer; the first `keep` positions stay.",
    "Conversion": "A conversion (CACHE-9, QRING-2, TQC-3) and appends after it.",
    "Bf16First": "A bf16-first cache (B16F-1 .. B16F-6): the append that makes it due "
    "converts the storage; its state is the held storage's.",
    "Rejected": "A step that must raise ValueError and change nothing (CACHE-2, RING-5).",
}


def slot_names(signature: str) -> tuple[str, ...]:
    """Names of a state's arrays, from its signature (parameters dropped)."""
    storage = signature.removeprefix("kv:bf16-first:")
    return SLOT_NAMES[":".join(part for part in storage.split(":") if not part.isdigit())]


def _hex(a: np.ndarray) -> str:
    return np.ascontiguousarray(a).astype(a.dtype.newbyteorder("<")).tobytes().hex()


def observe(cache: Any, to_numpy: Callable[[Any], np.ndarray]) -> dict[str, Any]:
    """What a step records of a cache: its state and sizes."""
    state = cache.state()
    arrays = []
    names = slot_names(state.signature) if state.arrays else ()
    for name, array in zip(names, state.arrays, strict=True):
        a = to_numpy(array)
        arrays.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "hex": _hex(a)})
    return {
        "signature": state.signature,
        "offset": state.offset,
        "ringIndex": state.ring_index,
        "minimumReusableOffset": state.minimum_reusable_offset,
        "bytesPerToken": cache.bytes_per_token(),
        "arrays": arrays,
    }


def _convert(caches: ModuleType, cache: Any, step: dict[str, Any]) -> tuple[Any, str, dict]:
    """The converted cache and how to build an empty one of its kind (for "restore")."""
    if "kBits" in step:
        kinds = {"k_bits": step["kBits"], "v_bits": step["vBits"]}
        converted = caches.TurboQuantKVCache.from_kv_cache(cache, **kinds)
        return converted, "TurboQuantKVCache", kinds
    affine = {"group_size": step["groupSize"], "bits": step["bits"]}
    converted = cache.to_quantized(**affine)
    if isinstance(cache, caches.RotatingKVCache):
        ring = {"max_size": cache.max_size, "keep": cache.keep}
        return converted, "RotatingQuantizedKVCache", ring | affine
    return converted, "QuantizedKVCache", affine


def play(
    caches: ModuleType,
    from_numpy: Callable[[np.ndarray], Any],
    to_numpy: Callable[[Any], np.ndarray],
    group: dict[str, Any],
    steps: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Run a scenario's steps on a backend's caches module: per step its outcome, as
    `expected_outcome` reads it from a recorded step. A step that raises ValueError is
    `rejected` and the scenario goes on with the cache as it is."""
    kind, arguments = group["cache"], group["arguments"]
    cache = getattr(caches, kind)(**arguments)
    dtype = FLOAT_DTYPES[group["dtype"]]
    outcomes = []
    for step in steps:
        outcome: dict[str, Any] = {"rejected": False}
        try:
            if step["op"] == "append":
                k, v = (
                    from_numpy(np.frombuffer(bytes.fromhex(step[x]), dtype).reshape(step["shape"]))
                    for x in ("k", "v")
                )
                cache.update_and_fetch(k, v)
            elif step["op"] == "trim":
                outcome["trimmed"] = cache.trim(step["n"])
            elif step["op"] == "restore":
                state = cache.state()
                cache = getattr(caches, kind)(**arguments)
                cache.restore_state(state)
            else:
                cache, kind, arguments = _convert(caches, cache, step)
        except ValueError:
            outcome = {"rejected": True}
        outcomes.append(outcome | {"after": observe(cache, to_numpy)})
    return outcomes


def expected_outcome(step: dict[str, Any]) -> dict[str, Any]:
    """What `play` must report for a recorded step."""
    outcome = {"rejected": step.get("rejected", False)}
    if "trimmed" in step:
        outcome["trimmed"] = step["trimmed"]
    return outcome | {"after": step["after"]}


def _append(rng: np.random.Generator, dtype: np.dtype, length: int, head_dim: int = 64) -> dict:
    """An append step of Gaussian keys and values [1, 2, length, head_dim]."""
    k, v = rng.standard_normal((2, 1, 2, length, head_dim)).astype(np.float32)
    return {
        "op": "append",
        "shape": list(k.shape),
        "k": _hex(k.astype(dtype)),
        "v": _hex(v.astype(dtype)),
    }


def script_steps(rng: np.random.Generator, dtype: np.dtype, script: list) -> list[dict]:
    """Steps of a script of (op, *args) tuples: ("append", L), ("head_dim_change",),
    ("trim", n), ("bad_trim", n), ("restore",), ("convert", arguments)."""
    steps = []
    for entry in script:
        op, *args = entry
        if op == "append":
            steps.append(_append(rng, dtype, args[0]))
        elif op == "head_dim_change":
            steps.append(_append(rng, dtype, 1, head_dim=128) | {"rejected": True})
        elif op == "trim":
            steps.append({"op": "trim", "n": args[0]})
        elif op == "bad_trim":
            steps.append({"op": "trim", "n": args[0], "rejected": True})
        elif op == "restore":
            steps.append({"op": "restore"})
        else:
            steps.append({"op": "convert", **args[0]})
    return steps


RING_SCRIPT = [
    *[("append", length) for length in (5, 1, 1, 1, 1, 3, 1, 1)],
    ("bad_trim", 1),
    ("restore",),
    ("append", 2),
]
GROWABLE_SCRIPT = [
    *[("append", length) for length in (5, 1, 1, 3)],
    ("trim", 2),
    ("append", 1),
    ("head_dim_change",),
    ("restore",),
    ("append", 2),
    ("trim", 9),
    ("append", 1),
]
BF16_FIRST_SCRIPT = [*[("append", length) for length in (3, 1, 1, 2, 1)], ("restore",)]

#: (flag, cache, arguments, dtype, script) per scenario.
SCENARIOS = [
    ("Growable", "KVCache", {}, "bfloat16", GROWABLE_SCRIPT),
    ("Growable", "QuantizedKVCache", {"group_size": 64, "bits": 4}, "bfloat16", GROWABLE_SCRIPT),
    ("Growable", "QuantizedKVCache", {"group_size": 32, "bits": 3}, "float16", GROWABLE_SCRIPT),
    ("Growable", "TurboQuantKVCache", {"k_bits": 8, "v_bits": 4}, "bfloat16", GROWABLE_SCRIPT),
    ("Growable", "TurboQuantKVCache", {"k_bits": 4, "v_bits": 2}, "float32", GROWABLE_SCRIPT),
    ("Ring", "RotatingKVCache", {"max_size": 8}, "bfloat16", RING_SCRIPT),
    ("Ring", "RotatingKVCache", {"max_size": 8, "keep": 2}, "bfloat16", RING_SCRIPT),
    (
        "Ring",
        "RotatingQuantizedKVCache",
        {"max_size": 8, "group_size": 32, "bits": 4, "keep": 2},
        "bfloat16",
        RING_SCRIPT,
    ),
    (
        "Conversion",
        "KVCache",
        {},
        "bfloat16",
        [("append", 5), ("convert", {"groupSize": 64, "bits": 4}), ("append", 1), ("restore",)],
    ),
    (
        "Conversion",
        "KVCache",
        {},
        "bfloat16",
        [("append", 3), ("trim", 1), ("convert", {"kBits": 4, "vBits": 3}), ("append", 2)],
    ),
    (
        "Conversion",
        "RotatingKVCache",
        {"max_size": 6, "keep": 1},
        "bfloat16",
        [("append", 4), ("convert", {"groupSize": 32, "bits": 8}), ("append", 1), ("append", 1)],
    ),
    (
        "Conversion",
        "RotatingKVCache",
        {"max_size": 6},
        "bfloat16",
        [*[("append", 1)] * 8, ("convert", {"groupSize": 64, "bits": 2}), ("append", 3)],
    ),
    (
        "Bf16First",
        "Bf16FirstQuantizedKVCache",
        {"group_size": 64, "bits": 4, "start": 4},
        "bfloat16",
        BF16_FIRST_SCRIPT,
    ),
    (
        "Bf16First",
        "Bf16FirstRotatingQuantizedKVCache",
        {"max_size": 6, "group_size": 32, "bits": 4, "start": 5},
        "bfloat16",
        BF16_FIRST_SCRIPT,
    ),
    (
        "Bf16First",
        "Bf16FirstTurboQuantKVCache",
        {"k_bits": 8, "v_bits": 4, "start": 4},
        "bfloat16",
        BF16_FIRST_SCRIPT,
    ),
    (
        "Bf16First",
        "Bf16FirstTurboQuantKVCache",
        {"k_bits": 4, "v_bits": 4, "start": 0},
        "float16",
        BF16_FIRST_SCRIPT,
    ),
]


def _numpy(a: Any) -> np.ndarray:
    return np.asarray(a)


def build_caches(seed: int, spec_version: str, schema: str) -> dict[str, Any]:
    """The cache scenario file (chapter 5), generated from the reference."""
    rng = np.random.default_rng(seed)
    groups, tc_id = [], 0
    for flag, kind, arguments, dtype_name, script in SCENARIOS:
        tc_id += 1
        group = {"cache": kind, "arguments": arguments, "dtype": dtype_name}
        steps = script_steps(rng, FLOAT_DTYPES[dtype_name], script)
        outcomes = play(reference_caches, _numpy, _numpy, group, steps)
        previous = None
        for step, outcome in zip(steps, outcomes, strict=True):
            assert outcome["rejected"] == step.get("rejected", False), f"{kind}: {step['op']}"
            assert not outcome["rejected"] or outcome["after"] == previous, "rejected, changed"
            step.update({key: value for key, value in outcome.items() if key != "rejected"})
            previous = outcome["after"]
        flags = [flag, *(["Rejected"] if any(s.get("rejected") for s in steps) else [])]
        test = {
            "tcId": tc_id,
            "comment": f"{kind}: {CACHE_NOTES[flag].split(' (')[0]}",
            "flags": flags,
            "steps": steps,
            "result": "valid",
        }
        groups.append(group | {"tests": [test]})
    return {
        "schema": schema,
        "algorithm": "caches",
        "specVersion": spec_version,
        "header": [
            "Cache scenarios, docs/spec.md chapter 5; steps as conformance/cache_scenarios.py "
            "describes: append (hex k, v of `shape` in the group's dtype), trim, restore, "
            "convert; `rejected` steps must raise and change nothing.",
            "After each step: signature, offset, ringIndex, minimumReusableOffset, "
            "bytesPerToken and the state arrays (name, dtype, shape, hex of little-endian "
            "bytes), all of which a port must reproduce exactly.",
        ],
        "notes": CACHE_NOTES,
        "numberOfTests": tc_id,
        "testGroups": groups,
    }
