"""kvspec caches in mlx-lm's batched generation (`BatchGenerator`, `batch_generate`) through
the adapter's batch protocol on rows of their own lengths (ROWS-5 .. ROWS-11), on the small
random-weight models of test_mlx_lm_adapter. mlx-lm's own batch caches are the oracle for
bf16; for the other schemes, each prompt generated alone with the same scheme. Skipped where
mlx-lm is not installed."""

from __future__ import annotations

import warnings

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.generate import BatchGenerator, batch_generate  # noqa: E402
from mlx_lm.models import cache as mlx_lm_cache  # noqa: E402

from kvspec.accelerated.dtypes import to_numpy  # noqa: E402
from kvspec.accelerated.mlx_lm import KvspecCache, make_prompt_cache  # noqa: E402
from kvspec.conformance.compare import assert_same_bits  # noqa: E402
from kvspec.conformance.test_mlx_lm_adapter import (  # noqa: E402
    CONFIGS,
    build_model,
    model_dir,  # noqa: F401 (the fixture)
)

#: Different lengths (one of a single token: its cache holds nothing when it joins the
#: decode batch) and different max_tokens, so rows finish at different steps (filter).
PROMPTS = [[(7 * i + 3 + row) % 256 for i in range(n)] for row, n in enumerate([40, 23, 1, 31])]
MAX_TOKENS = [12, 5, 9, 12]
#: Prompts inserted while the first ones decode (extend).
LATE = [[5, 9, 11, 200, 3], [17]]
LATE_MAX_TOKENS = [6, 4]
#: Schemes without a start: every row stores and reads what it would alone.
SCHEMES = ["affine:8:64", "affine:4:32", "affine-layers:0=4/64,1=8/32", "turbo:k8v8"]


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return build_model(CONFIGS[request.param])


@pytest.fixture(scope="module")
def llama():
    return build_model(CONFIGS["llama"])


@pytest.fixture(autouse=True)
def _quiet_turbo_sliding_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "turbo KV scheme: sliding-window layers", UserWarning)
        yield


def generate_batched(
    model, prompts, max_tokens, scheme=None, late=(), late_max_tokens=(), **kwargs
):
    """Tokens and log-probabilities per prompt from mlx-lm's BatchGenerator: kvspec caches
    of `scheme` (mlx-lm's own batch caches for None); `late` prompts are inserted after
    three steps, while the first ones decode."""

    def caches_for(count):
        return None if scheme is None else [make_prompt_cache(model, scheme) for _ in range(count)]

    generator = BatchGenerator(model, max_tokens=max(max_tokens), **kwargs)
    uids = generator.insert(prompts, max_tokens, caches=caches_for(len(prompts)))
    tokens = {uid: [] for uid in uids}
    logprobs = {uid: [] for uid in uids}
    steps = 0
    while True:
        responses = generator.next_generated()
        steps += 1
        if steps == 3 and late:
            joined = generator.insert(late, late_max_tokens, caches=caches_for(len(late)))
            uids += joined
            tokens.update({uid: [] for uid in joined})
            logprobs.update({uid: [] for uid in joined})
        if not responses and steps > 3:
            break
        for response in responses:
            tokens[response.uid].append(response.token)
            logprobs[response.uid].append(response.logprobs)
    generator.close()
    return [tokens[uid] for uid in uids], [logprobs[uid] for uid in uids]


@pytest.mark.mlx_ops_reads
@pytest.mark.parametrize("prefill_step_size", [2048, 8])
def test_bf16_batch_equals_mlx_lm(model, prefill_step_size) -> None:
    """bf16: every token and log-probability of every sequence equals mlx-lm's own batch
    caches, bit for bit: prompts of different lengths (right padded chunks, ROWS-9's left
    padding after them), prompts longer than a prefill step (chunks after history), rows
    finishing at different steps (filter, ROWS-8) and prompts joining mid-decode (extend)."""
    args = (model, PROMPTS, MAX_TOKENS)
    late = {"late": LATE, "late_max_tokens": LATE_MAX_TOKENS}
    expected = generate_batched(*args, prefill_step_size=prefill_step_size, **late)
    got = generate_batched(*args, "bf16", prefill_step_size=prefill_step_size, **late)
    assert got[0] == expected[0]
    assert [len(tokens) for tokens in got[0]] == MAX_TOKENS + LATE_MAX_TOKENS
    for sequence, (got_rows, expected_rows) in enumerate(zip(got[1], expected[1], strict=True)):
        for step, (got_row, expected_row) in enumerate(zip(got_rows, expected_rows, strict=True)):
            assert_same_bits(
                to_numpy(got_row), to_numpy(expected_row), f"sequence {sequence} step {step}"
            )


