"""The decode step: deferred encodes store the reference's bits (DEFER-1, DEFER-2), deferred
caches report bad appends through `check()` and NaN reads (DEFER-3), and a decode read of
stored fields stays within READ-1's bound and, over one row, returns that row's values
exactly (READ-7).

On a CUDA device these run the fused kernels (TurboQuant encode, affine encoder, decode
attention); elsewhere the portable MLX-ops paths, which store the same bits. The shapes
are fixed so the kernels compile a bounded number of template instances.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from kvspec.conformance.backend import Backend
from kvspec.conformance.bounds import (
    attention_bound,
    kernel_attention_bound,
    read_error,
    unrotated_bound,
)
from kvspec.conformance.cache_machine import assert_same_state
from kvspec.conformance.compare import assert_same_bits, rank_of
from kvspec.reference import affine, bits, caches, turboquant
from kvspec.reference.caches.turboquant import DeferredRead
from kvspec.reference.deferred import failure_message
from kvspec.reference.dtypes import FLOAT_DTYPES

TURBO_FIELDS = ("k_idx", "k_scales", "k_zeros", "v_packed", "v_scales")


def _normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 1)).astype(FLOAT_DTYPES[dtype])


def _normal_draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, role: str):
    """Keys, values and queries alike: `_normal`."""
    return _normal(rng, shape, dtype)


def _poisoned_kv(seed: int, shape: tuple[int, int, int, int], dtype: str):
    """k, v with one of each failure of TQ-3 in a row of its own (each group fails alone)."""
    rng = np.random.default_rng(seed)
    k = _normal(rng, shape, dtype)
    v = _normal(rng, shape, dtype)
    L = shape[2]
    if L >= 4 and dtype != "bfloat16":
        k[0, 0, 0, 5] = np.nan  # keys hold NaN
        v[0, -1, 1, 7] = np.inf  # values hold inf
        big = 60000.0 if dtype == "float16" else 1e6
        k[0, -1, 2, 32:64] = big  # a constant group beyond float16 (f32 input only)
        k[0, 0, 3, :32] = np.linspace(big - 1, big, 32)  # a zero point beyond float16
        if dtype == "float32":
            v[0, 0, 4] *= 1e5  # finite values whose group rms is beyond float16
    elif L >= 2:
        k[0, 0, 0, 5] = np.nan
        v[0, -1, 1, 7] = np.inf
    return k, v


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
@pytest.mark.parametrize("bits", [(8, 4), (4, 2), (3, 3), (5, 8), (2, 5)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_turboquant_deferred_encode_stores_the_reference_bits(
    backend: Backend, head_dim: int, bits: tuple[int, int], dtype: str
) -> None:
    k_bits, v_bits = bits
    # On CUDA: one block of a prefill block's buffers; one of a decode step's wider ones (at
    # head dim 128 its edge, 4096 coordinates), or several where they would be wider still;
    # then several, the last one part full (69 rows).
    for seed, shape in enumerate([(2, 1, 1, head_dim), (1, 4, 8, head_dim), (1, 3, 23, head_dim)]):
        k, v = _poisoned_kv(seed, shape, dtype)
        expected, expected_failure = turboquant.encode_deferred(k, v, k_bits, v_bits)
        tq = backend.module("turboquant")
        got, failure = tq.encode_deferred(
            backend.from_numpy(k), backend.from_numpy(v), k_bits, v_bits
        )
        for name in TURBO_FIELDS:
            assert_same_bits(
                backend.to_numpy(getattr(got, name)), getattr(expected, name), f"DEFER-1 {name}"
            )
        assert rank_of(backend.to_numpy(failure)) == expected_failure


@pytest.mark.parametrize("head_dim", [64, 128, 256, 512])
def test_turboquant_eager_encode_on_fused_path_stores_the_reference_bits(
    backend: Backend, head_dim: int
) -> None:
    rng = np.random.default_rng(head_dim)
    k = _normal(rng, (1, 4, 33, head_dim), "bfloat16")
    v = _normal(rng, (1, 4, 33, head_dim), "bfloat16")
    expected = turboquant.encode(k, v, 8, 4)
    got = backend.module("turboquant").encode(backend.from_numpy(k), backend.from_numpy(v), 8, 4)
    for name in TURBO_FIELDS:
        assert_same_bits(backend.to_numpy(getattr(got, name)), getattr(expected, name), name)


def test_turboquant_eager_encode_raises_the_first_check(backend: Backend) -> None:
    k, v = _poisoned_kv(3, (1, 2, 5, 128), "float32")
    k[0, 0, 0, 5] = 0.0  # keys now fail only by their float16 fields
    tq = backend.module("turboquant")
    with pytest.raises(ValueError, match="values hold NaN or inf"):
        tq.encode(backend.from_numpy(k), backend.from_numpy(v), 8, 4)
    v[0, -1, 1, 7] = 0.0
    with pytest.raises(ValueError, match="key scale is beyond the float16 range"):
        tq.encode(backend.from_numpy(k), backend.from_numpy(v), 8, 4)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_affine_deferred_quantize_stores_the_reference_bits(
    backend: Backend, bits: int, group_size: int, dtype: str
) -> None:
    rng = np.random.default_rng(bits * group_size)
    w = _normal(rng, (3, 2, 256), dtype)
    w[0, 0, 3] = np.nan
    w[1, 1, 200] = -np.inf
    if dtype == "float32":
        w[2, 0, :2] = [3e38, -3e38]  # a range that overflows float32 (AFF-7)
    expected = affine.quantize_deferred(w, group_size, bits)
    got = backend.module("affine").quantize_deferred(backend.from_numpy(w), group_size, bits)
    for slot, (a, e) in enumerate(zip(got[:3], expected[:3], strict=True)):
        assert_same_bits(backend.to_numpy(a), e, f"DEFER-1 slot {slot}")
    assert rank_of(backend.to_numpy(got[3])) == expected[3] == 2
    assert failure_message(affine.DEFERRED_CHECKS, expected[3]).startswith("input holds NaN")


@pytest.mark.parametrize("failing_side", ["keys", "values"])
@pytest.mark.parametrize("shape", [(2, 3, 5, 128), (1, 8, 300, 128)])
@pytest.mark.parametrize(("bits", "group_size"), [(3, 128), (4, 64), (8, 32), (2, 64)])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_affine_deferred_pair_stores_what_two_quantizes_store(
    backend: Backend,
    shape: tuple[int, ...],
    bits: int,
    group_size: int,
    dtype: str,
    failing_side: str,
) -> None:
    """The MLX backend's keys-and-values encode (one launch on CUDA; a decode step's and, in
    more blocks, a prefill's): each side the reference's bits, the failure the largest of
    both sides' and the prior's (DEFER-2, DEFER-3), whichever side fails."""
    pair = getattr(backend.module("affine"), "quantize_deferred_pair", None)
    if pair is None:
        pytest.skip("this backend encodes keys and values apart")
    rng = np.random.default_rng(bits)
    k, v = _normal(rng, shape, dtype), _normal(rng, shape, dtype)
    failing, other = (k, v) if failing_side == "keys" else (v, k)
    failing[-1, -1, -1, 7] = np.inf  # one side holds a NaN-ranked group (rank 2)
    if dtype == "float32":
        other[0, 0, 0, :2] = [3e38, -3e38]  # the other an overflowing range (AFF-7, rank 1)
    expected_k = affine.quantize_deferred(k, group_size, bits)
    expected_v = affine.quantize_deferred(v, group_size, bits)
    for prior in (0, 1):
        keys, values, ranked = (backend.from_numpy(a) for a in (k, v, np.array([prior], np.uint32)))
        got = [backend.to_numpy(a) for a in pair(keys, values, group_size, bits, ranked)]
        for slot, (a, e) in enumerate(
            zip(got[:6], (*expected_k[:3], *expected_v[:3]), strict=True)
        ):
            assert_same_bits(a, e, f"slot {slot}")
        assert rank_of(got[6]) == max(expected_k[3], expected_v[3], prior) == 2


# READ-7: decode reads of every storage kind, against the reference's read of the same rows.
READ_KINDS = {
    "kv": lambda c: c.KVCache(),
    "ring": lambda c: c.RotatingKVCache(40, keep=3),
    "affine-4-64": lambda c: c.QuantizedKVCache(64, 4, checks="deferred"),
    "affine-8-32": lambda c: c.QuantizedKVCache(32, 8, checks="deferred"),
    "affine-3-128": lambda c: c.QuantizedKVCache(128, 3, checks="deferred"),
    "affine-2-32": lambda c: c.QuantizedKVCache(32, 2, checks="deferred"),
    "affine-8-64-float16": lambda c: c.QuantizedKVCache(64, 8, checks="deferred"),
    "affine-ring-6-64": lambda c: c.RotatingQuantizedKVCache(40, 64, 6, checks="deferred"),
    "turbo-k8v4-dense": lambda c: c.TurboQuantKVCache(8, 4, "dense", checks="deferred"),
    "turbo-k4v2-deferred": lambda c: c.TurboQuantKVCache(4, 2, "deferred", checks="deferred"),
    "turbo-k3v5-dense": lambda c: c.TurboQuantKVCache(3, 5, "dense", checks="deferred"),
    "bf16-first-turbo": lambda c: c.Bf16FirstTurboQuantKVCache(8, 3, 20, checks="deferred"),
    "bf16-first-kv4-head256": lambda c: c.Bf16FirstKv4Head256Cache(10, checks="deferred"),
}


def _reference_read(ref: caches.Cache, k: np.ndarray, v: np.ndarray):
    """The reference decode read; TurboQuant reads as the deferred kernels (READ-7 attends in
    the rotated domain whichever kernels the cache names)."""
    storage = ref.storage if isinstance(ref, caches.Bf16FirstCache) else ref
    if isinstance(storage, caches.TurboQuantKVCache):
        storage.kernels = "deferred"
    return ref.append_decode(k, v)


def _cuda_core_attend(read, queries, scale: float):
    """The MLX backend's decode attention on its CUDA-core body (READ-7), for a read its
    tensor-core body would otherwise take."""
    assert _on_tensor_cores(read)
    return read.attend(queries, scale, tensor_cores=False)


def _on_tensor_cores(read) -> bool:
    """Whether the MLX backend's kernels take a read on their tensor-core body by default."""
    from kvspec.accelerated import attention_kernels

    _, _, _, keys, values, _ = attention_kernels.stored_formats(read.stored)
    return attention_kernels.tensor_core_fit(keys, values)


