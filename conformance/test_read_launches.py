"""The launches an MLX storage keeps for its decode reads (accelerated/caches/reads.py,
ReadLaunches): a read finds its kernels' launches by its storage's read configuration, not
anew from the stored rows and queries. Held on the CUDA path with its kernels stood in
against `attention_kernels.decode_attention`, which plans every call from the stored rows
themselves: the same launches with the same options after any sequence of appends, trims
and restores (the buffers' growth, the rings' wraps, another layout of the same shape);
queries that do not fit raise at every call; off CUDA no kernel launches."""

from __future__ import annotations

from collections.abc import Callable
from unittest import mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvspec.conformance.backend import Backend
from kvspec.conformance.test_planned_append import KINDS, mlx_only, operations

SCALE = 128**-0.5


def launched(launches: object, attend: Callable[[], object]) -> list[tuple[str, str]]:
    """The stand-in launches `attend` makes: each kernel's name and options."""
    launches.calls.clear()
    attend()
    return list(launches.calls)


def fresh_launches(launches: object, read: object, queries: object) -> list[tuple[str, str]]:
    """The launches `decode_attention` makes for `read`, planned from its stored rows."""
    from kvspec.accelerated import attention_kernels

    read_dtype = read.launches.read_dtype
    return launched(
        launches,
        lambda: attention_kernels.decode_attention(
            queries, read.stored, SCALE, read_dtype, read.rows, order=read.order
        ),
    )


@pytest.mark.parametrize("kind", sorted(KINDS))
@given(prefill=st.integers(1, 300), ops=operations, decodes=st.integers(0, 24))
def test_a_read_launches_what_its_stored_rows_plan(
    backend: Backend, kind: str, prefill: int, ops: list, decodes: int
) -> None:
    """READ-7 on MLX: every decode read of any sequence of appends, trims and restores,
    decode runs crossing the buffers' 256-row steps and the rings' wraps among them, hands
    MLX the launches `decode_attention` plans from its stored rows."""
    import mlx.core as mx

    from kvspec.conformance.stand_ins import cuda_path

    mlx_only(backend)
    rng = np.random.default_rng(prefill)

    def normal(shape: tuple[int, ...]) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    queries = normal((1, 4, 1, 128))
    with cuda_path() as launches:
        cache = KINDS[kind](backend.module("caches"))
        for op, n in [("window", prefill), *ops, *[("decode", 1)] * decodes]:
            if op == "decode":
                read = cache.append_decode(normal((1, 2, 1, 128)), normal((1, 2, 1, 128)))
                kept = launched(launches, lambda read=read: read.attend(queries, SCALE))
                assert kept, "a decode read of one query runs the kernels on CUDA"
                assert kept == fresh_launches(launches, read, queries), op
            elif op == "window":
                cache.append_window(normal((1, 2, n, 128)), normal((1, 2, n, 128)))
            elif op == "trim":
                if cache.is_trimmable():
                    cache.trim(n)
            else:
                cache.restore_state(cache.state())


def test_a_ring_restored_in_another_dtype_reads_in_that_dtype(backend: Backend) -> None:
    """READ-7 on MLX: a full ring restored from a ring of another dtype holds buffers of the
    same shape; its next read launches the kernels of the new dtype."""
    import mlx.core as mx

    from kvspec.conformance.stand_ins import cuda_path

    mlx_only(backend)
    caches = backend.module("caches")
    with cuda_path() as launches:
        rings = {dtype: caches.RotatingKVCache(16, keep=2) for dtype in (mx.bfloat16, mx.float16)}
        for dtype, ring in rings.items():
            rows = mx.ones((1, 2, 20, 64), dtype)
            ring.append_window(rows, rows)
        ring = rings[mx.bfloat16]
        row = mx.ones((1, 2, 1, 64), mx.bfloat16)
        read = ring.append_decode(row, row)
        bf16_launches = launched(launches, lambda: read.attend(row, SCALE))
        ring.restore_state(rings[mx.float16].state())
        row = mx.ones((1, 2, 1, 64), mx.float16)
        read = ring.append_decode(row, row)
        assert read.stored[0].codes.dtype == mx.float16
        kept = launched(launches, lambda: read.attend(row, SCALE))
        assert kept == fresh_launches(launches, read, row)
        assert kept != bf16_launches


def kv_cache_read(backend: Backend) -> object:
    """A KVCache's decode read over 9 rows of 2 KV heads, head dim 64 (on the CUDA path)."""
    import mlx.core as mx

    cache = backend.module("caches").KVCache()
    rows = mx.ones((1, 2, 8, 64), mx.bfloat16)
    cache.append_window(rows, rows)
    return cache.append_decode(rows[:, :, :1], rows[:, :, :1])


