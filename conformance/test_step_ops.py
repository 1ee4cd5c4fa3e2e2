"""What one decode step hands MLX on the CUDA path: its kernel launches, slice writes and
other ops per layer. On MLX's CUDA backend each op costs the host microseconds whatever
its size, so these counts set the step's time (docs/performance.md); a change that adds an
op per step should fail here, not only on a GPU. The CUDA path runs on any device with its
kernels stood in by calls that make their outputs, so the counts are of the Python that
builds the step, not of the kernels."""

from __future__ import annotations

import io
import re
from collections import Counter

import numpy as np
import pytest

from kvspec.conformance.backend import Backend

#: Per kind: kernel launches, the arrays they take in all (each costs the host time: a
#: format's absent fields are not stood in for; a record is one array; TurboQuant's
#: codebook, boundaries and signs are in the kernels' sources), static slice writes
#: (one per stored field or record), and the other ops of our own a step adds besides (none:
#: the kernels read whole buffers, the live row count given as data; pass 1 hands the merge
#: one array).
BUDGETS = {
    "KVCache": (lambda c: c.KVCache(), 2, 5, 2, {}),
    "RotatingKVCache": (lambda c: c.RotatingKVCache(64, keep=4), 2, 5, 2, {}),
    "QuantizedKVCache 4-bit g64": (
        lambda c: c.QuantizedKVCache(64, 4, checks="deferred"),
        3,
        7,
        1,
        {},
    ),
    "RotatingQuantizedKVCache 4-bit g64": (
        lambda c: c.RotatingQuantizedKVCache(64, 64, 4, checks="deferred"),
        3,
        7,
        1,
        {},
    ),
    "TurboQuantKVCache k8v4": (
        lambda c: c.TurboQuantKVCache(8, 4, "dense", checks="deferred"),
        3,
        7,
        1,
        {},
    ),
    "Bf16FirstTurboQuantKVCache k8v3": (
        lambda c: c.Bf16FirstTurboQuantKVCache(8, 3, 20, checks="deferred"),
        3,
        7,
        1,
        {},
    ),
}


@pytest.fixture
def cuda_path(backend: Backend):
    """The accelerated backend's CUDA path with stand-in kernels; yields their Launches."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's decode step")
    from kvspec.conformance.stand_ins import cuda_path as stood_in

    with stood_in() as launches:
        yield launches


def _primitives(arrays: list) -> Counter:
    import mlx.core as mx

    graph = io.StringIO()
    mx.export_to_dot(graph, *arrays)
    return Counter(re.findall(r'label ="(\w+)", shape=rectangle', graph.getvalue()))


@pytest.mark.parametrize("kind", sorted(BUDGETS))
# 32 KV heads of 128 (a multi-head model's decode) are the most one encode block takes:
# the affine pair's 1024 threads, TurboQuant's 4096 coordinates. No op folds blocks' ranks.
@pytest.mark.parametrize("kv_heads", [2, 32])
def test_a_decode_step_hands_mlx_its_budget_of_ops(
    backend: Backend, cuda_path, kind, kv_heads
) -> None:
    import mlx.core as mx

    from kvspec.accelerated.caches.reads import running

    make, launches, arrays, writes, others = BUDGETS[kind]
    cache = make(backend.module("caches"))
    rng = np.random.default_rng(0)

    def normal(shape: tuple[int, ...]) -> mx.array:
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    cache.append_window(normal((1, kv_heads, 37, 128)), normal((1, kv_heads, 37, 128)))
    # A first step may grow the buffers (CACHE-3, RING-2; a bf16-first cache's converted
    # buffer holds its rows exactly): once per 256 steps, not the step measured.
    cache.append_decode(normal((1, kv_heads, 1, 128)), normal((1, kv_heads, 1, 128)))
    mx.eval(cache.state().arrays)
    k, v = normal((1, kv_heads, 1, 128)), normal((1, kv_heads, 1, 128))
    queries = normal((1, 2 * kv_heads, 1, 128))
    mx.eval(k, v, queries)
    cuda_path.clear()
    cuda_path.inputs.clear()
    out = cache.append_decode(k, v).attend(queries, 128**-0.5)
    assert sum(cuda_path.values()) == launches, dict(cuda_path)
    assert len(cuda_path.inputs) == arrays, [tuple(a.shape) for a in cuda_path.inputs]
    storage = getattr(cache, "storage", cache)
    # The step's graph: its output, the stored fields (or the record holding them, whose
    # fields' views are made only where read) and what the kernels were given (a
    # stand-in's outputs do not depend on its inputs).
    fields = storage._fields
    held = [fields.record] if hasattr(fields, "record") else list(fields)
    rank = running(storage)  # a deferred storage's: the encode's own output, not folded
    held += [] if rank is None else [rank]
    primitives = _primitives([out, *held, *cuda_path.inputs])
    assert primitives["SliceUpdate"] == writes, primitives
    assert primitives["DynamicSliceUpdate"] == 0, primitives
    # Nothing else of ours (constants aside: the stand-ins' outputs): no rank
    # dependency (DEFER-3), no copy, no conversion.
    ours = {
        name: n
        for name, n in primitives.items()
        if name not in ("SliceUpdate", "Full", "Broadcast")
    }
    assert ours == others, primitives


def test_a_compiled_step_hands_mlx_one_position_and_length_for_all_layers(
    backend: Backend,
) -> None:
    """COMPILE-3 on MLX: caches at one offset give the compiled graph the same write-position
    and active-length arrays, so that a step over L layers makes and uploads them once."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's compiled step")
    import mlx.core as mx

    layers = [backend.module("caches").KVCache() for _ in range(3)]
    kv = mx.zeros((1, 2, 5, 64), mx.bfloat16)
    inputs = []
    for cache in layers:
        cache.append_window(kv, kv)
        inputs.append(cache.decode_inputs(cache.prepare_decode_step()))
    for position_and_length in zip(*(step_inputs[2:4] for step_inputs in inputs), strict=True):
        assert all(array is position_and_length[0] for array in position_and_length)
    assert [int(array.item()) for array in inputs[0][2:4]] == [5, 6]