@pytest.mark.parametrize("scheme", SCHEMES)
def test_every_row_generates_as_alone(model, scheme) -> None:
    """Compressed schemes without a start: each sequence's tokens equal the same scheme
    generating its prompt alone (CACHE-4: rows encode on their own; ROWS-6: padded reads
    hide the padding), prompts joining mid-decode included, over several prefill chunks."""
    batched, _ = generate_batched(
        model,
        PROMPTS,
        MAX_TOKENS,
        scheme,
        late=LATE,
        late_max_tokens=LATE_MAX_TOKENS,
        prefill_step_size=8,
    )
    for prompt, max_tokens, tokens in zip(
        PROMPTS + LATE, MAX_TOKENS + LATE_MAX_TOKENS, batched, strict=True
    ):
        alone, _ = generate_batched(model, [prompt], [max_tokens], scheme, prefill_step_size=8)
        assert tokens == alone[0], prompt


@pytest.mark.parametrize("scheme", ["affine:8:64:start={}", "turbo:k8v8:start={}"])
def test_bf16_first_batch_switches_as_one(llama, scheme) -> None:
    """A bf16-first batch switches as one when its longest row reaches the start (ROWS-7):
    a row padded by p switches p positions early, so it generates what its prompt does
    alone with start - p. A row joining after the switch switches as it joins, at its own
    length n: what it generates alone with start n."""
    start = 34
    prompts = [PROMPTS[0][:30], PROMPTS[1][:20], PROMPTS[3][:26]]
    late = [5, 9, 11]
    generator = BatchGenerator(llama, max_tokens=10)
    uids = generator.insert(
        prompts, caches=[make_prompt_cache(llama, scheme.format(start)) for _ in prompts]
    )
    tokens = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        if len(tokens[uids[0]]) == 6:  # the batch switched at 34 positions, 4 decodes in
            late_uid = generator.insert(
                [late], [6], caches=[make_prompt_cache(llama, scheme.format(start))]
            )[0]
            uids.append(late_uid)
            tokens[late_uid] = []
        for response in responses:
            tokens[response.uid].append(response.token)
    generator.close()
    for prompt, uid in zip(prompts, uids, strict=False):
        padding = 30 - len(prompt)
        alone, _ = generate_batched(llama, [prompt], [10], scheme.format(start - padding))
        assert tokens[uid] == alone[0], len(prompt)
    alone, _ = generate_batched(llama, [late], [6], scheme.format(len(late)))
    assert tokens[uids[3]] == alone[0]


def test_bf16_first_rows_join_switched_as_one(llama) -> None:
    """ROWS-7 at the join itself: rows none of which switched join as bf16; where one has
    switched, each other row switches as it joins, at its own length, storing what it
    stores alone with a start of that length."""
    from kvspec.accelerated.rows import extract_row

    def first_layer(length: int, start: int):
        cache = make_prompt_cache(llama, f"affine:8:64:start={start}")
        llama(mx.array(PROMPTS[0][:length])[None], cache=cache)
        return cache[0]

    unswitched = KvspecCache.merge([first_layer(30, 34), first_layer(20, 34)])
    assert not unswitched.cache.converted
    mixed = KvspecCache.merge([first_layer(40, 34), first_layer(20, 34)])
    assert mixed.cache.converted
    alone = first_layer(20, 20).cache
    assert alone.converted
    joined = extract_row(mixed.cache, 1)
    assert joined.offset == alone.offset == 20
    for slot, (a, b) in enumerate(zip(joined.state().arrays, alone.state().arrays, strict=True)):
        assert_same_bits(to_numpy(a), to_numpy(b), f"slot {slot}")