def _with_scaled_weights(read, query_heads: int) -> bool:
    """Whether the MLX backend's kernels read a read's values by default with their scales in
    the weights (READ-7's scaled weights: the tensor-core body over affine values)."""
    from kvspec.accelerated import attention_kernels

    _, kv_heads, _, _, values, _ = attention_kernels.stored_formats(read.stored)
    return _on_tensor_cores(read) and attention_kernels.scaled_weights(
        values, query_heads // kv_heads
    )


def _kernels_on_cuda(backend: Backend) -> bool:
    if backend.package != "kvspec.accelerated":
        return False
    from kvspec.accelerated.device import fused_kernels_enabled

    return fused_kernels_enabled()


def _read_by_kernels(backend: Backend, read, query_heads: int) -> bool:
    """Whether the MLX backend's decode-attention kernels answer `read` (READ-7)."""
    if not _kernels_on_cuda(backend):
        return False
    from kvspec.accelerated import attention_kernels

    _, kv_heads, _, keys, values, _ = attention_kernels.stored_formats(read.stored)
    return attention_kernels.supported(keys, values, kv_heads, query_heads)


def _key_groups(ref: caches.Cache) -> tuple[np.ndarray, np.ndarray] | tuple[()]:
    """The stored float16 key scales and zeros of a reference TurboQuant cache of 8-bit keys,
    for the kernel bound's group-score term (READ-7); nothing for other storage."""
    storage = ref.storage if isinstance(ref, caches.Bf16FirstCache) else ref
    if not isinstance(storage, caches.TurboQuantKVCache) or storage.k_bits != 8:
        return ()
    _, key_scales, key_zeros, *_ = storage.state().arrays
    return key_scales, key_zeros


def _value_groups(ref: caches.Cache) -> tuple[np.ndarray, np.ndarray, int]:
    """The stored value scales and biases of a reference affine cache and its bits, for the
    kernel bound of scaled weights (READ-7)."""
    storage = ref.storage if isinstance(ref, caches.Bf16FirstCache) else ref
    assert isinstance(storage, caches.QuantizedKVCache | caches.RotatingQuantizedKVCache)
    *_, value_scales, value_biases = storage.state().arrays
    return value_scales, value_biases, storage.bits