@pytest.mark.parametrize("kind", sorted(BUDGETS))
def test_a_compiled_step_hands_its_kernels_the_inputs_as_given(
    backend: Backend, cuda_path, kind
) -> None:
    """COMPILE-3, COMPILE-4 on MLX's CUDA path: the traced step's kernels take the write
    position and the active length as the step's inputs are (int32 [1]), and nothing of
    ours besides their launches: an op here would run in the compiled graph once per
    layer and step (a reshape of each of the two costs the host as a view does)."""
    import mlx.core as mx

    make = BUDGETS[kind][0]
    cache = make(backend.module("caches"))
    kv = mx.zeros((1, 2, 37, 128), mx.bfloat16)
    one = mx.ones((1, 2, 1, 128), mx.bfloat16)
    cache.append_window(kv, kv)
    # A step that grows the buffers (once per 256 steps; a ring's up to its size) joins
    # them: not the step measured.
    cache.append_decode(one, one)
    mx.eval(cache.state().arrays)
    plan = cache.prepare_decode_step()
    slot = cache.decode_slot(plan)
    inputs = cache.decode_inputs(plan)
    position, length = (array for array in inputs if array.dtype == mx.int32)
    assert position.shape == length.shape == (1,)
    assert (position.item(), length.item()) == (plan.write_position, plan.active_length)
    read = slot.trace(inputs).append_decode(one, one)
    cuda_path.inputs.clear()
    read.attend(mx.ones((1, 4, 1, 128), mx.bfloat16), 1.0)
    given = [array for array in cuda_path.inputs if array.dtype == mx.int32 and array.size == 1]
    assert any(array is position for array in given) and any(array is length for array in given)
    ours = {
        name: n
        for name, n in _primitives(cuda_path.inputs).items()
        if name not in ("Full", "Broadcast")
    }
    assert ours == {}, ours