@pytest.mark.mlx_ops_reads
def test_batch_generate_with_histories_equals_mlx_lm(llama, model_dir) -> None:  # noqa: F811
    """bf16: `batch_generate` with prompt caches that already hold a prefix beside fresh
    ones (rows holding positions merged with rows holding none) gives mlx-lm's own text,
    and each returned prompt cache (extract, ROWS-8) holds mlx-lm's keys and values bit for
    bit and continues as mlx-lm's continues."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    prefix, prompts = PROMPTS[0][:17], [PROMPTS[0][17:], PROMPTS[1], PROMPTS[3][:6]]

    def run(make_cache):
        caches = [make_cache(llama) for _ in prompts]
        llama(mx.array(prefix)[None], cache=caches[0])
        return batch_generate(
            llama,
            tokenizer,
            prompts,
            prompt_caches=caches,
            max_tokens=[7, 4, 9],
            return_prompt_caches=True,
            return_token_ids=True,
        )

    expected = run(mlx_lm_cache.make_prompt_cache)
    got = run(make_prompt_cache)
    assert got.token_ids == expected.token_ids and got.texts == expected.texts
    for got_caches, expected_caches in zip(got.caches, expected.caches, strict=True):
        for layer, (ours, theirs) in enumerate(zip(got_caches, expected_caches, strict=True)):
            assert isinstance(ours, KvspecCache) and not ours.batched
            assert ours.offset == theirs.offset
            for name, a, b in zip(
                ("keys", "values"), ours.cache.state().arrays, theirs.state[:2], strict=True
            ):
                assert_same_bits(to_numpy(a), to_numpy(b), f"layer {layer} {name}")
        continued = [
            [
                token
                for token, _ in generate_step(
                    mx.array([3, 1, 4]), llama, max_tokens=5, prompt_cache=c
                )
            ]
            for c in (got_caches, expected_caches)
        ]
        assert continued[0] == continued[1]


def test_batch_offsets_are_per_row(llama) -> None:
    """A merged batch gives the model's RoPE one offset per row (ROWS-5's row offsets, as
    mlx-lm's batch caches do); a row taken out gives one integer again."""
    caches = [make_prompt_cache(llama, "affine:8:64") for _ in range(3)]
    for length, cache in zip([5, 9, 2], caches, strict=True):
        llama(mx.array(PROMPTS[0][:length])[None], cache=cache)
    merged = [
        type(layer).merge([cache[i] for cache in caches]) for i, layer in enumerate(caches[0])
    ]
    assert merged[0].offset.tolist() == [5, 9, 2]
    assert merged[0].cache.left_padding == (4, 0, 7)
    # nbytes (mlx-lm's prompt_cache_nbytes) counts the padded buffer: 3 rows of 9 positions.
    assert merged[0].nbytes * (5 + 9 + 2) == sum(cache[0].nbytes for cache in caches) * 3 * 9
    merged[0].filter([2, 0])
    assert merged[0].offset.tolist() == [2, 5] and merged[0].cache.left_padding == (3, 0)
    assert merged[1].extract(1).offset == 9
    # kv_bits converts a batch of plain layers to a batch: RoPE still gets each row's offset.
    plain = [make_prompt_cache(llama)[0] for _ in range(2)]
    for length, cache in zip([3, 8], plain, strict=True):
        cache.update_and_fetch(*[mx.zeros((1, 2, length, 64), mx.bfloat16)] * 2)
    quantized = type(plain[0]).merge(plain).to_quantized(group_size=64, bits=8)
    assert quantized.offset.tolist() == [3, 8] and quantized.cache.left_padding == (5, 0)


@pytest.mark.mlx_ops_reads
def test_batch_left_padding_equals_mlx_lm(llama) -> None:
    """`prepare(left_padding=...)` (ROWS-11) of a fresh batch, then a left-padded prompt:
    every row's logits at its own positions equal mlx-lm's BatchKVCache's bit for bit."""
    prompts = [PROMPTS[0][:6], PROMPTS[1][:3]]
    padding = [0, 3]
    tokens = mx.array([[0] * pad + prompt for pad, prompt in zip(padding, prompts, strict=True)])
    theirs = [mlx_lm_cache.BatchKVCache(padding) for _ in llama.layers]
    ours = [
        type(layer).merge([layer, make_prompt_cache(llama)[i]])
        for i, layer in enumerate(make_prompt_cache(llama))
    ]
    for layer in ours:
        layer.prepare(left_padding=padding)
    expected, got = llama(tokens, cache=theirs), llama(tokens, cache=ours)
    for row, pad in enumerate(padding):
        assert_same_bits(to_numpy(got[row, pad:]), to_numpy(expected[row, pad:]), f"row {row}")
    step = mx.array([[7], [9]])
    assert_same_bits(
        to_numpy(llama(step, cache=ours)), to_numpy(llama(step, cache=theirs)), "decode"
    )


