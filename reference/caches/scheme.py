"""KV storage schemes and the cache each names for a layer (spec SCHEME-1 .. SCHEME-4)."""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from kvspec.reference import affine, turboquant
from kvspec.reference.caches.protocol import check_checks
from kvspec.reference.caches.turboquant import KERNELS


@dataclass(frozen=True)
class Bf16Scheme:
    """Every layer plain (SCHEME-1)."""


@dataclass(frozen=True)
class AffineScheme:
    """Every layer bf16-first affine (SCHEME-1)."""

    bits: int
    group_size: int
    quantized_kv_start: int = 0


@dataclass(frozen=True)
class AffineLayer:
    """One listed layer of an affine-layers scheme (SCHEME-1)."""

    layer: int
    bits: int
    group_size: int


@dataclass(frozen=True)
class AffineLayersScheme:
    """Listed layers bf16-first affine with their own widths, the others plain (SCHEME-1)."""

    layers: tuple[AffineLayer, ...]
    quantized_kv_start: int = 0


@dataclass(frozen=True)
class TurboScheme:
    """Full-attention layers bf16-first TurboQuant read with `kernels`, sliding layers plain
    (SCHEME-1)."""

    k_bits: int
    v_bits: int
    quantized_kv_start: int = 0
    kernels: str = "dense"


KvStorageScheme = Bf16Scheme | AffineScheme | AffineLayersScheme | TurboScheme

GRAMMAR = (
    "bf16 | affine:BITS:GROUP | affine-layers:LAYER=BITS/GROUP,... | "
    "turbo:kBITSvBITS[:dense|:deferred], each but bf16 optionally followed by :start=N"
)


def _malformed(text: str, why: str) -> ValueError:
    return ValueError(f"malformed KV scheme {text!r}: {why}; expected {GRAMMAR}")


def _affine_widths(text: str, bits: int, group_size: int) -> None:
    if bits not in affine.SUPPORTED_BITS:
        raise _malformed(text, f"bits must be one of {affine.SUPPORTED_BITS}, got {bits}")
    if group_size not in affine.SUPPORTED_GROUP_SIZES:
        raise _malformed(
            text, f"group size must be one of {affine.SUPPORTED_GROUP_SIZES}, got {group_size}"
        )


def parse_scheme(text: str) -> KvStorageScheme:
    """A scheme from its short form (SCHEME-2), e.g. "bf16", "affine:4:64",
    "affine:4:64:start=256", "affine-layers:0=4/64,5=8/32", "turbo:k8v4:deferred:start=128"."""
    parts = text.strip().split(":")
    start = 0
    if len(parts) > 1 and parts[-1].startswith("start="):
        value = parts.pop()[len("start=") :]
        if not value.isdigit():
            raise _malformed(text, f"start must be a non-negative integer, got {value!r}")
        start = int(value)
    kind, args = parts[0], parts[1:]
    if kind == "bf16" and not args:
        if start:
            raise _malformed(text, "bf16 takes no start")
        return Bf16Scheme()
    if kind == "affine" and len(args) == 2 and all(a.isdigit() for a in args):
        bits, group_size = int(args[0]), int(args[1])
        _affine_widths(text, bits, group_size)
        return AffineScheme(bits, group_size, start)
    if kind == "affine-layers" and len(args) == 1:
        layers = []
        for entry in args[0].split(","):
            match = re.fullmatch(r"(\d+)=(\d+)/(\d+)", entry)
            if match is None:
                raise _malformed(text, f"layer entry {entry!r} is not LAYER=BITS/GROUP")
            layer, bits, group_size = (int(g) for g in match.groups())
            _affine_widths(text, bits, group_size)
            layers.append(AffineLayer(layer, bits, group_size))
        if len({entry.layer for entry in layers}) != len(layers):
            raise _malformed(text, "a layer is listed twice")
        return AffineLayersScheme(tuple(layers), start)
    if kind == "turbo" and len(args) in (1, 2):
        match = re.fullmatch(r"k(\d)v(\d)", args[0])
        if match is None:
            raise _malformed(text, f"{args[0]!r} is not kBITSvBITS")
        k_bits, v_bits = (int(g) for g in match.groups())
        if k_bits not in turboquant.KEY_BITS or v_bits not in turboquant.VALUE_BITS:
            raise _malformed(
                text,
                f"key bits must be one of {turboquant.KEY_BITS} and value bits one of "
                f"{turboquant.VALUE_BITS}, got k{k_bits}v{v_bits}",
            )
        kernels = args[1] if len(args) == 2 else "dense"
        if kernels not in KERNELS:
            raise _malformed(text, f"kernels must be one of {KERNELS}, got {kernels!r}")
        return TurboScheme(k_bits, v_bits, start, kernels)
    raise _malformed(text, "unknown kind or wrong number of fields")


