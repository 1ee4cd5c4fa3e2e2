"""Records on MLX (accelerated/records.py): a row's fields side by side in one buffer, as the
MLX TurboQuant cache stores them and the CUDA encoder writes them. The layout's rules, the
round trip of packing, and the cache's record against the reference cache's fields laid
out by a packer of this file's own (on CUDA, the bytes the encode kernel wrote)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.conformance.backend import Backend
from kvspec.reference import caches as reference

DTYPES = ["int8", "uint8", "float16", "bfloat16", "uint32", "float32"]
fields = st.lists(st.tuples(st.sampled_from(DTYPES), st.integers(1, 70)), min_size=1, max_size=6)


@pytest.fixture(scope="module")
def records(backend: Backend):
    if backend.package != "kvspec.accelerated":
        pytest.skip("records are how the MLX backend stores a row's fields")
    return backend.module("records")


def _pack(arrays: list[np.ndarray], offsets: tuple[int, ...], row_bytes: int) -> np.ndarray:
    """Rows [B, H, T, w_i] of each array at its byte offset of a zeroed uint8 row."""
    B, H, T, _ = arrays[0].shape
    out = np.zeros((B, H, T, row_bytes), np.uint8)
    for array, offset in zip(arrays, offsets, strict=True):
        raw = np.ascontiguousarray(array).view(np.uint8)
        out[..., offset : offset + raw.shape[-1]] = raw
    return out


@settings(deadline=None)
@given(fields=fields)
def test_a_record_layout_aligns_each_field_to_its_loads_and_pads_the_row(records, fields) -> None:
    import mlx.core as mx

    layout = records.record_layout([(getattr(mx, name), width) for name, width in fields])
    end = 0
    for (name, width), offset in zip(fields, layout.offsets, strict=True):
        size = width * getattr(mx, name).size
        alignment = min(16, size & -size)  # the largest power of two dividing it, up to 16
        assert offset % alignment == 0 and offset >= end
        assert offset - end < alignment, "a field starts at its first aligned offset"
        end = offset + size
    assert layout.row_bytes % 16 == 0 and end <= layout.row_bytes < end + 16
    assert layout.dtypes == tuple(name for name, _ in fields)


@settings(deadline=None, max_examples=30)
@given(fields=fields, rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_packed_rows_hold_each_field_at_its_offset_and_zeros_between(
    backend: Backend, records, fields, rows, seed
) -> None:
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    arrays = [
        rng.integers(0, 256, (1, 2, rows, width * getattr(mx, name).size), np.uint8)
        for name, width in fields
    ]
    mlx_fields = tuple(
        backend.from_numpy(a).view(getattr(mx, name))
        for a, (name, _) in zip(arrays, fields, strict=True)
    )
    layout = records.layout_of(mlx_fields)
    record = records.packed(mlx_fields, layout)
    assert np.array_equal(backend.to_numpy(record), _pack(arrays, layout.offsets, layout.row_bytes))
    for got, want in zip(records.unpacked(record, layout), arrays, strict=True):
        assert np.array_equal(backend.to_numpy(got.view(mx.uint8)), want)


@pytest.mark.parametrize("bits", [(8, 4), (4, 2), (3, 3), (2, 5)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_turboquant_cache_stores_the_reference_fields_in_one_record(
    backend: Backend, records, bits: tuple[int, int], head_dim: int
) -> None:
    """TQC-1 on MLX: the record after a prefill that grows the buffers and decode steps is
    the reference cache's five fields laid out at the layout's offsets, all else zero (on
    CUDA the encode kernel writes the rows)."""
    k_bits, v_bits = bits
    ref = reference.TurboQuantKVCache(k_bits, v_bits, "dense", checks="deferred")
    acc = backend.module("caches").TurboQuantKVCache(k_bits, v_bits, "dense", checks="deferred")
    rng = np.random.default_rng(head_dim + k_bits)
    for L in [3, 1, 260, 1, 1]:
        k = rng.standard_normal((1, 2, L, head_dim)).astype(np.float32)
        v = rng.standard_normal((1, 2, L, head_dim)).astype(np.float32)
        ref.append_window(k, v) if L > 1 else ref.append_decode(k, v)
        acc.append_window(backend.from_numpy(k), backend.from_numpy(v)) if L > 1 else (
            acc.append_decode(backend.from_numpy(k), backend.from_numpy(v))
        )
    layout = backend.module("turboquant").stored_layout(k_bits, v_bits, head_dim)
    record = acc._fields.record
    assert acc._fields.layout == layout
    want = _pack(list(ref._fields), layout.offsets, layout.row_bytes)
    assert np.array_equal(backend.to_numpy(record), want)


def test_a_turboquant_read_names_each_field_at_its_record_offset(backend: Backend, records) -> None:
    """READ-7 over a record (TQC-1): the kernels are handed the record once and read each
    field the formats store at its offset: k8v4 at head dim 128 is laid out as codes (128
    bytes), key scales and zero points (8 each), value codes (64) and value scales (8)."""
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels as kernels

    cache = backend.module("caches").TurboQuantKVCache(8, 4, "dense", checks="deferred")
    rng = np.random.default_rng(0)
    k = backend.from_numpy(rng.standard_normal((1, 2, 3, 128)).astype(np.float32))
    cache.append_window(k, k)
    stored, codebook, signs = cache._stored_rows(cache._fields, 2)
    assert stored.record_format.offsets == (0, 128, 136, 144, 208)
    assert stored.record_format.keys == (kernels.TURBO_KEY, mx.int8, mx.float16, 8, 32, 128)
    assert stored.record_format.values == (kernels.TURBO_VALUE, mx.uint8, mx.float16, 4, 32, 128)
    assert tuple(stored.record.shape) == (1, 2, 2, 224)
    assert codebook.size == 16 and signs.size == 128