def _assert_reads_within_bound(
    backend: Backend,
    factory,
    head_dim: int,
    dtype: str,
    groups: int,
    lengths: list[int],
    body: str,
    draw=_normal_draw,
) -> None:
    """Appends `lengths` (a window for L > 1, a decode step for L = 1) to a reference cache
    and one of the backend's, and holds each decode read to READ-1's bound of the reference's
    (READ-7), and each read the CUDA kernels answer to READ-7's tighter kernel bound. body:
    "default", "cuda-cores", or "each": the default and, where the kernels would take the
    read on tensor cores, their CUDA-core body too. `draw(rng, shape, dtype, role)` makes
    the "keys", "values" and "queries"."""
    rng = np.random.default_rng(groups)
    ref, acc = factory(caches), factory(backend.module("caches"))
    for L in lengths:
        k = draw(rng, (1, 2, L, head_dim), dtype, "keys")
        v = draw(rng, (1, 2, L, head_dim), dtype, "values")
        queries = draw(rng, (1, 2 * groups, 1, head_dim), dtype, "queries")
        if L > 1:
            ref.append_window(k, v)
            acc.append_window(backend.from_numpy(k), backend.from_numpy(v))
            continue
        want = _reference_read(ref, k, v)
        got = acc.append_decode(backend.from_numpy(k), backend.from_numpy(v))
        scale = head_dim**-0.5
        expected = want.attend(queries, scale).astype(np.float64)
        by_kernels = _read_by_kernels(backend, got, queries.shape[1])
        # Each attend, and whether the kernels read its values with scaled weights.
        attends = []
        if body != "cuda-cores":
            attends.append((got.attend, by_kernels and _with_scaled_weights(got, 2 * groups)))
        if body == "cuda-cores" or (
            body == "each" and _kernels_on_cuda(backend) and _on_tensor_cores(got)
        ):
            attends.append((partial(_cuda_core_attend, got), False))
        values = want.rotated_values if isinstance(want, DeferredRead) else want.values
        read_one = attention_bound(queries, want.keys, values, scale, backend.attention_roundoff)
        for attend, scaled in attends:
            bounds = [read_one]
            if by_kernels:
                value_groups = _value_groups(ref) if scaled else None
                bounds.append(
                    kernel_attention_bound(
                        queries,
                        want.keys,
                        values,
                        scale,
                        *_key_groups(ref),
                        value_groups=value_groups,
                    )
                )
            if isinstance(want, DeferredRead):
                bounds = [unrotated_bound(b, queries, want.keys, values) for b in bounds]
            bound = np.minimum.reduce(bounds)
            actual = backend.to_numpy(attend(backend.from_numpy(queries), scale))
            assert actual.shape == expected.shape
            error = read_error(actual, expected, want)
            assert np.all(error <= bound), f"error {error.max()} > bound {bound.min()}"
    assert_same_state(ref, acc, backend)
    acc.check()


@pytest.mark.parametrize("kind", sorted(READ_KINDS))
@pytest.mark.parametrize("groups", [1, 4, 8])
@pytest.mark.parametrize("body", ["default", "cuda-cores"])
def test_decode_read_of_stored_fields_is_within_bound(
    backend: Backend, kind: str, groups: int, body: str
) -> None:
    """READ-7 against the reference's read; on CUDA, "cuda-cores" also holds the kernels'
    CUDA-core body to the bound where their tensor-core body is the default."""
    if body == "cuda-cores" and not _kernels_on_cuda(backend):
        pytest.skip("the CUDA-core body of the decode-attention kernels runs on CUDA only")
    head_dim = 256 if kind.endswith("head256") else 128
    dtype = "float16" if kind == "kv" or kind.endswith("float16") else "bfloat16"
    # A prefill that crosses a growth step (CACHE-3) or wraps the ring, then decodes.
    lengths = [300, 1, 1] if not kind.startswith(("ring", "affine-ring")) else [37, 1, 9, 1]
    _assert_reads_within_bound(backend, READ_KINDS[kind], head_dim, dtype, groups, lengths, body)


#: Kinds whose equal rows are read from buffers of other capacities (trimmed: the growable
#: kinds) and in batches.
SAME_ROWS_KINDS = ("kv", "affine-4-64", "affine-8-32", "turbo-k8v4-dense", "bf16-first-turbo")


def _rows(rng: np.random.Generator, backend: Backend, batch: int, heads: int, length: int):
    values = rng.standard_normal((batch, heads, length, 128)).astype(FLOAT_DTYPES["bfloat16"])
    return backend.from_numpy(values)


@pytest.mark.parametrize("kind", SAME_ROWS_KINDS)
def test_equal_rows_read_alike_whatever_buffer_holds_them(backend: Backend, kind: str) -> None:
    """READ-7: a read's splits follow its live rows alone. The same 51 rows read bit for bit
    alike from a cache that appended them, one that held 300 and was trimmed to 50 before
    the decode (a buffer twice as long), and one restored from the first's state (CACHE-8:
    a buffer sized to its rows, as a loaded file gives)."""
    rng = np.random.default_rng(51)
    caches = backend.module("caches")
    window_k, window_v = _rows(rng, backend, 1, 2, 300), _rows(rng, backend, 1, 2, 300)
    appended, trimmed, restored = (READ_KINDS[kind](caches) for _ in range(3))
    appended.append_window(window_k[:, :, :50], window_v[:, :, :50])
    trimmed.append_window(window_k, window_v)
    assert trimmed.trim(250) == 250
    restored.restore_state(appended.state())
    new_k, new_v = _rows(rng, backend, 1, 2, 1), _rows(rng, backend, 1, 2, 1)
    queries = _rows(rng, backend, 1, 8, 1)
    outputs = [
        backend.to_numpy(cache.append_decode(new_k, new_v).attend(queries, 128**-0.5))
        for cache in (appended, trimmed, restored)
    ]
    assert_same_bits(outputs[1], outputs[0], "trimmed from 300 rows")
    assert_same_bits(outputs[2], outputs[0], "restored from the state")


@pytest.mark.parametrize("kind", SAME_ROWS_KINDS)
def test_rows_of_a_batch_read_as_each_alone(backend: Backend, kind: str) -> None:
    """READ-7: a read's splits do not follow the batch. Two rows of 2200 positions over
    8 KV heads (on CUDA: more splits than two rows' one wave of blocks would give) read bit
    for bit as each row's own cache reads it."""
    rng = np.random.default_rng(2200)
    caches = backend.module("caches")
    k, v = _rows(rng, backend, 2, 8, 2200), _rows(rng, backend, 2, 8, 2200)
    new_k, new_v = _rows(rng, backend, 2, 8, 1), _rows(rng, backend, 2, 8, 1)
    queries = _rows(rng, backend, 2, 32, 1)
    batch = READ_KINDS[kind](caches)
    batch.append_window(k, v)
    together = backend.to_numpy(batch.append_decode(new_k, new_v).attend(queries, 128**-0.5))
    for row in range(2):
        alone = READ_KINDS[kind](caches)
        alone.append_window(k[row : row + 1], v[row : row + 1])
        read = alone.append_decode(new_k[row : row + 1], new_v[row : row + 1])
        output = backend.to_numpy(read.attend(queries[row : row + 1], 128**-0.5))
        assert_same_bits(together[row : row + 1], output, f"row {row}")


