"""How informative the read bounds are (READ-1): over the reads the cache machines make,
READ-1's bound and the rounded-attention interval (bounds.rounded_attention_interval),
each over the largest output magnitude of its read.

READ-1's bound holds any float32 attention; with bfloat16 keys it often exceeds the output
itself, so a read wrong by a whole value could pass it. The interval holds a backend that
rounds as MLX's CPU attention does (Backend.rounded_attention); its target: at most 1/100
of the largest output in 99% of the reads. Reads whose outputs all lie below float32's
normal range (every value they see is 0 or subnormal) are counted apart: there a relative
measure says nothing (READ-1's tau), and the machines still hold each of them inside its
interval. `pytest -s` prints both distributions.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvspec.conformance.bounds import (
    KERNEL_ROUNDOFF,
    attention_bound,
    kernel_attention_bound,
    read_error,
    unrotated_bound,
)
from kvspec.conformance.cache_machine import ReadLog, run_machine
from kvspec.conformance.test_decode_step import far_zero_draw
from kvspec.reference import bits as np_bits
from kvspec.reference import caches, turboquant
from kvspec.reference.caches.reads import DenseRead
from kvspec.reference.caches.turboquant import DeferredRead
from kvspec.reference.dtypes import FLOAT_DTYPES

#: One small kind of each storage: plain, affine, ring, TurboQuant (dense and deferred).
KINDS = st.sampled_from(
    [
        (lambda m: m.KVCache(), 64, None),
        (lambda m: m.QuantizedKVCache(64, 4), 64, 64),
        (lambda m: m.RotatingKVCache(8, 1), 64, None),
        (lambda m: m.TurboQuantKVCache(8, 4), 128, None),
        (lambda m: m.TurboQuantKVCache(4, 3, "deferred"), 64, None),
    ]
)
#: The target of the rounded-attention interval.
TARGET_FRACTION, TARGET_SHARE = 1 / 100, 0.99
#: float32's smallest normal: below it a read's outputs are measured by READ-1's tau.
NORMAL = float(np.finfo(np.float32).tiny)


def _distribution(ratios: np.ndarray) -> str:
    p50, p90, p99 = np.percentile(ratios, [50, 90, 99])
    return (
        f"p50 {p50:.2e}, p90 {p90:.2e}, p99 {p99:.2e}, max {ratios.max():.2e}; "
        f">= 1/10 in {np.mean(ratios >= 0.1):.1%}, >= 1 in {np.mean(ratios >= 1):.1%}"
    )


def test_rounded_attention_interval_is_informative(backend) -> None:
    """READ-1: the interval is at most 1/100 of the output in 99% of the machines' dense
    reads (the machines check every read against it)."""
    log: ReadLog = []
    # A fixed draw large enough for a 99% share: reads within one run share their cache's
    # contents, so a small random draw swings (98.9% .. 100% over 180 reads; 99.6% .. 100%
    # over 1000+ reads in three random draws of 200 runs).
    run_machine(backend, KINDS, read_log=log, max_examples=200, derandomize=True)
    normal = [(bound, width, largest) for bound, width, largest in log if largest >= NORMAL]
    read_1 = np.array([bound / largest for bound, _, largest in normal])
    width = np.array([width / largest for _, width, largest in normal if not np.isnan(width)])
    print(
        f"\n{len(log)} reads, {len(log) - len(normal)} of them below float32's normal range; "
        f"the others' READ-1 bound / largest output: {_distribution(read_1)}"
    )
    if not backend.rounded_attention:
        return
    print(f"{len(width)} dense reads; interval / largest output: {_distribution(width)}")
    assert len(width) >= 100, f"only {len(width)} dense reads: too few for a 99% share"
    assert np.mean(width <= TARGET_FRACTION) >= TARGET_SHARE


def _tf32(x: np.ndarray, truncate: bool) -> np.ndarray:
    """float32 x in TF32 (10 stored mantissa bits): truncated, or rounded to nearest
    (ties away, as cvt.rna does)."""
    bits = np.asarray(x, np.float32).view(np.uint32)
    if not truncate:
        bits = bits + np.uint32(0x1000)
    return (bits & np.uint32(0xFFFFE000)).view(np.float32)


def _group_scores_read(read, fields, queries: np.ndarray, scale: float, offset: float):
    """A NumPy model of READ-7's tensor-core read over TurboQuant's 8-bit keys, step by
    step in the kernels' formats: each head's query times its power of two, rounded to
    float16; per group the float32 sums P of (1152 + code) times it and Q of it; the score
    sum_g scale (P + (zero - offset) Q) over the power; softmax in base 2, its weights
    rounded and the values truncated to TF32; float32 sums. `offset` 1152 is the kernels'
    (the codes' own float16 offset)."""
    codes, key_scales, key_zeros = (np.asarray(f) for f in fields[:3])
    B, Hq, _, D = queries.shape
    Hk, T = codes.shape[1], codes.shape[2]
    q = queries.astype(np.float32).reshape(B, Hk, Hq // Hk, D)
    top = np.abs(q).max(axis=-1, keepdims=True)
    _, exponent = np.frexp(top)
    power = np.where(top > 0, np.ldexp(np.float32(1), np.minimum(15 - exponent, 126)), 1)
    q16 = (q * power.astype(np.float32)).astype(np.float16).astype(np.float32)
    q_groups = q16.reshape(B, Hk, -1, 1, D // 32, 32)  # [B, Hk, G, 1, g, 32]
    operands = (1152 + codes.astype(np.float32)).reshape(B, Hk, 1, T, D // 32, 32)
    partial = (q_groups * operands).sum(axis=-1, dtype=np.float32)  # [B, Hk, G, T, g]
    sums = q_groups.sum(axis=-1, dtype=np.float32)
    zeros = key_zeros.astype(np.float32)[:, :, None]
    full = partial.astype(np.float64) + (zeros - np.float32(offset)) * sums.astype(np.float64)
    weighted = key_scales.astype(np.float32)[:, :, None] * full.astype(np.float32)
    factor = np.float32(scale) * np.float32(np.log2(np.e))
    scores = weighted.sum(axis=-1, dtype=np.float32) * (factor / power)
    p = np.exp2(scores - scores.max(axis=-1, keepdims=True)).astype(np.float32)
    values = read.rotated_values if isinstance(read, DeferredRead) else read.values
    v = _tf32(values.astype(np.float32), truncate=True)
    out = (_tf32(p, truncate=False) @ v) / p.sum(axis=-1, keepdims=True, dtype=np.float32)
    out = out.astype(np.float32).reshape(B, Hq, 1, -1)
    return turboquant.unrotate(out) if isinstance(read, DeferredRead) else out


@pytest.mark.parametrize("kernels", ["dense", "deferred"])
@pytest.mark.parametrize("magnitude", [1e-6, 1e-3, 1e2, 3e3])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_kernel_bound_holds_a_model_of_the_group_scores_and_tells_their_offset(
    kernels: str, magnitude: float, dtype: str
) -> None:
    """READ-7's kernel bound holds a NumPy model of the group scores' arithmetic, and a
    model that takes the codes' float16 offset off as 1024, not 1152 (mutants.md's
    cuda-turbo-group-scores-offset, which READ-1's bound lets by) leaves it."""
    rng = np.random.default_rng(11)
    draw = far_zero_draw(magnitude)
    cache = caches.TurboQuantKVCache(8, 4, kernels)
    cache.append_window(
        draw(rng, (1, 2, 40, 128), dtype, "keys"), draw(rng, (1, 2, 40, 128), dtype, "values")
    )
    read = cache.append_decode(
        draw(rng, (1, 2, 1, 128), dtype, "keys"), draw(rng, (1, 2, 1, 128), dtype, "values")
    )
    queries = draw(rng, (1, 8, 1, 128), dtype, "queries")
    scale = 128**-0.5
    fields = cache.state().arrays
    expected = read.attend(queries, scale).astype(np.float64)
    values = read.rotated_values if isinstance(read, DeferredRead) else read.values
    bound = kernel_attention_bound(queries, read.keys, values, scale, fields[1], fields[2])
    if isinstance(read, DeferredRead):
        bound = unrotated_bound(bound, queries, read.keys, values)
    modelled = _group_scores_read(read, fields, queries, scale, 1152.0)
    assert np.all(read_error(modelled, expected, read) <= bound)
    shifted = _group_scores_read(read, fields, queries, scale, 1024.0)
    assert np.any(read_error(shifted, expected, read) > bound)


def _tf32_read(keys: np.ndarray, values: np.ndarray, queries: np.ndarray, scale: float):
    """A NumPy model of READ-7's tensor-core read over float32 rows: the query times the
    softmax scale (base 2) rounded to TF32 and each key truncated to it, float32 sums of
    the exact products; softmax in base 2, its weights rounded and the values truncated to
    TF32; float32 sums."""
    B, Hq, _, D = queries.shape
    Hk = keys.shape[1]
    factor = np.float32(scale) * np.float32(np.log2(np.e))
    q = _tf32(queries.astype(np.float32) * factor, truncate=False).reshape(B, Hk, Hq // Hk, D)
    k = _tf32(keys, truncate=True)
    scores = np.einsum("bhgd,bhtd->bhgt", q.astype(np.float64), k).astype(np.float32)
    p = np.exp2(scores - scores.max(axis=-1, keepdims=True)).astype(np.float32)
    out = (_tf32(p, truncate=False) @ _tf32(values, truncate=True)) / p.sum(
        axis=-1, keepdims=True, dtype=np.float32
    )
    return out.astype(np.float32).reshape(B, Hq, 1, D)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    positions=st.integers(1, 300),
    key_magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 30.0, 1e20]),
)
def test_the_kernel_bound_holds_a_model_of_the_tf32_products(
    seed: int, positions: int, key_magnitude: float
) -> None:
    """READ-7's kernel bound holds a NumPy model of the tensor cores' TF32 read over float32
    rows, keys of every scale (the bound is 1/60 to 1/80 of READ-1's there)."""
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((1, 2, positions, 128)) * key_magnitude).astype(np.float32)
    values = rng.standard_normal((1, 2, positions, 128)).astype(np.float32)
    queries = (rng.standard_normal((1, 8, 1, 128)) / key_magnitude).astype(np.float32)
    scale = 128**-0.5
    expected = DenseRead(keys, values, None).attend(queries, scale).astype(np.float64)
    bound = kernel_attention_bound(queries, keys, values, scale)
    error = np.abs(_tf32_read(keys, values, queries, scale) - expected)
    assert np.all(error <= bound)


def _scaled_weights_read(read, fields, bits: int, queries: np.ndarray, scale: float, offset):
    """A NumPy model of READ-7's tensor-core read over affine values with scaled weights,
    step by step in the kernels' formats: float32 scores of the keys as decoded, softmax in
    base 2; B = each weight times its group's value scale, rounded to TF32; float32 sums of
    B (2^bits + code) and of p b - `offset` B (one rounding each, as the fused
    multiply-add); the output their sum over the weights' sum. `offset` 2^bits is the
    kernels' (the codes' own offset)."""
    *_, words, value_scales, value_biases = (np.asarray(f) for f in fields)
    B, Hq, _, D = queries.shape
    Hk = words.shape[1]
    codes = np_bits.unpack_words(words, bits, D).astype(np.float32)  # [B, Hk, T, D]
    per_group = D // value_scales.shape[-1]
    s = np.repeat(value_scales.astype(np.float32), per_group, axis=-1)
    b = np.repeat(value_biases.astype(np.float32), per_group, axis=-1)
    q = queries.astype(np.float64).reshape(B, Hk, Hq // Hk, D)
    scores = np.einsum("bhgd,bhtd->bhgt", q, read.keys.astype(np.float64)).astype(np.float32)
    factor = np.float32(scale) * np.float32(np.log2(np.e))
    scores = scores * factor
    p = np.exp2(scores - scores.max(axis=-1, keepdims=True)).astype(np.float32)
    # [B, Hk, G, T, D]: each position's weight times its element's group scale, in TF32.
    weights = _tf32(p[..., None] * s[:, :, None], truncate=False)
    products = (weights * (np.float32(2**bits) + codes[:, :, None])).sum(axis=-2, dtype=np.float32)
    bias_terms = (
        p[..., None].astype(np.float64) * b[:, :, None] - offset * weights.astype(np.float64)
    ).astype(np.float32)
    biases = bias_terms.sum(axis=-2, dtype=np.float32)
    out = (products + biases) / p.sum(axis=-1, dtype=np.float32)[..., None]
    return out.astype(np.float32).reshape(B, Hq, 1, D)


#: Value magnitudes by the values' format: its range's ends and its middle.
SCALED_MAGNITUDES = {"bfloat16": [1e-30, 1e-3, 1.0, 30.0, 1e30], "float16": [1e-3, 1.0, 300.0]}


def _scaled_values(rng: np.random.Generator, shape: tuple[int, ...], spread: str) -> np.ndarray:
    """Values of unit scale: "centred" on 0; "shifted", each row about a centre of its own
    (biases far from the codes' products, which then cancel them); or "nonnegative", in
    [0, 1), whose groups all take negative scales (AFF-3: the maximum is their edge)."""
    if spread == "nonnegative":
        return rng.uniform(0, 1, shape)
    centre = rng.standard_normal((*shape[:-1], 1)) * 3 if spread == "shifted" else 0.0
    return rng.standard_normal(shape) + centre


@pytest.mark.parametrize("dtype", sorted(SCALED_MAGNITUDES))
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    positions=st.integers(2, 120),
    layout=st.sampled_from([(4, 64), (2, 32), (8, 32), (4, 128)]),
    pick=st.integers(0, 4),
    spread=st.sampled_from(["centred", "shifted", "nonnegative"]),
)
def test_the_kernel_bound_holds_a_model_of_the_scaled_weights_and_tells_their_offset(
    dtype: str, seed: int, positions: int, layout: tuple[int, int], pick: int, spread: str
) -> None:
    """READ-7's kernel bound for scaled weights, and READ-1's, hold a NumPy model of their
    arithmetic over affine values of every scale and spread (`_scaled_values`); over
    nonnegative values a model that drops the codes' offset (2^bits B) leaves them. (Where
    scales of both signs meet, that fault's error, 2^bits times the weights' mean scale,
    may cancel below the bound.)"""
    bits, group_size = layout
    magnitudes = SCALED_MAGNITUDES[dtype]
    magnitude = magnitudes[pick % len(magnitudes)]
    rng = np.random.default_rng(seed)
    shape = (1, 2, positions, 128)
    keys = rng.standard_normal(shape).astype(FLOAT_DTYPES[dtype])
    values = (_scaled_values(rng, shape, spread) * magnitude).astype(FLOAT_DTYPES[dtype])
    cache = caches.QuantizedKVCache(group_size, bits)
    cache.append_window(keys[:, :, :-1], values[:, :, :-1])
    read = cache.append_decode(keys[:, :, -1:], values[:, :, -1:])
    queries = rng.standard_normal((1, 8, 1, 128)).astype(FLOAT_DTYPES[dtype])
    scale = 128**-0.5
    fields = cache.state().arrays
    expected = read.attend(queries, scale).astype(np.float64)
    bound = np.minimum(
        kernel_attention_bound(
            queries, read.keys, read.values, scale, value_groups=(fields[4], fields[5], bits)
        ),
        attention_bound(queries, read.keys, read.values, scale, KERNEL_ROUNDOFF),
    )
    modelled = _scaled_weights_read(read, fields, bits, queries, scale, 2.0**bits)
    assert np.all(np.abs(modelled - expected) <= bound)
    if spread == "nonnegative":
        dropped = _scaled_weights_read(read, fields, bits, queries, scale, 0.0)
        assert np.any(np.abs(dropped - expected) > bound)
