"""Records on MLX (accelerated/records.py): a row's fields side by side in one buffer, as the
MLX TurboQuant and affine caches store them and the CUDA encoders write them. The layout's
rules, the round trip of packing, and the cache's record against the reference cache's
fields laid out by a packer of this file's own (on CUDA, the bytes the encode kernels
wrote)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings
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
# Alignments stop at 16: a 32-byte field is no wider-aligned than a 16-byte one before it.
@example(fields=[("uint8", 16), ("uint8", 32)])
def test_a_record_layout_aligns_each_field_to_its_loads_and_pads_the_row(records, fields) -> None:
    """TQC-1: fields in order of decreasing alignment (the given order among equals), each at
    the first offset past the one before it that is a multiple of its alignment (the largest
    power of two up to 16 dividing its bytes), the row padded to a multiple of 16."""
    import mlx.core as mx

    layout = records.record_layout([(getattr(mx, name), width) for name, width in fields])
    sizes = [width * getattr(mx, name).size for name, width in fields]
    alignments = [min(16, size & -size) for size in sizes]
    placed = sorted(range(len(fields)), key=lambda i: layout.offsets[i])
    assert placed == sorted(range(len(fields)), key=lambda i: -alignments[i])
    end = 0
    for i in placed:
        offset = layout.offsets[i]
        assert offset % alignments[i] == 0 and end <= offset < end + alignments[i]
        end = offset + sizes[i]
    assert layout.row_bytes % 16 == 0 and end <= layout.row_bytes < end + 16
    assert layout.dtypes == tuple(name for name, _ in fields)
    assert layout.widths == tuple(width for _, width in fields)


@settings(deadline=None, max_examples=30)
@given(fields=fields, rows=st.integers(1, 5), seed=st.integers(0, 2**16))
def test_packed_rows_hold_each_field_at_its_offset_and_zeros_after(
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


#: Cache kinds whose MLX storage keeps a record, by name: (reference, MLX) of a module.
RECORD_KINDS = {
    "turboquant k8v4": lambda m: m.TurboQuantKVCache(8, 4, "dense", checks="deferred"),
    "turboquant k4v2": lambda m: m.TurboQuantKVCache(4, 2, "dense", checks="deferred"),
    "turboquant k3v3": lambda m: m.TurboQuantKVCache(3, 3, "dense", checks="deferred"),
    "turboquant k2v5": lambda m: m.TurboQuantKVCache(2, 5, "dense", checks="deferred"),
    "affine 4-bit g64": lambda m: m.QuantizedKVCache(64, 4, checks="deferred"),
    "affine 8-bit g32": lambda m: m.QuantizedKVCache(32, 8, checks="deferred"),
    "affine 3-bit g128": lambda m: m.QuantizedKVCache(128, 3, checks="deferred"),
    "affine 2-bit g64": lambda m: m.QuantizedKVCache(64, 2, checks="deferred"),
    "affine ring 4-bit g64": lambda m: m.RotatingQuantizedKVCache(64, 64, 4, checks="deferred"),
    "affine ring 6-bit g32 keep 4": lambda m: m.RotatingQuantizedKVCache(
        40, 32, 6, keep=4, checks="deferred"
    ),
}


@pytest.mark.parametrize("kind", sorted(RECORD_KINDS))
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_cache_stores_the_reference_fields_in_one_record(
    backend: Backend, records, kind: str, head_dim: int, dtype: str
) -> None:
    """TQC-1, QKV-1 on MLX: the record after a prefill that grows the buffers and decode steps
    is the reference cache's fields laid out at the layout's offsets, all else zero (on CUDA
    the encode kernels write the rows)."""
    from kvspec.reference.dtypes import BFLOAT16

    ref = RECORD_KINDS[kind](reference)
    acc = RECORD_KINDS[kind](backend.module("caches"))
    rng = np.random.default_rng(head_dim + len(kind))
    np_dtype = BFLOAT16 if dtype == "bfloat16" else np.float32
    for L in [3, 1, 260, 1, 1]:
        k = rng.standard_normal((1, 2, L, head_dim)).astype(np_dtype)
        v = rng.standard_normal((1, 2, L, head_dim)).astype(np_dtype)
        for cache, (kk, vv) in (
            (ref, (k, v)),
            (acc, (backend.from_numpy(k), backend.from_numpy(v))),
        ):
            if L > 1:
                cache.append_window(kk, vv)
            else:
                cache.append_decode(kk, vv)
    fields = acc._fields
    assert fields.layout == records.layout_of(tuple(fields))
    want = _pack(list(ref._fields), fields.layout.offsets, fields.layout.row_bytes)
    assert np.array_equal(backend.to_numpy(fields.record), want)


def test_a_turboquant_read_names_each_field_at_its_record_offset(backend: Backend, records) -> None:
    """READ-7 over a record (TQC-1): the kernels are handed the record once and read each
    field the formats store at its offset: k8v4 at head dim 128 is laid out as key codes
    (128 bytes), value codes (64), then key scales, zero points and value scales (8 each)."""
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels as kernels

    cache = backend.module("caches").TurboQuantKVCache(8, 4, "dense", checks="deferred")
    rng = np.random.default_rng(0)
    k = backend.from_numpy(rng.standard_normal((1, 2, 3, 128)).astype(np.float32))
    cache.append_window(k, k)
    stored = cache._stored_rows(cache._fields)
    assert stored.record_format.offsets == (0, 192, 200, 128, 208)
    assert stored.record_format.keys == (kernels.TURBO_KEY, mx.int8, mx.float16, 8, 32, 128)
    assert stored.record_format.values == (kernels.TURBO_VALUE, mx.uint8, mx.float16, 4, 32, 128)
    assert tuple(stored.record.shape) == (1, 2, 256, 224)


def test_an_affine_read_names_each_field_at_its_record_offset(backend: Backend, records) -> None:
    """READ-7 over a record (QKV-1): 4-bit g64 at head dim 128 in bfloat16 is laid out as key
    words (64 bytes), value words (64), then key scales, key biases, value scales and value
    biases (4 each): 144 bytes, no padding."""
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels as kernels

    cache = backend.module("caches").QuantizedKVCache(64, 4, checks="deferred")
    rng = np.random.default_rng(0)
    k = backend.from_numpy(rng.standard_normal((1, 2, 3, 128)).astype(np.float32))
    cache.append_window(k.astype(mx.bfloat16), k.astype(mx.bfloat16))
    stored = cache._stored_rows(cache._fields)
    assert stored.record_format.offsets == (0, 128, 132, 64, 136, 140)
    side = (kernels.AFFINE, mx.uint32, mx.bfloat16, 4, 64, 128)
    assert stored.record_format.keys == side and stored.record_format.values == side
    assert tuple(stored.record.shape) == (1, 2, 256, 144)


def test_reads_of_one_record_layout_keep_their_own_formats(backend: Backend, records) -> None:
    """READ-7: 8-bit groups of 32 at head dim 32 and 4-bit groups of 64 at head dim 64 lay
    out alike (8 words, a scale and a bias per side), yet each read names its own format."""
    import mlx.core as mx

    caches = backend.module("caches")
    read_formats = []
    for group_size, bits, head_dim in ((32, 8, 32), (64, 4, 64)):
        cache = caches.QuantizedKVCache(group_size, bits, checks="deferred")
        k = mx.zeros((1, 1, 2, head_dim), mx.bfloat16)
        cache.append_window(k, k)
        stored = cache._stored_rows(cache._fields)
        read_formats.append(stored.record_format)
    assert read_formats[0].offsets == read_formats[1].offsets
    assert [f.keys[3:] for f in read_formats] == [(8, 32, 32), (4, 64, 64)]


@pytest.mark.parametrize("kind", ["turboquant k8v4", "affine 4-bit g64", "affine ring 4-bit g64"])
def test_a_decode_step_reads_a_records_rows_without_a_fields_view(
    backend: Backend, records, kind: str
) -> None:
    """On the CUDA path (kernels stood in), an eager decode step and the compiled step's
    plan take a record cache's rows from the record itself: a field's view of it is two
    MLX ops of host time a layer and step that nothing reads (a ring asked for its rows
    through field 0 at every step)."""
    from unittest import mock

    import mlx.core as mx

    from kvspec.accelerated.caches import records as record_caches
    from kvspec.conformance.stand_ins import cuda_path

    row = mx.ones((1, 2, 1, 128), mx.bfloat16)
    views = []

    def counted(view: object) -> object:
        def made(*args: object) -> object:
            views.append(view)
            return getattr(records, view)(*args)

        return made

    with cuda_path():
        cache = RECORD_KINDS[kind](backend.module("caches"))
        prefill = mx.ones((1, 2, 70, 128), mx.bfloat16)
        cache.append_window(prefill, prefill)
        for _ in range(3):
            cache.append_decode(row, row)
        with (
            mock.patch.object(record_caches, "field_view", counted("field_view")),
            mock.patch.object(record_caches, "unpacked", counted("unpacked")),
        ):
            cache.append_decode(row, row).attend(mx.ones((1, 4, 1, 128), mx.bfloat16), 1.0)
            cache.prepare_decode_step()
    assert views == []


#: Record caches large enough that a copy of the record stands out of the step's other
#: allocations: the ring's prefill is longer than it holds, so its steps wrap.
WRITTEN_IN_PLACE = {
    "turboquant k8v4": lambda m: m.TurboQuantKVCache(8, 4, "dense", checks="deferred"),
    "affine 4-bit g64": lambda m: m.QuantizedKVCache(64, 4, checks="deferred"),
    "affine ring 4-bit g64": lambda m: m.RotatingQuantizedKVCache(1024, 64, 4, checks="deferred"),
}


@pytest.mark.parametrize("step", ["eager", "compiled"])
@pytest.mark.parametrize("kind", sorted(WRITTEN_IN_PLACE))
def test_a_decode_write_takes_the_record_over_in_place(
    backend: Backend, records, kind: str, step: str
) -> None:
    """A decode step's write of its row, evaluated, updates the record's buffer in place: the
    cache holds nothing of the record before it (a RecordFields of it, say), which would
    make MLX copy the whole record to write one row."""
    import mlx.core as mx

    caches = backend.module("caches")
    cache = WRITTEN_IN_PLACE[kind](caches)
    prefill = mx.ones((1, 2, 2048, 128), mx.bfloat16)
    row = mx.ones((1, 2, 1, 128), mx.bfloat16)
    cache.append_window(prefill, prefill)
    step_fn = backend.module("caches.compiled").compile_decode(
        lambda traces, k, v, q: [t.append_decode(k, v).attend(q, 1.0) for t in traces], [cache]
    )
    query = mx.ones((1, 4, 1, 128), mx.bfloat16)
    for _ in range(2):
        mx.eval(step_fn(row, row, query))
        mx.eval(cache.append_decode(row, row).attend(query, 1.0))
    if step == "eager":
        cache.append_decode(row, row)
    else:
        mx.eval(step_fn(row, row, query))
    written = cache._record
    # Until the step's work is done MLX holds what it reads, which is not the cache's hold.
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(written)
    allocated = mx.get_peak_memory() - held
    assert allocated < written.nbytes // 4, (
        f"the write took {allocated} bytes, the record {written.nbytes}"
    )