#: Rings of 150 positions, keeping 3 or none, whose reads READ-7's kernels take oldest first.
RING_KINDS = {
    "ring-keep-3": lambda c: c.RotatingKVCache(150, keep=3),
    "ring-keep-0": lambda c: c.RotatingKVCache(150),
    "affine-ring-6-64-keep-0": lambda c: c.RotatingQuantizedKVCache(150, 64, 6, checks="deferred"),
}


@pytest.mark.parametrize("kind", RING_KINDS)
def test_a_ring_reads_its_rows_oldest_first(backend: Backend, kind: str) -> None:
    """READ-7: a ring's read follows its positions, not the turn of its buffer. A ring of
    150 takes 137 positions and then decodes 63 more, one by one, wrapping; at six of
    those steps (the oldest row at buffer row 0, and turns that cut the splits' chunks
    apart in several places), on each of the kernels' bodies, its read equals bit for bit
    the read of a ring holding the same positions in temporal order (the kept ones and the
    last window appended at once, then the newest decoded)."""
    if not _kernels_on_cuda(backend):
        pytest.skip("the decode-attention kernels read a ring oldest first")
    rng = np.random.default_rng(150)
    caches = backend.module("caches")
    k, v = _rows(rng, backend, 1, 2, 200), _rows(rng, backend, 1, 2, 200)
    turning = RING_KINDS[kind](caches)
    size, keep = turning.max_size, turning.keep
    turning.append_window(k[:, :, :137], v[:, :, :137])
    for offset in range(137, 200):
        queries = _rows(rng, backend, 1, 8, 1)
        new = (k[:, :, offset : offset + 1], v[:, :, offset : offset + 1])
        read = turning.append_decode(*new)
        if offset not in (149, 150, 157, 171, 194, 199):
            continue
        # The positions the ring holds before the newest: the kept ones, then the last.
        held = [*range(keep), *range(offset - (size - 1 - keep), offset)]
        temporal = RING_KINDS[kind](caches)
        temporal.append_window(k[:, :, held], v[:, :, held])
        assert temporal.ring_index == temporal.offset == size - 1
        in_order = temporal.append_decode(*new)
        for tensor_cores in (None, False):
            assert_same_bits(
                backend.to_numpy(read.attend(queries, 128**-0.5, tensor_cores)),
                backend.to_numpy(in_order.attend(queries, 128**-0.5, tensor_cores)),
                f"offset {offset} tensor cores {tensor_cores}",
            )


def test_a_ring_filling_its_kept_rows_reads_as_growable_storage(backend: Backend) -> None:
    """READ-7: before a ring wraps, its rows lie in temporal order (turn 0), the kept ones
    too. A ring keeping 3 decodes its first 6 positions one by one from empty, and each
    read, the one at offset = keep among them (every live row a kept one), equals bit for
    bit the read of growable storage holding the same positions, on each of the kernels'
    bodies."""
    rng = np.random.default_rng(3)
    caches = backend.module("caches")
    k, v = _rows(rng, backend, 1, 2, 6), _rows(rng, backend, 1, 2, 6)
    ring, growable = caches.RotatingKVCache(150, keep=3), caches.KVCache()
    for offset in range(6):
        queries = _rows(rng, backend, 1, 8, 1)
        new = (k[:, :, offset : offset + 1], v[:, :, offset : offset + 1])
        ring_read, growable_read = ring.append_decode(*new), growable.append_decode(*new)
        for tensor_cores in (None, False):
            assert_same_bits(
                backend.to_numpy(ring_read.attend(queries, 128**-0.5, tensor_cores)),
                backend.to_numpy(growable_read.attend(queries, 128**-0.5, tensor_cores)),
                f"offset {offset + 1} tensor cores {tensor_cores}",
            )


#: Growable kinds and rings without kept positions, whose padded batches READ-7's kernels
#: read row by row (ROWS-6).
PADDED_ROWS_KINDS = {
    **{
        kind: READ_KINDS[kind]
        for kind in ("kv", "affine-4-64", "turbo-k8v4-dense", "turbo-k4v2-deferred")
    },
    "ring-40": lambda c: c.RotatingKVCache(40),
    "affine-ring-6-64": READ_KINDS["affine-ring-6-64"],
}


@pytest.mark.parametrize("kind", PADDED_ROWS_KINDS)
def test_rows_of_a_padded_batch_read_as_each_alone(backend: Backend, kind: str) -> None:
    """ROWS-6 on READ-7's kernels: a left-padded batch of three rows (no padding, 5, 37 of
    60 positions; then three decodes, on each of the kernels' bodies) reads each row bit
    for bit as that row's own cache, which holds its positions alone, reads them: a ring of
    40 holds the batch's last 40 positions in another turn than each row's own ring, or
    (the row of 23) a ring that has not wrapped. (Elsewhere a padded read goes through its
    mask in MLX ops, whose sums need not fall alike over other lengths.)"""
    if not _kernels_on_cuda(backend):
        pytest.skip("the decode-attention kernels read padded rows from their start")
    rng = np.random.default_rng(37)
    caches = backend.module("caches")
    padding = [0, 5, 37]
    k, v = _rows(rng, backend, 3, 2, 60), _rows(rng, backend, 3, 2, 60)
    batch = PADDED_ROWS_KINDS[kind](caches)
    batch.prepare(left_padding=padding)
    batch.append_window(k, v)
    alone = [PADDED_ROWS_KINDS[kind](caches) for _ in padding]
    for row, cache in enumerate(alone):
        cache.append_window(
            k[row : row + 1, :, padding[row] :], v[row : row + 1, :, padding[row] :]
        )
    # The steps on the default body and on CUDA cores (READ-7's two bodies).
    for step, tensor_cores in enumerate([None, False, None]):
        new_k, new_v = _rows(rng, backend, 3, 2, 1), _rows(rng, backend, 3, 2, 1)
        queries = _rows(rng, backend, 3, 8, 1)
        read = batch.append_decode(new_k, new_v)
        together = backend.to_numpy(read.attend(queries, 128**-0.5, tensor_cores))
        for row, cache in enumerate(alone):
            one = cache.append_decode(new_k[row : row + 1], new_v[row : row + 1])
            output = one.attend(queries[row : row + 1], 128**-0.5, tensor_cores)
            assert_same_bits(
                together[row : row + 1], backend.to_numpy(output), f"step {step} row {row}"
            )