def _affine_entry(scheme: KvStorageScheme, layer: int) -> AffineLayer | None:
    """The affine widths a scheme gives `layer`, or None for a plain layer."""
    if isinstance(scheme, AffineScheme):
        return AffineLayer(layer, scheme.bits, scheme.group_size)
    if isinstance(scheme, AffineLayersScheme):
        return next((entry for entry in scheme.layers if entry.layer == layer), None)
    return None


def full_attention_cache(
    scheme: KvStorageScheme, layer: int, family: ModuleType, checks: str = "eager"
) -> Any:
    """SCHEME-3 over a backend's `caches` package `family` (both backends' composers); turbo
    layers as SCHEME-4 says; encoding caches check as `checks` says (DEFER-3)."""
    check_checks(checks)
    if isinstance(scheme, TurboScheme):
        return family.Bf16FirstTurboQuantKVCache(
            scheme.k_bits, scheme.v_bits, scheme.quantized_kv_start, scheme.kernels, checks
        )
    entry = _affine_entry(scheme, layer)
    if entry is None:
        return family.KVCache()
    assert isinstance(scheme, AffineScheme | AffineLayersScheme)
    return family.Bf16FirstQuantizedKVCache(
        entry.group_size, entry.bits, scheme.quantized_kv_start, checks
    )


_warned_turbo_sliding = False


def sliding_attention_cache(
    scheme: KvStorageScheme, layer: int, max_size: int, family: ModuleType, checks: str = "eager"
) -> Any:
    """SCHEME-3 over a backend's `caches` package `family`: TurboQuant encodes
    full-attention layers only, so its sliding layers stay plain, with a one-time warning;
    encoding caches check as `checks` says (DEFER-3)."""
    global _warned_turbo_sliding
    check_checks(checks)
    if isinstance(scheme, TurboScheme):
        if not _warned_turbo_sliding:
            _warned_turbo_sliding = True
            warnings.warn(
                "turbo KV scheme: sliding-window layers stay bf16 (TurboQuant encodes "
                "full-attention layers only)",
                stacklevel=3,
            )
        return family.RotatingKVCache(max_size)
    entry = _affine_entry(scheme, layer)
    if entry is None:
        return family.RotatingKVCache(max_size)
    assert isinstance(scheme, AffineScheme | AffineLayersScheme)
    return family.Bf16FirstRotatingQuantizedKVCache(
        max_size, entry.group_size, entry.bits, scheme.quantized_kv_start, checks
    )


def composed_full_attention_cache(
    scheme: KvStorageScheme, layer: int, checks: str = "eager"
) -> Any:
    """The reference cache `scheme` names for full-attention layer `layer` (SCHEME-3)."""
    from kvspec.reference import caches

    return full_attention_cache(scheme, layer, caches, checks)


def composed_sliding_attention_cache(
    scheme: KvStorageScheme, layer: int, max_size: int, checks: str = "eager"
) -> Any:
    """The reference cache `scheme` names for sliding-window layer `layer` (SCHEME-3)."""
    from kvspec.reference import caches

    return sliding_attention_cache(scheme, layer, max_size, caches, checks)
