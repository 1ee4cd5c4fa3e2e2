"""Donor reads (DONOR-1, DONOR-2): the reference against the appended positions run
through the codecs directly, the backend against the reference, and the refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.cache_machine import assert_read_within_bound, random_kv
from kvspec.conformance.compare import assert_same_bits
from kvspec.reference import affine, turboquant
from kvspec.reference import caches as reference
from kvspec.reference.dtypes import FLOAT_DTYPES

#: Cache kinds by a factory over a backend's caches package.
KINDS: dict[str, Callable[[Any], Any]] = {
    "kv": lambda m: m.KVCache(),
    "rotating": lambda m: m.RotatingKVCache(4),
    "rotating-keep": lambda m: m.RotatingKVCache(6, 2),
    "affine": lambda m: m.QuantizedKVCache(32, 4),
    "rotating-affine": lambda m: m.RotatingQuantizedKVCache(5, 32, 8),
    "turbo": lambda m: m.TurboQuantKVCache(8, 4, "deferred"),
    "bf16-first-turbo": lambda m: m.Bf16FirstTurboQuantKVCache(4, 3, 6),
    "bf16-first-rotating": lambda m: m.Bf16FirstRotatingQuantizedKVCache(3, 32, 2, 4),
}


def _codec_window(storage: Any, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Positions k, v [B, H, T, D] as `storage` decodes them, through the codecs alone."""
    signature = storage.signature()
    if signature == "kv" or signature.startswith("kv:rotating:"):
        return k, v
    if "affine" in signature:
        g, b = storage.group_size, storage.bits
        return (
            affine.dequantize(*affine.quantize(k, g, b), g, b),
            affine.dequantize(*affine.quantize(v, g, b), g, b),
        )
    t = turboquant.encode(k, v, storage.k_bits, storage.v_bits)
    return turboquant.decode(t, k.shape[2], k.shape[3])


@given(
    kind=st.sampled_from(sorted(KINDS)),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=5),
    trimmed=st.integers(0, 2),
    dtype=st.sampled_from(sorted(FLOAT_DTYPES)),
    batch=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_donor_rows(backend, kind, lengths, trimmed, dtype, batch, seed) -> None:
    """DONOR-1: the reference lends the window's positions decoded, oldest first, with
    offsets, starts and ends; the backend lends the same positions; DONOR-2: the drafter's
    read attends over them within READ-1's bound."""
    dtype = FLOAT_DTYPES[dtype]
    ref, twin = KINDS[kind](reference), KINDS[kind](backend.module("caches"))
    history = []
    for step, length in enumerate(lengths):
        k, v = random_kv(seed + step, (batch, 2, length, 64), 64, dtype)
        history.append((k, v))
        ref.update_and_fetch(k, v)
        twin.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    if ref.is_trimmable():
        ref.trim(trimmed)
        twin.trim(trimmed)
    storage = ref.storage if isinstance(ref, reference.Bf16FirstCache) else ref
    offset = ref.offset
    window = storage.sliding_window
    if offset == 0 or (window is not None and storage.keep > 0 and offset > window):
        for cache in ref, twin:
            with pytest.raises(ValueError):
                reference.capture_donor_rows(cache)
        return
    start = 0 if window is None else max(0, offset - window)
    appended_k = np.concatenate([k for k, _ in history], axis=2)[:, :, start:offset]
    appended_v = np.concatenate([v for _, v in history], axis=2)[:, :, start:offset]
    keys, values = _codec_window(storage, appended_k, appended_v)
    rows = reference.capture_donor_rows(ref)
    assert (rows.offsets, rows.starts, rows.ends) == (
        (offset,) * batch,
        (start,) * batch,
        (offset,) * batch,
    )
    assert_same_bits(rows.keys, keys, "donor keys")
    assert_same_bits(rows.values, values, "donor values")
    lent = backend.module("caches").capture_donor_rows(twin)
    assert (lent.offsets, lent.starts, lent.ends) == (rows.offsets, rows.starts, rows.ends)
    assert backend.to_numpy(lent.keys).shape == keys.shape
    queries = random_kv(seed + 99, (batch, 4, 2, 64), 64, dtype)[0]
    assert_read_within_bound(
        reference.capture_donor_attention(ref),
        backend.module("caches").capture_donor_attention(twin),
        queries,
        backend,
    )


def test_donor_rows_of_an_empty_cache_are_refused(backend) -> None:
    """DONOR-1: nothing appended, or everything trimmed."""
    family = backend.module("caches")
    cache = family.QuantizedKVCache(32, 4)
    with pytest.raises(ValueError, match="empty cache"):
        family.capture_donor_rows(cache)
    k = backend.from_numpy(np.ones((1, 1, 2, 64), np.float32))
    cache.update_and_fetch(k, k)
    cache.trim(2)
    with pytest.raises(ValueError, match="empty cache"):
        family.capture_donor_attention(cache)
