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

from mlx_lm.generate import BatchGenerator  # noqa: E402

from kvspec.accelerated.dtypes import to_numpy  # noqa: E402
from kvspec.accelerated.mlx_lm import make_prompt_cache  # noqa: E402
from kvspec.conformance.compare import assert_same_bits  # noqa: E402
from kvspec.conformance.test_mlx_lm_adapter import CONFIGS, build_model  # noqa: E402

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