def test_right_padding_of_none_appends_the_batch_as_one(llama) -> None:
    """`prepare(right_padding=...)` of zeros, as mlx-lm's BatchGenerator gives prompts of
    one length, pads nothing: the append reads the batch at once. Only a padded row makes
    the rows append alone, each without its padding."""
    from kvspec.accelerated.mlx_lm.attention import PendingAttention
    from kvspec.accelerated.mlx_lm.batch import RowsAttention

    keys = mx.zeros((2, 2, 4, 64), mx.bfloat16)
    for padding, read_kind in (([0, 0], PendingAttention), ([1, 0], RowsAttention)):
        layers = [make_prompt_cache(llama, "affine:8:64")[0] for _ in range(2)]
        batch = type(layers[0]).merge(layers)
        batch.update_and_fetch(keys, keys)  # the merged rows joined
        batch.prepare(right_padding=padding, lengths=[4 - count for count in padding])
        read, _ = batch.update_and_fetch(keys, keys)
        assert type(read) is read_kind, padding
        assert batch.offset.tolist() == [8 - count for count in padding]


def test_batch_refusals(llama) -> None:
    """What a kvspec batch cannot do is refused with the reason, the caches unchanged."""
    bf16, affine = make_prompt_cache(llama), make_prompt_cache(llama, "affine:8:64")
    with pytest.raises(ValueError, match="one recipe"):
        type(bf16[0]).merge([bf16[0], affine[0]])
    with pytest.raises(ValueError, match="one recipe"):
        type(bf16[0]).merge([bf16[0], mlx_lm_cache.KVCache()])
    llama(mx.array(PROMPTS[0][:4])[None], cache=bf16)
    merged = type(bf16[0]).merge([bf16[0], bf16[0]])
    with pytest.raises(ValueError, match="holding nothing"):
        merged.prepare(left_padding=[1, 0])
    fresh = type(affine[0]).merge([affine[0], make_prompt_cache(llama, "affine:8:64")[0]])
    with pytest.raises(ValueError, match="no state of one cache"):
        fresh.state  # noqa: B018
    with pytest.raises(ValueError, match="an append of 3 rows to a batch of 2"):
        fresh.update_and_fetch(mx.zeros((3, 2, 4, 64)), mx.zeros((3, 2, 4, 64)))
    assert not fresh.is_trimmable() and fresh.trim(3) == 0
    # A fresh row taken out is a cache of its own: appending to it leaves the batch's alone.
    fresh.extract(0).update_and_fetch(*[mx.zeros((1, 2, 4, 64), mx.bfloat16)] * 2)
    assert fresh.offset.tolist() == [0, 0]
    fresh.prepare(left_padding=[2, 0])
    with pytest.raises(ValueError, match="takes its first append"):
        fresh.filter([1])
    with pytest.raises(ValueError, match="takes its first append"):
        fresh.extract(0)


def test_use_scheme_gives_mlx_lms_own_paths_kvspec_caches() -> None:
    """`use_scheme`: mlx-lm's `make_prompt_cache(model)` (what BatchGenerator, batch_generate
    and mlx_lm.server call when given no caches) builds the scheme's kvspec caches, each
    layer keeping the window the model declared, and a batch generated without caches
    equals one given the caches explicitly; the server's batchability test holds."""
    from kvspec.accelerated.mlx_lm import use_scheme

    for name in ("llama", "sliding-llama"):
        model = build_model(CONFIGS[name])
        windows = [getattr(c, "max_size", None) for c in mlx_lm_cache.make_prompt_cache(model)]
        expected = generate_batched(model, PROMPTS[:2], MAX_TOKENS[:2], "affine:8:64")
        use_scheme(model, "affine:8:64")
        made = mlx_lm_cache.make_prompt_cache(model)
        assert all(isinstance(c, KvspecCache) and hasattr(c, "merge") for c in made)
        assert [c.recipe.max_size for c in made] == windows
        assert {c.recipe.scheme for c in made} == {"affine:8:64"}
        assert generate_batched(model, PROMPTS[:2], MAX_TOKENS[:2])[0] == expected[0]
        # Another scheme later reads the windows from the kvspec caches it made.
        use_scheme(model, "bf16")
        assert [c.recipe.max_size for c in mlx_lm_cache.make_prompt_cache(model)] == windows
