"""KV storage schemes (SCHEME-1 .. SCHEME-4): the grammar, its errors, and the cache each
scheme names per layer, on the backend."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

from kvspec.conformance.cache_machine import random_kv
from kvspec.reference.caches import scheme as reference_scheme
from kvspec.reference.caches.scheme import (
    AffineLayer,
    AffineLayersScheme,
    AffineScheme,
    Bf16Scheme,
    TurboScheme,
    parse_scheme,
)
from kvspec.reference.dtypes import BFLOAT16


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("bf16", Bf16Scheme()),
        ("affine:4:64", AffineScheme(4, 64, 0)),
        ("affine:8:32:start=256", AffineScheme(8, 32, 256)),
        (
            "affine-layers:0=4/64,3=8/32:start=16",
            AffineLayersScheme((AffineLayer(0, 4, 64), AffineLayer(3, 8, 32)), 16),
        ),
        ("turbo:k8v4", TurboScheme(8, 4, 0)),
        ("turbo:k4v3:start=128", TurboScheme(4, 3, 128)),
        ("turbo:k8v4:deferred", TurboScheme(8, 4, 0, "deferred")),
        ("turbo:k5v2:dense:start=7", TurboScheme(5, 2, 7, "dense")),
    ],
)
def test_parse(text, expected) -> None:
    assert parse_scheme(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "bf8",
        "bf16:start=4",
        "start=4",
        "start=",
        "affine:4",
        "affine:7:64",
        "affine:4:48",
        "affine:4:64:start=-1",
        "affine:4:64:start=x",
        "affine-layers:0=4",
        "affine-layers:0=4/64,0=8/64",
        "turbo:8:4",
        "turbo:k8",
        "turbo:k6v4",
        "turbo:k8v6",
        "turbo:k8v4:fused",
        "turbo:k8v4:deferred:dense",
    ],
)
def test_malformed_scheme_says_what_is_expected(text) -> None:
    with pytest.raises(ValueError, match="expected bf16 \\| affine:BITS:GROUP"):
        parse_scheme(text)


def test_composition(backend) -> None:
    caches = backend.module("caches")
    compose = backend.module("caches.scheme")
    assert isinstance(compose.composed_full_attention_cache(Bf16Scheme(), 0), caches.KVCache)
    full = compose.composed_full_attention_cache(parse_scheme("affine:4:64:start=8"), 2)
    assert isinstance(full, caches.Bf16FirstQuantizedKVCache)
    assert (full.bits, full.group_size, full.start) == (4, 64, 8)
    sliding = compose.composed_sliding_attention_cache(AffineScheme(8, 32), 1, 16)
    assert isinstance(sliding, caches.Bf16FirstRotatingQuantizedKVCache)
    assert (sliding.max_size, sliding.bits, sliding.group_size) == (16, 8, 32)
    layers = parse_scheme("affine-layers:1=4/64")
    assert isinstance(compose.composed_full_attention_cache(layers, 0), caches.KVCache)
    assert compose.composed_full_attention_cache(layers, 1).bits == 4
    assert isinstance(
        compose.composed_sliding_attention_cache(layers, 0, 8), caches.RotatingKVCache
    )


def test_turbo_sliding_layers_stay_plain_with_one_warning(backend, monkeypatch) -> None:
    compose = backend.module("caches.scheme")
    monkeypatch.setattr(reference_scheme, "_warned_turbo_sliding", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = compose.composed_sliding_attention_cache(TurboScheme(8, 4), 0, 8)
        compose.composed_sliding_attention_cache(TurboScheme(8, 4), 1, 8)
    assert isinstance(first, backend.module("caches").RotatingKVCache)
    assert len([w for w in caught if "sliding-window layers stay bf16" in str(w.message)]) == 1


def test_a_process_warns_at_its_first_turbo_sliding_layer() -> None:
    """SCHEME-3: once per process, and from the first sliding layer a process composes
    (the test above resets the flag; a new process starts with it)."""
    code = (
        "import warnings\n"
        "from kvspec.reference import caches\n"
        "from kvspec.reference.caches.scheme import TurboScheme, sliding_attention_cache\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    for layer in range(3):\n"
        "        sliding_attention_cache(TurboScheme(8, 4), layer, 8, caches)\n"
        "print(sum('sliding-window layers stay bf16' in str(w.message) for w in caught))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "1"


@pytest.mark.parametrize("kernels", ["dense", "deferred"])
def test_turbo_full_attention_layers_are_bf16_first_turboquant(backend, kernels) -> None:
    """SCHEME-4: every full-attention layer, whatever its index, gets the bf16-first
    TurboQuant cache of the scheme's widths, start and kernels; it converts as B16F-2 says."""
    caches = backend.module("caches")
    compose = backend.module("caches.scheme")
    scheme = parse_scheme(f"turbo:k4v3:{kernels}:start=5")
    for layer in (0, 3):
        cache = compose.composed_full_attention_cache(scheme, layer)
        assert isinstance(cache, caches.Bf16FirstTurboQuantKVCache)
        assert (cache.k_bits, cache.v_bits, cache.start, cache.kernels) == (4, 3, 5, kernels)
    k, v = random_kv(0, (1, 2, 6, 64), 64, BFLOAT16)
    cache.update_and_fetch(backend.from_numpy(k), backend.from_numpy(v))
    assert cache.converted and isinstance(cache.storage, caches.TurboQuantKVCache)
    assert cache.storage.kernels == kernels
    assert cache.signature() == "kv:bf16-first:kv:turboquant:4:3"
    assert cache.minimum_reusable_offset == 6