#: Every head dim the decode-attention kernels take (on CUDA: their HEAD_DIMS), each a
#: template instance of its own: a lane's share of a row runs from one element (32, on CUDA
#: cores) to sixteen (512).
KERNEL_HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256, 512)

#: Formats read at every head dim: plain rows of each input dtype, affine codes of group
#: 32 (which divides each head dim) in whole pairs of a word (4, 8 bits) and straddling
#: words (3, 6 bits), TurboQuant where TQ-1 has a sign table.
HEAD_DIM_KINDS = {
    "kv bfloat16": (lambda c: c.KVCache(), "bfloat16"),
    "kv float16": (lambda c: c.KVCache(), "float16"),
    "kv float32": (lambda c: c.KVCache(), "float32"),
    "affine-4-32": (lambda c: c.QuantizedKVCache(32, 4, checks="deferred"), "bfloat16"),
    "affine-8-32": (lambda c: c.QuantizedKVCache(32, 8, checks="deferred"), "float16"),
    "affine-3-32": (lambda c: c.QuantizedKVCache(32, 3, checks="deferred"), "bfloat16"),
    "affine-6-32": (lambda c: c.QuantizedKVCache(32, 6, checks="deferred"), "float32"),
    "turbo-k8v4-dense": (lambda c: c.TurboQuantKVCache(8, 4, checks="deferred"), "bfloat16"),
}


def test_kernel_head_dims_are_the_kernels_own(backend: Backend) -> None:
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's kernels")
    from kvspec.accelerated import attention_kernels

    assert attention_kernels.HEAD_DIMS == KERNEL_HEAD_DIMS


@pytest.mark.parametrize("kind", sorted(HEAD_DIM_KINDS))
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_decode_read_at_every_head_dim_is_within_bound(
    backend: Backend, kind: str, head_dim: int
) -> None:
    """READ-7 at each head dim the kernels take, on each body that takes the read (on CUDA a
    head dim whose template instance fails to build fails here)."""
    factory, dtype = HEAD_DIM_KINDS[kind]
    if kind.startswith("turbo") and head_dim not in turboquant.HEAD_DIMS:
        pytest.skip(f"TQ-1 has no sign table for head_dim {head_dim}")
    _assert_reads_within_bound(backend, factory, head_dim, dtype, 4, [40, 1, 1], "each")


def far_zero_draw(magnitude: float):
    """Keys whose 32-element groups lie close about means of either sign, about `magnitude`
    (TurboQuant zero points up to about 40000 from float32 keys and 64000 from bfloat16,
    near float16's limit: TQ-4), some groups crossing zero; queries of about 0.1 /
    magnitude (past float16's range where the keys are small) with a tenth of their
    elements 1e-10 to 1 times as large; normal values. The scores stay within about 2,
    where READ-7's kernel bound, whose score term grows with them, still tells a group's
    scale or zero misapplied (READ-1's, with its (D + 6) r, does not)."""

    def draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, role: str):
        if role == "keys":
            groups = (*shape[:-1], shape[-1] // 32, 1)
            mean = magnitude * rng.choice([-1.0, 1.0], groups) * rng.uniform(1, 2, groups)
            spread = 10.0 ** rng.uniform(np.log10(254 / 70000), 0.5, groups)
            x = mean * (1 + spread * rng.uniform(-1, 1, (*groups[:-1], 32)))
            return x.reshape(shape).astype(FLOAT_DTYPES[dtype])
        if role == "queries":
            q = rng.standard_normal(shape) * 0.1 / magnitude
            small = rng.random(shape) < 0.1
            q[small] *= 10.0 ** rng.uniform(-10, 0, int(small.sum()))
            return q.astype(FLOAT_DTYPES[dtype])
        return _normal(rng, shape, dtype)

    return draw


def rising_scores_draw(positions: int, rise: float):
    """Keys along one direction whose scores rise from 0 to `rise` over the first
    `positions` positions, alike for every query head (queries of ones): each chunk a read
    takes raises the heads' maxima, so whatever a read has summed is rescaled at every
    step; values about 5 (affine biases far from 0)."""
    drawn = 0

    def draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, role: str):
        nonlocal drawn
        D = shape[-1]
        if role == "keys":
            score = rise * np.arange(drawn, drawn + shape[2]) / positions
            drawn += shape[2]
            direction = score[:, None] / np.sqrt(D)
            x = direction * (1 + 0.01 * rng.standard_normal(shape))
            return x.astype(FLOAT_DTYPES[dtype])
        if role == "queries":
            return np.ones(shape, FLOAT_DTYPES[dtype])
        return (5 + rng.standard_normal(shape)).astype(FLOAT_DTYPES[dtype])

    return draw


def one_hot_rows_draw():
    """Values of one 1 each, at the row's own element (rows in the order drawn), so that a
    read's output element t is row t's softmax weight, each alone; keys standard normal and
    queries twice that, scores of about 2 at head dim 128, so that the weights differ by
    factors of ten. Over a few such rows a fault in the keys' decode or in the scores moves
    a weight by more than the kernel bound, where over hundreds of rows, or over scores
    near 0, such faults average out of the output."""
    drawn = 0

    def draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: str, role: str):
        nonlocal drawn
        if role != "values":
            magnitude = 2.0 if role == "queries" else 1.0
            return (magnitude * rng.standard_normal(shape)).astype(FLOAT_DTYPES[dtype])
        rows = np.arange(drawn, drawn + shape[2])
        drawn += shape[2]
        x = np.zeros(shape)
        x[:, :, np.arange(shape[2]), rows % shape[-1]] = 1.0
        return x.astype(FLOAT_DTYPES[dtype])

    return draw


@pytest.mark.parametrize("kind", sorted(READ_KINDS))
@pytest.mark.parametrize("groups", [1, 4])
def test_a_read_of_a_few_one_hot_rows_is_within_bound(
    backend: Backend, kind: str, groups: int
) -> None:
    """READ-7 over nine rows whose values each hold one 1 (`one_hot_rows_draw`): the output
    shows every row's weight, so each key's decode is held, on both bodies."""
    head_dim = 256 if kind.endswith("head256") else 128
    dtype = "float16" if kind == "kv" or kind.endswith("float16") else "bfloat16"
    lengths = [8, 1]
    _assert_reads_within_bound(
        backend, READ_KINDS[kind], head_dim, dtype, groups, lengths, "each", one_hot_rows_draw()
    )