def test_queries_that_do_not_fit_raise_at_every_read(backend: Backend) -> None:
    """READ-1 on the kernels' path: after queries that fit, queries of another head dim,
    batch, dtype or head count raise at every read, and those that fit still read."""
    import mlx.core as mx

    from kvspec.conformance.stand_ins import cuda_path

    mlx_only(backend)
    with cuda_path() as launches:
        read = kv_cache_read(backend)
        fits = mx.ones((1, 4, 1, 64), mx.bfloat16)
        assert launched(launches, lambda: read.attend(fits, SCALE))
        misfits = [
            mx.ones((1, 4, 1, 32), mx.bfloat16),
            mx.ones((2, 4, 1, 64), mx.bfloat16),
            mx.ones((1, 4, 1, 64), mx.float16),
            mx.ones((1, 3, 1, 64), mx.bfloat16),
        ]
        for queries in misfits:
            for _ in range(2):
                with pytest.raises(ValueError):
                    read.attend(queries, SCALE)
        assert launched(launches, lambda: read.attend(fits, SCALE))


def test_a_read_off_cuda_launches_no_kernel(backend: Backend) -> None:
    """READ-7: a read whose launches were made on CUDA attends through its decoded rows
    once MLX's default device is not a CUDA GPU, and through the kernels again after."""
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels
    from kvspec.conformance.stand_ins import cuda_path

    mlx_only(backend)
    with cuda_path() as launches:
        read = kv_cache_read(backend)
        queries = mx.ones((1, 4, 1, 64), mx.bfloat16)
        assert launched(launches, lambda: read.attend(queries, SCALE))
        with mock.patch.object(attention_kernels, "on_cuda", lambda: False):
            assert launched(launches, lambda: mx.eval(read.attend(queries, SCALE))) == []
        assert launched(launches, lambda: read.attend(queries, SCALE))


def test_a_read_launches_kernels_made_after_the_caches_are_cleared(backend: Backend) -> None:
    """READ-7 on MLX: once the kernels' caches are cleared (tools/kernel_ab.py's other
    sources, tools/launch_shapes.py's shapes, another set of stand-ins), a read made before
    launches kernels made after, not the ones its storage kept."""
    import mlx.core as mx

    from kvspec.conformance.stand_ins import cuda_path

    mlx_only(backend)
    with cuda_path() as first:
        read = kv_cache_read(backend)
        queries = mx.ones((1, 4, 1, 64), mx.bfloat16)
        kept = launched(first, lambda: read.attend(queries, SCALE))
        assert kept
        with cuda_path() as second:
            assert launched(second, lambda: read.attend(queries, SCALE)) == kept
            assert launched(first, lambda: read.attend(queries, SCALE)) == []


def _spec_tensor_cores(key: tuple[int, int, int], value: tuple[int, int, int]) -> bool:
    """READ-7's rule, restated: tensor cores for key and value head dims of 64, 128 and 256
    where a lane's share of a row (D/4 key elements, D/8 value elements) lies in one group
    of a coded format. A side is (format, group size, head dim)."""

    def fits(fmt: int, group: int, dim: int, lanes: int) -> bool:
        share = dim // lanes
        return dim in (64, 128, 256) and (fmt == 0 or group % share == 0)

    return fits(*key, 4) and fits(*value, 8)


