"""Encodes of no positions on the CUDA path (kernels stood in): every public encode returns
empty fields and keeps the prior rank without a launch, and a launch asked for no rows is
refused with a clear error, not a division by zero (TQ-10, DEFER-3)."""

from __future__ import annotations

import pytest

from kvspec.conformance.backend import Backend
from kvspec.conformance.test_planned_append import mlx_only

EMPTY = (1, 2, 0, 128)


@pytest.fixture
def launches(backend: Backend):
    """The MLX backend's CUDA path with stand-in kernels; yields their Launches."""
    mlx_only(backend)
    from kvspec.conformance.stand_ins import cuda_path

    with cuda_path() as stood_in:
        yield stood_in


def empty_keys() -> object:
    import mlx.core as mx

    return mx.zeros(EMPTY, mx.bfloat16)


def test_empty_turboquant_encodes_launch_nothing(backend: Backend, launches) -> None:
    import mlx.core as mx

    turboquant = backend.module("turboquant")
    k = empty_keys()
    prior = mx.array([3], mx.uint32)
    record, failure = turboquant.encode_record_deferred(k, k, 8, 4, prior)
    layout = turboquant.stored_layout(8, 4, 128)
    assert record.shape == (1, 2, 0, layout.row_bytes) and record.dtype == mx.uint8
    assert failure is prior
    _, fresh = turboquant.encode_record_deferred(k, k, 8, 4)
    assert fresh.tolist() == [0] and fresh.dtype == mx.uint32
    tensor, kept = turboquant.encode_deferred(k, k, 8, 4, prior)
    assert kept.tolist() == [3] and tensor.k_idx.shape[2] == 0
    assert turboquant.encode(k, k, 8, 4).v_scales.shape[2] == 0
    assert not launches, "an empty encode launches nothing"


def test_empty_affine_encodes_launch_nothing(backend: Backend, launches) -> None:
    import mlx.core as mx

    affine = backend.module("affine")
    k = empty_keys()
    prior = mx.array([2], mx.uint32)
    assert affine.quantize(k, 64, 4)[0].shape == (1, 2, 0, 16)
    assert affine.quantize_deferred(k, 64, 4, prior)[-1] is prior
    *fields, failure = affine.quantize_deferred_pair(k, k, 64, 4, prior)
    assert failure.tolist() == [2] and [f.shape[2] for f in fields] == [0] * 6
    assert not affine.record_encoder_takes(k, k)
    assert not launches, "an empty encode launches nothing"


@pytest.mark.parametrize("codec", ["affine", "turboquant"])
def test_a_launch_of_no_rows_is_refused(backend: Backend, launches, codec: str) -> None:
    module = backend.module(codec)
    k = empty_keys()
    with pytest.raises(ValueError, match="no rows"):
        if codec == "affine":
            module.record_encoder(k, 64, 4)
        else:
            module.record_encoder(k, k, 8, 4)
    assert not launches


@pytest.mark.parametrize("kind", ["turboquant", "affine"])
def test_an_append_of_no_rows_to_a_deferred_cache_launches_nothing(
    backend: Backend, launches, kind: str
) -> None:
    """TQ-10, DEFER-3 at a cache: an append to a batch of no rows (B = 0, positions still
    counted) is taken on the CUDA path with no launch. (An append of no positions is
    refused before any encode: CACHE-2.)"""
    import mlx.core as mx

    caches = backend.module("caches")
    if kind == "turboquant":
        cache = caches.TurboQuantKVCache(8, 4, checks="deferred")
    else:
        cache = caches.QuantizedKVCache(64, 4, checks="deferred")
    no_rows = mx.zeros((0, 2, 1, 128), mx.bfloat16)
    for offset in (1, 2):
        cache.update_and_fetch(no_rows, no_rows)
        assert cache.offset == offset
    assert not launches, "an append of no rows launches nothing"