@pytest.mark.parametrize("kind", sorted(HEAD_DIM_KINDS))
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_a_read_of_a_few_one_hot_rows_at_every_head_dim_is_within_bound(
    backend: Backend, kind: str, head_dim: int
) -> None:
    """The few one-hot rows' read (`one_hot_rows_draw`) at each head dim the kernels take:
    each head dim lays a row's elements out over the lanes its own way."""
    factory, dtype = HEAD_DIM_KINDS[kind]
    if kind.startswith("turbo") and head_dim not in turboquant.HEAD_DIMS:
        pytest.skip(f"TQ-1 has no sign table for head_dim {head_dim}")
    _assert_reads_within_bound(
        backend, factory, head_dim, dtype, 4, [8, 1], "each", one_hot_rows_draw()
    )


@pytest.mark.parametrize("kind", ["kv", "affine-4-64", "affine-8-32", "turbo-k8v4-dense"])
def test_a_read_whose_maxima_rise_at_every_chunk_is_within_bound(
    backend: Backend, kind: str
) -> None:
    """READ-7's split softmax rescales what a warp has summed each time a maximum rises (the
    values' sums, and with scaled weights their biases' too): scores rising by 8 over 250
    positions. On CUDA the live rows are cut into splits of at least 64 positions (READ-7),
    four here, of 63 positions: two chunks of 8 or more a warp."""
    _assert_reads_within_bound(
        backend,
        READ_KINDS[kind],
        128,
        "bfloat16",
        4,
        [248, 1, 1],
        "each",
        rising_scores_draw(250, 8.0),
    )


@pytest.mark.parametrize("kind", ["kv", "affine-4-64", "affine-8-32", "turbo-k8v4-dense"])
def test_the_rising_read_gives_every_warp_two_chunks_or_more(backend: Backend, kind: str) -> None:
    """What the rising-maxima read above can catch rests on how the CUDA kernels cut it
    (docs/mutants.md: a fault of the rescale within a warp shows only where a warp takes
    two chunks of 8 positions or more). On the CUDA path with the kernels stood in (any
    device), its last read's pass 1 launches `warps` warps a block, room for at least
    READ-7's `splits` of its 250 rows (ceil(250 / 64) = 4); split s takes positions
    [s p, (s + 1) p), p = ceil(250 / splits), and warp w its chunks w, w + warps, ...:
    every warp of every split must take two or more."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the launches of the MLX backend's decode-attention kernels")
    import mlx.core as mx

    from kvspec.conformance.stand_ins import cuda_path, kernels_made_by, zero_outputs

    launched: list[tuple[int, int]] = []

    def make(name: str, input_names, output_names, source: str, header: str = "", **_):
        def launch(*, inputs, output_shapes, output_dtypes, grid, threadgroup, **options):
            if name.startswith("kvspec_decode_attention"):
                launched.append((threadgroup[0] // 32, grid[0] // threadgroup[0]))
            return zero_outputs(output_shapes, output_dtypes)

        return launch

    rows = 250
    rng = np.random.default_rng(0)
    draw = rising_scores_draw(rows, 8.0)
    with cuda_path(), kernels_made_by(make):
        cache = READ_KINDS[kind](backend.module("caches"))
        for L in [rows - 2, 1, 1]:
            k = backend.from_numpy(draw(rng, (1, 2, L, 128), "bfloat16", "keys"))
            v = backend.from_numpy(draw(rng, (1, 2, L, 128), "bfloat16", "values"))
            if L > 1:
                cache.append_window(k, v)
            else:
                read = cache.append_decode(k, v)
        launched.clear()
        read.attend(mx.ones((1, 8, 1, 128), mx.bfloat16), 128**-0.5)
    warps, launched_splits = launched[0]
    splits = -(-rows // 64)
    assert launched_splits >= splits
    per_split = -(-rows // splits)
    for split in range(splits):
        positions = min(rows, (split + 1) * per_split) - split * per_split
        chunks = -(-positions // 8)
        assert min(len(range(w, chunks, warps)) for w in range(warps)) >= 2, (split, chunks)


@pytest.mark.parametrize("kernels", ["dense", "deferred"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1e2, 3e3])
def test_turboquant_reads_of_far_zero_points_and_extreme_queries_are_within_bound(
    backend: Backend, kernels: str, head_dim: int, dtype: str, magnitude: float
) -> None:
    """READ-7's group scores for TurboQuant keys (on CUDA's tensor cores: 1152 + code
    against a query scaled by its head's power of two, then zero and scale) at zero points
    far from the codes and queries past float16's range, on each body that takes them,
    within READ-7's kernel bound."""
    factory = partial(_turbo_k8v4, kernels=kernels)
    _assert_reads_within_bound(
        backend,
        factory,
        head_dim,
        dtype,
        4,
        [40, 1, 1],
        "each",
        far_zero_draw(magnitude),
    )


def _turbo_k8v4(c, kernels: str):
    return c.TurboQuantKVCache(8, 4, kernels, checks="deferred")


@pytest.mark.parametrize("kind", sorted(READ_KINDS))
@pytest.mark.parametrize("body", ["default", "cuda-cores"])
def test_a_decode_read_of_one_row_returns_its_values_as_decoded(
    backend: Backend, kind: str, body: str
) -> None:
    """READ-7 decodes each stored element to exactly the operand the reference's read
    holds. Over one row the softmax weight is exactly 1, so the attention's output is that
    row's values as decoded, bit for bit, whichever order the kernels sum in: a decode
    rounded differently (a product and a sum fused into one rounding) shows here, where
    the bound of `test_decode_read_of_stored_fields_is_within_bound` would hide it."""
    if body == "cuda-cores" and not _kernels_on_cuda(backend):
        pytest.skip("the CUDA-core body of the decode-attention kernels runs on CUDA only")
    if body == "default" and kind.startswith("turbo") and _kernels_on_cuda(backend):
        pytest.skip(
            "TurboQuant values decode to float32, which the tensor cores truncate to TF32 "
            "(READ-7); their CUDA-core body is held here"
        )
    head_dim = 256 if kind.endswith("head256") else 128
    dtype = "float16" if kind == "kv" or kind.endswith("float16") else "bfloat16"
    expected, read, queries, scale = _one_row_read(backend, READ_KINDS[kind], head_dim, dtype)
    attend = read.attend if body == "default" else partial(_cuda_core_attend, read)
    actual = backend.to_numpy(attend(queries, scale))
    wanted = expected(body == "default")
    assert_same_bits(actual.astype(wanted.dtype), wanted, kind)