def _spec_scaled_weights(bits: int, group: int, dim: int, query_heads: int) -> bool:
    """READ-7's rule, restated: affine values of 2, 4 or 8 bits whose share of a lane (D/8
    elements) fills whole words, and G D <= 8 group_size for G query heads a KV head."""
    return bits in (2, 4, 8) and (dim // 8) * bits % 32 == 0 and query_heads * dim <= 8 * group


def test_the_body_a_read_takes_is_the_specs(backend: Backend) -> None:
    """READ-7: which reads the tensor-core body takes, and which values it reads with
    scaled weights, against the spec's statement of each, over formats, group sizes and
    head dims on both sides of every edge (the bodies round differently: the choice is part
    of a read's bits)."""
    mlx_only(backend)
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels as kernels

    def side(fmt: int, bits: int, group: int, dim: int) -> kernels.SideFormat:
        return kernels.SideFormat(fmt, mx.uint32, mx.bfloat16, bits, group, dim)

    formats = (kernels.PLAIN, kernels.AFFINE, kernels.TURBO_KEY)
    dims = (32, 64, 96, 128, 192, 256, 512)
    groups = (16, 32, 64, 128)
    bodies = 0
    for key_fmt in formats:
        for value_fmt in (kernels.PLAIN, kernels.AFFINE):
            for dim in dims:
                for key_group in groups:
                    for value_group in groups:
                        keys = side(key_fmt, 4, key_group, dim)
                        values = side(value_fmt, 4, value_group, dim)
                        expected = _spec_tensor_cores(
                            (key_fmt, key_group, dim), (value_fmt, value_group, dim)
                        )
                        assert kernels.tensor_core_fit(keys, values) is expected, (keys, values)
                        bodies += expected
    assert bodies > 0
    scaled = 0
    for bits in (2, 3, 4, 5, 6, 8):
        for dim in dims:
            for group in groups:
                for query_heads in (1, 2, 4, 8):
                    values = side(kernels.AFFINE, bits, group, dim)
                    expected = _spec_scaled_weights(bits, group, dim, query_heads)
                    got = kernels.scaled_weights(values, query_heads)
                    assert got is expected, (values, query_heads)
                    scaled += expected
                # Plain values are never read with scaled weights.
                assert not kernels.scaled_weights(side(kernels.PLAIN, bits, group, dim), 1)
    # The spec's example: bits 4 and group 64 at D = 128 up to G = 4.
    assert kernels.scaled_weights(side(kernels.AFFINE, 4, 64, 128), 4)
    assert not kernels.scaled_weights(side(kernels.AFFINE, 4, 64, 128), 5)
    assert scaled > 0


def _plain_side(dim: int):
    """A bf16 side of head dim `dim`, as READ-7's kernels take it."""
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels as kernels

    return kernels.SideFormat(kernels.PLAIN, mx.bfloat16, mx.bfloat16, 16, 32, dim)


def test_the_reads_the_kernels_take_are_the_specs(backend: Backend, monkeypatch) -> None:
    """READ-7: the kernels answer reads on a CUDA device with key and value head dims of 32,
    64, 96, 128, 160, 192, 256 and 512 and at most 8 query heads per KV head (a whole
    number of them)."""
    mlx_only(backend)
    from kvspec.accelerated import attention_kernels as kernels

    spec_dims = (32, 64, 96, 128, 160, 192, 256, 512)
    monkeypatch.setattr(kernels, "on_cuda", lambda: True)
    for key_dim in (16, 32, 48, 64, 80, 96, 128, 160, 192, 256, 384, 512, 1024):
        for value_dim in (32, 80, 128, 512):
            for kv_heads, query_heads in ((8, 8), (8, 32), (2, 16), (1, 8), (1, 9), (8, 12)):
                expected = (
                    key_dim in spec_dims
                    and value_dim in spec_dims
                    and query_heads % kv_heads == 0
                    and query_heads // kv_heads <= 8
                )
                got = kernels.supported(
                    _plain_side(key_dim), _plain_side(value_dim), kv_heads, query_heads
                )
                assert got is expected, (key_dim, value_dim, kv_heads, query_heads)


@pytest.mark.device_detection
def test_the_kernels_read_on_a_cuda_device_alone(backend: Backend, monkeypatch) -> None:
    """READ-7: no kernel answers a read on a GPU that is not CUDA's (Metal), nor on the CPU
    of a machine with CUDA."""
    mlx_only(backend)
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels as kernels

    for device, cuda in ((mx.gpu, False), (mx.cpu, True)):
        monkeypatch.setattr(kernels, "cuda_available", lambda cuda=cuda: cuda)
        monkeypatch.setattr(kernels.mx, "default_device", lambda device=device: device)
        assert not kernels.on_cuda()
        assert not kernels.supported(_plain_side(128), _plain_side(128), 8, 32)
    monkeypatch.setattr(kernels, "cuda_available", lambda: True)
    monkeypatch.setattr(kernels.mx, "default_device", lambda: mx.gpu)
    assert kernels.on_cuda()


def test_a_read_is_split_as_the_spec_says() -> None:
    """READ-7: S = min(S_max, max(1, ceil(T / 64))) splits for T live rows, S_max =
    min(128, ceil(528 / Hk)) for Hk KV heads (the splits set the order of a read's sums,
    so a read's bits)."""
    import math

    from kvspec.accelerated import attention_kernels as kernels

    for kv_heads in (1, 2, 3, 4, 5, 8, 16, 32, 64, 600):
        most = min(128, math.ceil(528 / kv_heads))
        for rows in (0, 1, 63, 64, 65, 128, 4095, 4096, 8191, 8192, 8193, 131072):
            assert kernels._splits(rows, kv_heads) == min(most, max(1, math.ceil(rows / 64)))