def test_an_eager_step_hands_mlx_one_live_row_count_for_all_layers(backend: Backend) -> None:
    """READ-7 on MLX: the decode reads of caches at one offset give the kernels the same
    live-row-count array (the buffers whole, no slice), made once for all layers."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's decode read")
    import mlx.core as mx

    layers = [backend.module("caches").TurboQuantKVCache(8, 4, checks="deferred") for _ in range(3)]
    kv = mx.zeros((1, 2, 5, 64), mx.bfloat16)
    one = mx.zeros((1, 2, 1, 64), mx.bfloat16)
    reads = []
    for cache in layers:
        cache.append_window(kv, kv)
        reads.append(cache.append_decode(one, one))
    assert all(read.rows is reads[0].rows for read in reads)
    assert reads[0].rows.tolist() == [6]


def test_an_eager_step_hands_wrapped_rings_their_order_made_once(
    backend: Backend, cuda_path
) -> None:
    """READ-7, ROWS-6 on MLX: the decode reads of padded rings that wrapped, at one offset,
    give the kernels the same order for every layer: one array of keep and the padding
    (at least 16 bytes: MLX keeps smaller ones in host memory), made once for the storage's
    configuration, and the turn and oldest position as views of the device's counting
    table (caches.counting). No step makes an array from host data."""
    import mlx.core as mx

    from kvspec.accelerated.caches.counting import COUNTS

    layers = [backend.module("caches").RotatingKVCache(8) for _ in range(3)]
    kv = mx.zeros((2, 2, 10, 64), mx.bfloat16)
    one = mx.zeros((2, 2, 1, 64), mx.bfloat16)
    for cache in layers:
        cache.prepare(left_padding=[0, 9])
        cache.append_window(kv, kv)
    for step in range(2):
        reads = [cache.append_decode(one, one) for cache in layers]
        orders = [read.order for read in reads]
        assert all(order.order is orders[0].order for order in orders)
        assert orders[0].order.tolist() == [0, 0, 9, 0]
        # The ring holds positions 3 + step .. 10 + step, its oldest at buffer row 1 + step.
        assert all(order.turn is COUNTS.single(1 + step) for order in orders)
        assert all(order.oldest is COUNTS.single(3 + step) for order in orders)


@pytest.mark.parametrize(
    ("kind", "k_shape", "v_shape", "v_dtype"),
    [
        ("affine", (1, 2, 1, 96), (1, 2, 1, 96), "bfloat16"),  # head_dim off the group
        ("affine", (1, 2, 1, 128), (1, 3, 1, 128), "bfloat16"),  # two head counts
        ("affine", (1, 2, 1, 128), (1, 2, 1, 128), "float16"),  # two dtypes
        ("turbo", (1, 2, 1, 48), (1, 2, 1, 48), "bfloat16"),  # a head_dim TurboQuant lacks
    ],
)
def test_the_cuda_path_rejects_what_its_encoders_cannot_take_before_a_launch(
    backend: Backend, cuda_path, kind, k_shape, v_shape, v_dtype
) -> None:
    """On the CUDA path a cache checks an append once and its record encoders trust that
    check (QKV-1, TQC-1): an append the format cannot take raises ValueError before any
    kernel is launched, and the cache stays as it was (CACHE-2)."""
    import mlx.core as mx

    caches = backend.module("caches")
    cache = (
        caches.QuantizedKVCache(64, 4, checks="deferred")
        if kind == "affine"
        else caches.TurboQuantKVCache(8, 4, "dense", checks="deferred")
    )
    with pytest.raises(ValueError):
        cache.append_decode(mx.zeros(k_shape, mx.bfloat16), mx.zeros(v_shape, getattr(mx, v_dtype)))
    assert sum(cuda_path.values()) == 0
    assert cache.offset == 0


@pytest.mark.parametrize(
    ("v_shape", "v_dtype"), [((1, 2, 3, 128), "float16"), ((1, 2, 4, 128), "bfloat16")]
)
def test_the_affine_pair_kernel_takes_keys_and_values_alike_alone(
    backend: Backend, cuda_path, v_shape, v_dtype
) -> None:
    """The one-launch pair encode, called without a cache's checks, refuses keys and values
    of another dtype alone or another shape alone, before a launch."""
    import mlx.core as mx

    from kvspec.accelerated import affine_kernels

    k = mx.zeros((1, 2, 3, 128), mx.bfloat16)
    with pytest.raises(ValueError, match="share shape and dtype"):
        affine_kernels.quantize_pair_groups(k, mx.zeros(v_shape, getattr(mx, v_dtype)), 64, 4)
    assert sum(cuda_path.values()) == 0


@pytest.mark.parametrize(
    ("shape", "rows_a_block", "blocks"),
    [
        ((1, 8, 1, 128), 8, 1),  # a decode step of 8 heads: 1024 coordinates
        ((1, 32, 1, 128), 32, 1),  # of 32 heads: 4096, the most one block takes
        ((2, 8, 1, 256), 16, 1),  # 16 rows of 256: 4096
        ((1, 8, 5, 128), 8, 5),  # 5120 coordinates: blocks of 1024
        ((1, 2, 9, 512), 2, 9),  # rows of 512: two a block, the blocks' 1024
        ((1, 1, 3, 64), 3, 1),
    ],
)
def test_a_turboquant_encode_takes_the_blocks_its_shape_needs(
    backend: Backend, cuda_path, shape, rows_a_block, blocks
) -> None:
    """TQ-14's encode: a thread per eight coordinates; up to 4096 coordinates (a decode
    step's) in one block, whose rank needs no fold; more in blocks of at most 1024
    coordinates and 256 threads."""
    import mlx.core as mx

    from kvspec.accelerated import turboquant, turboquant_kernels

    D = shape[-1]
    layout = turboquant.stored_layout(8, 4, D)
    launch = turboquant_kernels.encode_launch(shape, mx.bfloat16, 8, 4, layout)
    assert launch.options["threadgroup"] == (D // 8, rows_a_block, 1)
    assert launch.options["grid"] == (blocks * D // 8, rows_a_block, 1)
    assert launch.options["output_shapes"][-1] == (blocks,)
    assert launch.folded == (blocks > 1)