#: Query heads of the one-row reads, over 2 KV heads.
ONE_ROW_QUERY_HEADS = 8


def _one_row_read(backend: Backend, factory, head_dim: int, dtype: str):
    """One position appended to a reference cache and to one of the backend's: what the
    backend's read returns over it as a function of whether the read is by its default body
    (the reference's attention, float32, or where the kernels' default body reads the
    values with scaled weights, `_scaled_weights_row`), the backend's read, its queries and
    scale."""
    rng = np.random.default_rng(7)
    k = _normal(rng, (1, 2, 1, head_dim), dtype)
    v = _normal(rng, (1, 2, 1, head_dim), dtype)
    queries = _normal(rng, (1, ONE_ROW_QUERY_HEADS, 1, head_dim), dtype)
    ref = factory(caches)
    want = _reference_read(ref, k, v)
    read = factory(backend.module("caches")).append_decode(
        backend.from_numpy(k), backend.from_numpy(v)
    )
    scale = head_dim**-0.5
    attention = want.attend(queries, scale)
    scaled = _kernels_on_cuda(backend) and _with_scaled_weights(read, ONE_ROW_QUERY_HEADS)

    def expected(default_body: bool) -> np.ndarray:
        if default_body and scaled:
            return _scaled_weights_row(ref, ONE_ROW_QUERY_HEADS, dtype)
        return attention

    return expected, read, backend.from_numpy(queries), scale


def _scaled_weights_row(ref: caches.Cache, query_heads: int, dtype: str) -> np.ndarray:
    """READ-7's scaled weights over one stored row, whose weight is exactly 1: each value is
    s (2^bits + c) + (b - 2^bits s) in float32, s (2^bits + c) exact and b - 2^bits s
    rounded once, then rounded to the output's format `dtype` [1, query_heads, 1, Dv]."""
    value_scales, value_biases, value_bits = _value_groups(ref)
    storage = ref.storage if isinstance(ref, caches.Bf16FirstCache) else ref
    words = storage.state().arrays[3]
    dim = words.shape[-1] * 32 // value_bits
    codes = bits.unpack_words(words, value_bits, dim).astype(np.float32)
    per_element = dim // value_scales.shape[-1]
    s = np.repeat(value_scales.astype(np.float32), per_element, axis=-1)
    b = np.repeat(value_biases.astype(np.float32), per_element, axis=-1)
    offset = np.float32(2**value_bits)
    row = s * (offset + codes) + (b - offset * s)
    heads = np.repeat(row, query_heads // row.shape[1], axis=1)
    return heads.astype(FLOAT_DTYPES[dtype]).astype(np.float32)


@pytest.mark.parametrize("kind", sorted(HEAD_DIM_KINDS))
@pytest.mark.parametrize("head_dim", KERNEL_HEAD_DIMS)
def test_a_decode_read_of_one_row_at_every_head_dim_returns_its_values_as_decoded(
    backend: Backend, kind: str, head_dim: int
) -> None:
    """READ-7's exact operands (as `test_a_decode_read_of_one_row_returns_its_values_as_decoded`)
    at each head dim the kernels take: on CUDA the CUDA-core body, and the default one unless
    it is the tensor-core body over values that decode to float32 (TurboQuant's, float32
    rows' and float32 scales' affine ones), which it truncates to TF32."""
    factory, dtype = HEAD_DIM_KINDS[kind]
    if kind.startswith("turbo") and head_dim not in turboquant.HEAD_DIMS:
        pytest.skip(f"TQ-1 has no sign table for head_dim {head_dim}")
    expected, read, queries, scale = _one_row_read(backend, factory, head_dim, dtype)
    on_tensor_cores = _kernels_on_cuda(backend) and _on_tensor_cores(read)
    values_float32 = dtype == "float32" or kind.startswith("turbo")
    # Each attend, and whether it is the default body's.
    attends = [] if on_tensor_cores and values_float32 else [(read.attend, True)]
    if on_tensor_cores:
        attends.append((partial(_cuda_core_attend, read), False))
    for attend, default_body in attends:
        actual = backend.to_numpy(attend(queries, scale))
        wanted = expected(default_body)
        assert_same_bits(actual.astype(wanted.dtype), wanted, f"{kind} at {head_dim}")


@pytest.mark.lazy_graph
@pytest.mark.parametrize("kind", sorted(READ_KINDS))
def test_a_decode_append_writes_its_rows_at_a_static_start(backend: Backend, kind: str) -> None:
    """CACHE-3, RING-2 on MLX: the graph of a decode read writes the new row with static
    slice updates. An update whose start is an array (DynamicSliceUpdate) stores the same
    bits but cost about 0.5 ms per layer on MLX's CUDA backend (docs/performance-log.md)."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's graph")
    import io

    import mlx.core as mx

    head_dim = 256 if kind.endswith("head256") else 128
    rng = np.random.default_rng(3)
    acc = READ_KINDS[kind](backend.module("caches"))
    k, v = (backend.from_numpy(_normal(rng, (1, 2, 37, head_dim), "bfloat16")) for _ in "kv")
    acc.append_window(k, v)
    mx.eval(acc.state().arrays)
    k, v, queries = (
        backend.from_numpy(_normal(rng, shape, "bfloat16"))
        for shape in ((1, 2, 1, head_dim), (1, 2, 1, head_dim), (1, 4, 1, head_dim))
    )
    graph = io.StringIO()
    mx.export_to_dot(graph, acc.append_decode(k, v).attend(queries, head_dim**-0.5))
    primitives = graph.getvalue()
    assert 'label ="SliceUpdate"' in primitives
    assert "DynamicSliceUpdate" not in primitives


@pytest.mark.parametrize("kind", ["affine-4-64", "turbo-k8v4-dense", "bf16-first-turbo"])
def test_a_bad_deferred_append_reads_nan_and_is_raised_once(backend: Backend, kind: str) -> None:
    rng = np.random.default_rng(7)
    ref = READ_KINDS[kind](caches)
    acc = READ_KINDS[kind](backend.module("caches"))
    k = _normal(rng, (1, 2, 40, 128), "bfloat16")
    v = _normal(rng, (1, 2, 40, 128), "bfloat16")
    for cache, to in ((ref, np.asarray), (acc, backend.from_numpy)):
        cache.append_window(to(k), to(v))
    bad_k = _normal(rng, (1, 2, 1, 128), "bfloat16")
    bad_k[0, 1, 0, 9] = np.nan  # KV head 1 only
    v1 = _normal(rng, (1, 2, 1, 128), "bfloat16")
    queries = _normal(rng, (1, 4, 1, 128), "bfloat16")
    out = backend.to_numpy(
        acc.append_decode(backend.from_numpy(bad_k), backend.from_numpy(v1)).attend(
            backend.from_numpy(queries), 128**-0.5
        )
    )
    ref.append_decode(bad_k, v1)
    # Query heads 2 and 3 read KV head 1: NaN, as bf16 storage of a NaN would give.
    assert np.all(np.isnan(out[:, 2:].astype(np.float32)))
    assert np.all(np.isfinite(out[:, :2].astype(np.float32)))
    for cache in ref, acc:
        with pytest.raises(ValueError, match="NaN or inf"):
            cache.check()
        cache.check()  # raised once
    want, got = ref.state(), acc.state()
    assert (want.offset, want.signature) == (got.offset, got.signature)
    for slot, (a, e) in enumerate(zip(got.arrays, want.arrays, strict=True)):
        assert_same_bits(backend.to_numpy(a), e, f"DEFER-1 {kind} slot {slot}")


def test_a_failure_rank_names_one_check() -> None:
    """DEFER-2: ranks 1 .. len(checks) name a check, the last check rank 1; rank 0 (no
    failure) and ranks past the checks name none."""
    checks = ("first", "second", "third")
    assert [failure_message(checks, rank) for rank in (1, 2, 3)] == ["third", "second", "first"]
    for rank in (0, 4, -1):
        with pytest.raises(ValueError, match="names none of 3 checks"):
            failure_message(checks, rank)


def test_state_raises_a_recorded_failure_first(backend: Backend) -> None:
    cache = backend.module("caches").TurboQuantKVCache(8, 4, checks="deferred")
    k = np.zeros((1, 1, 2, 64), np.float32)
    k[0, 0, 1, 0] = np.inf
    cache.append_window(backend.from_numpy(k), backend.from_numpy(np.ones_like(k)))
    with pytest.raises(ValueError, match="keys hold NaN or inf"):
        cache.state()
    assert cache.state().offset == 2


def test_deferred_check_append_checks_only_the_layout(backend: Backend) -> None:
    cache = backend.module("caches").QuantizedKVCache(64, 4, checks="deferred")
    bad = np.full((1, 1, 1, 128), np.nan, np.float32)
    cache.check_append(backend.from_numpy(bad), backend.from_numpy(bad))
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        cache.check_append(backend.from_numpy(bad[..., :96]), backend.from_numpy(bad[..., :96]))
    cache.check()
    with pytest.raises(ValueError, match="checks must be one of"):
        backend.module("caches").QuantizedKVCache(64, 4, checks="lazy")


@pytest.mark.parametrize("kind", ["affine-4-64", "turbo-k8v4-dense"])
def test_a_failure_is_kept_past_later_good_appends(backend: Backend, kind: str) -> None:
    """DEFER-3: the running rank keeps the earliest check any append failed until check()."""
    cache = READ_KINDS[kind](backend.module("caches"))
    rng = np.random.default_rng(3)
    good = _normal(rng, (1, 2, 1, 128), "float32")
    bad = good.copy()
    bad[0, 0, 0, 0] = np.inf
    for k in (good, bad, good, good):
        cache.append_decode(backend.from_numpy(k), backend.from_numpy(good))
    with pytest.raises(ValueError, match="NaN or inf"):
        cache.check()
    cache.check()


def _stored_side(fmt: int, dim: int, group: int, bits: int = 4):
    """A stored side of the MLX backend's kernels, its fields never read (for their fits)."""
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels as kernels

    codes = mx.zeros((1, 1, 4, dim), mx.bfloat16)
    return kernels.StoredSide(fmt, codes, None, None, bits, group, dim)


def _assert_refused(sides: tuple, tensor_cores: bool, match: str) -> None:
    """decode_attention, asked for a body that does not take `sides`, refuses before
    anything is built."""
    import mlx.core as mx

    from kvspec.accelerated import attention_kernels as kernels

    queries = mx.zeros((1, 2, 1, sides[0].dim), mx.bfloat16)
    with pytest.raises(ValueError, match=match):
        kernels.decode_attention(queries, sides, 0.1, mx.bfloat16, tensor_cores=tensor_cores)


def test_tensor_core_fit_takes_the_head_dims_and_groups_it_was_tested_on(backend) -> None:
    """READ-7: the tensor-core body is the default for head dims 64, 128 and 256 where a
    lane's share of a row lies in one group; asked for anything else, decode_attention
    refuses before anything is built."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's kernels")
    from kvspec.accelerated import attention_kernels as kernels

    side = _stored_side
    plain, affine = kernels.PLAIN, kernels.AFFINE
    assert kernels.tensor_core_fit(side(plain, 128, 0), side(plain, 128, 0))
    assert kernels.tensor_core_fit(side(affine, 256, 64, 8), side(affine, 256, 64, 8))
    # A TurboQuant key row of 256 gives each lane 64 elements: two groups of 32.
    assert not kernels.tensor_core_fit(
        side(kernels.TURBO_KEY, 256, 32, 8), side(kernels.TURBO_VALUE, 256, 32, 8)
    )
    assert not kernels.tensor_core_fit(side(plain, 96, 0), side(plain, 96, 0))
    assert not kernels.tensor_core_fit(side(plain, 512, 0), side(plain, 512, 0))
    _assert_refused((side(plain, 96, 0), side(plain, 96, 0)), True, "tensor-core body")


def test_cuda_core_fit_takes_every_head_dim_the_kernels_take(backend) -> None:
    """READ-7: the CUDA-core body gives each of 32 lanes D/32 elements of a row, which may
    reach into a second group of a coded format (affine codes at head dims 96, 160, 192):
    it takes every head dim of the kernels' with any group; asked for another head dim,
    decode_attention refuses before anything is built."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's kernels")
    from kvspec.accelerated import attention_kernels as kernels

    side = _stored_side
    affine, plain = kernels.AFFINE, kernels.PLAIN
    for dim in KERNEL_HEAD_DIMS:
        assert kernels.cuda_core_fit(side(plain, dim, 0), side(plain, dim, 0))
        for group in (32, 64, 128):
            assert kernels.cuda_core_fit(side(affine, dim, group), side(affine, dim, group))
    assert not kernels.cuda_core_fit(side(plain, 48, 0), side(plain, 48, 0))
    _assert_refused((side(affine, 48, 16), side(affine, 48, 16)), False, "CUDA-core body")
