"""kvspec caches in mlx-lm's generation (kvspec.accelerated.mlx_lm), on small models built
from configs with random weights: a llama with full-attention layers, a llama alternating
sliding and full layers, and a gemma3-style text model. mlx-lm's own caches are the
oracle where they exist. Skipped where mlx-lm is not installed."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

from mlx_lm.generate import generate_step, maybe_quantize_kv_cache  # noqa: E402
from mlx_lm.models import base as mlx_lm_base  # noqa: E402
from mlx_lm.models import cache as mlx_lm_cache  # noqa: E402

from kvspec.accelerated import mlx_lm as adapter  # noqa: E402
from kvspec.accelerated.caches import AffineScheme  # noqa: E402
from kvspec.accelerated.dtypes import to_numpy  # noqa: E402
from kvspec.conformance.compare import assert_same_bits  # noqa: E402

LLAMA = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,  # tied random embeddings repeat one token
}
#: Window 16 < the prompt: the rings wrap during prefill and decode.
SLIDING_LLAMA = {
    **LLAMA,
    "layer_types": ["sliding_attention", "full_attention"],
    "sliding_window": 16,
}
GEMMA3 = {
    "model_type": "gemma3_text",
    "hidden_size": 128,
    "num_hidden_layers": 3,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 256,
    "sliding_window": 16,
    "sliding_window_pattern": 3,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 64,
    "rope_local_base_freq": 10000.0,
    "rope_global_base_freq": 1000000.0,
}
CONFIGS = {"llama": LLAMA, "sliding-llama": SLIDING_LLAMA, "gemma3": GEMMA3}

PROMPT = [(7 * i + 3) % 256 for i in range(40)]
#: Every scheme kind: plain, affine (growable and ring), per-layer widths, a start past
#: the prompt, both TurboQuant kernels.
SCHEMES = [
    "bf16",
    "affine:8:64",
    "affine:4:32:start=48",
    "affine-layers:0=4/64,1=8/32",
    "turbo:k8v8",
    "turbo:k8v4:deferred:start=48",
]


def build_model(config: dict):
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def model(request):
    return build_model(CONFIGS[request.param])


@pytest.fixture(scope="module")
def llama():
    return build_model(LLAMA)


@pytest.fixture(autouse=True)
def _quiet_turbo_sliding_warning():
    # SCHEME-3's once-per-process warning that turbo keeps sliding layers bf16.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "turbo KV scheme: sliding-window layers", UserWarning)
        yield


def greedy(model, prompt, cache, max_tokens, **kwargs):
    """Tokens and log-probabilities of mlx-lm's generate_step."""
    steps = list(
        generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache, **kwargs)
    )
    return [token for token, _ in steps], [logprobs for _, logprobs in steps]


def teacher_forced_logits(model, cache, tokens):
    """Last-position logits of a prefill of PROMPT, then one per decode of `tokens`."""
    rows = [model(mx.array(PROMPT)[None], cache=cache)[0, -1]]
    rows += [model(mx.array([[token]]), cache=cache)[0, -1] for token in tokens]
    # Reads come back in the model's dtype, TurboQuant's float32 reads included (TQC-2).
    assert {row.dtype for row in rows} == {mx.bfloat16}
    return mx.stack(rows).astype(mx.float32)


@pytest.mark.mlx_ops_reads
def test_bf16_generation_equals_mlx_lm(model) -> None:
    """bf16: greedy tokens over 64 steps and every log-probability equal mlx-lm's own
    caches (KVCache, RotatingKVCache) bit for bit, rings wrapping included."""
    theirs, their_logprobs = greedy(model, PROMPT, mlx_lm_cache.make_prompt_cache(model), 64)
    ours, our_logprobs = greedy(model, PROMPT, adapter.make_prompt_cache(model, "bf16"), 64)
    assert ours == theirs
    for step, (a, b) in enumerate(zip(our_logprobs, their_logprobs, strict=True)):
        assert_same_bits(to_numpy(a), to_numpy(b), f"step {step} logprobs")


#: At 8 bits per key and value, no teacher-forced logit moves by more than this fraction of
#: the spread (largest minus smallest) of the bf16 scheme's logits. Measured: 0.025 / 3.72
#: (llama), 0.028 / 3.62 (sliding llama), 0.395 / 8.02 (gemma3, whose affine 8-bit error
#: mlx-lm's own QuantizedKVCache matches) for affine:8:64; at most 0.047 for turbo:k8v8.
#: Two bits move them by 0.25 to 4.9, so the bound separates 8 bits from a broken read.
EIGHT_BIT_LOGIT_BOUND = 0.1


@pytest.mark.parametrize("scheme", ["affine:8:64", "turbo:k8v8"])
def test_eight_bit_logits_stay_near_bf16(model, scheme) -> None:
    """Teacher-forced over 32 decodes past the prompt, logits stay within
    EIGHT_BIT_LOGIT_BOUND of the bf16 scheme's spread, in the model's dtype."""
    tokens = [(5 * i + 1) % 256 for i in range(32)]
    reference = teacher_forced_logits(model, adapter.make_prompt_cache(model, "bf16"), tokens)
    cache = adapter.make_prompt_cache(model, scheme)
    logits = teacher_forced_logits(model, cache, tokens)
    error = mx.abs(logits - reference).max().item()
    spread = (reference.max(axis=-1) - reference.min(axis=-1)).max().item()
    assert 0 < error <= EIGHT_BIT_LOGIT_BOUND * spread
    stored = {layer.cache.signature() for layer in cache if layer.recipe.max_size is None}
    assert stored == {
        "kv:bf16-first:kv:" + ("affine:8:64" if scheme.startswith("affine") else "turboquant:8:8")
    }


@pytest.mark.parametrize("scheme", SCHEMES[1:])
def test_every_scheme_generates(model, scheme) -> None:
    """Every scheme runs mlx-lm's generate loop; quantized sliding-window layers convert."""
    cache = adapter.make_prompt_cache(model, scheme)
    tokens, _ = greedy(model, PROMPT, cache, 16)
    assert len(tokens) == 16
    assert all(layer.offset == len(PROMPT) + 16 for layer in cache)  # one step ahead
    signatures = {layer.cache.signature() for layer in cache}
    if scheme == "affine:8:64" and any(layer.recipe.max_size for layer in cache):
        assert any(s.startswith("kv:bf16-first:kv:rotating-affine:") for s in signatures)


def test_attention_never_sees_stored_fields(llama) -> None:
    """mlx-lm's attention picks its quantized path by `hasattr(cache, "bits")`: the adapter
    has no such field, and mlx-lm's own attention function is never called with it."""
    cache = adapter.make_prompt_cache(llama, "affine:4:64")
    assert not any(hasattr(layer, "bits") or hasattr(layer, "group_size") for layer in cache)
    calls = []
    original = adapter.attention._MLX_LM_ATTENTION

    def spy(*args, **kwargs):
        calls.append(kwargs.get("cache"))
        return original(*args, **kwargs)

    adapter.attention._MLX_LM_ATTENTION = spy
    try:
        greedy(llama, PROMPT, cache, 4)
        greedy(llama, PROMPT, mlx_lm_cache.make_prompt_cache(llama), 1)
    finally:
        adapter.attention._MLX_LM_ATTENTION = original
    assert calls and not any(isinstance(c, adapter.KvspecCache) for c in calls)
    assert (
        mlx_lm_base.scaled_dot_product_attention is adapter.attention.scaled_dot_product_attention
    )


def test_kv_bits_converts_like_mlx_lm(llama) -> None:
    """maybe_quantize_kv_cache (kv_bits) turns a plain layer into a kvspec affine cache
    whose stored fields equal mlx-lm's QuantizedKVCache (on MLX's CPU kernel, QKV-1), and
    which keeps speaking the protocol."""
    with mx.stream(mx.cpu):
        ours = adapter.make_prompt_cache(llama, "bf16")
        theirs = mlx_lm_cache.make_prompt_cache(llama)
        for cache in ours, theirs:
            llama(mx.array(PROMPT)[None], cache=cache)
            maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=32, kv_bits=4)
        for layer, (our, their) in enumerate(zip(ours, theirs, strict=True)):
            assert isinstance(our, adapter.KvspecCache)
            assert not hasattr(our, "to_quantized")
            assert our.cache.signature() == "kv:bf16-first:kv:affine:4:32"
            fields = our.cache.state().arrays
            for slot, field in enumerate((*their.keys, *their.values)):
                assert_same_bits(
                    to_numpy(fields[slot]),
                    to_numpy(field[:, :, : our.offset]),
                    f"layer {layer} slot {slot}",
                )
    tokens, _ = greedy(
        llama, PROMPT[:3], ours, 4, kv_bits=4, kv_group_size=32, quantized_kv_start=0
    )
    assert len(tokens) == 4


@pytest.mark.parametrize("config", ["sliding-llama", "gemma3"])
def test_kv_bits_quantizes_sliding_layers(config) -> None:
    """Where mlx-lm raises NotImplementedError for a RotatingKVCache, kv_bits gives a
    kvspec affine ring (QRING-2)."""
    model = build_model(CONFIGS[config])
    windows = adapter.layer_windows(model)
    with pytest.raises(NotImplementedError):
        greedy(
            model, PROMPT, mlx_lm_cache.make_prompt_cache(model), 2, kv_bits=8, quantized_kv_start=0
        )
    cache = adapter.make_prompt_cache(model, "bf16")
    greedy(model, PROMPT, cache, 2, kv_bits=8, quantized_kv_start=0)
    rings = [layer.cache.signature() for layer, w in zip(cache, windows, strict=True) if w]
    assert rings and all(s == "kv:bf16-first:kv:rotating-affine:16:0:8:64" for s in rings)


def test_prompt_reuse_equals_mlx_lm(llama) -> None:
    """Generate, trim the generated tokens and part of the prompt, regenerate from a new
    suffix: tokens equal doing the same with mlx-lm's caches (bf16)."""
    results = []
    for cache in mlx_lm_cache.make_prompt_cache(llama), adapter.make_prompt_cache(llama, "bf16"):
        first, _ = greedy(llama, PROMPT, cache, 12)
        assert mlx_lm_cache.can_trim_prompt_cache(cache)
        assert mlx_lm_cache.trim_prompt_cache(cache, 12 + 8) == 20
        assert cache[0].offset == len(PROMPT) - 8
        second, _ = greedy(llama, [9, 8, 7, 6, 5], cache, 12)
        results.append((first, second))
    assert results[0] == results[1]


@pytest.mark.parametrize("scheme", SCHEMES)
def test_saved_cache_continues_identically(model, scheme, tmp_path) -> None:
    """save_prompt_cache, load_prompt_cache: the loaded cache generates what the saved one
    goes on to generate, bit for bit; a start past the saved offset survives (B16F-6)."""
    cache = adapter.make_prompt_cache(model, scheme)
    greedy(model, PROMPT, cache, 2)
    path = str(tmp_path / "cache.safetensors")
    adapter.save_prompt_cache(path, cache, {"note": "kept"})
    loaded, metadata = adapter.load_prompt_cache(path, model, scheme, return_metadata=True)
    assert metadata == {"note": "kept"}
    assert_same_caches(loaded, cache)
    if "start=48" in scheme:
        assert any(layer.cache.signature() == "kv:bf16-first:kv" for layer in loaded)
    follow = [11, 12, 13]
    expected, expected_logprobs = greedy(model, follow, cache, 12)
    tokens, logprobs = greedy(model, follow, loaded, 12)
    assert tokens == expected
    for step, (a, b) in enumerate(zip(logprobs, expected_logprobs, strict=True)):
        assert_same_bits(to_numpy(a), to_numpy(b), f"step {step} logprobs")
    # Past the start now: the minimum reusable offset (B16F-4) survives too.
    adapter.save_prompt_cache(path, loaded)
    assert_same_caches(adapter.load_prompt_cache(path, model, scheme), loaded)


def assert_same_caches(restored_caches, saved_caches) -> None:
    """Same classes, recipes and CacheStates (CACHE-8), stored bits included."""
    for layer, (saved, restored) in enumerate(zip(saved_caches, restored_caches, strict=True)):
        assert type(restored) is type(saved)
        assert restored.recipe == saved.recipe
        ours, theirs = restored.cache.state(), saved.cache.state()
        assert (ours.signature, ours.offset, ours.ring_index, ours.minimum_reusable_offset) == (
            theirs.signature,
            theirs.offset,
            theirs.ring_index,
            theirs.minimum_reusable_offset,
        )
        for slot, (a, b) in enumerate(zip(ours.arrays, theirs.arrays, strict=True)):
            assert_same_bits(to_numpy(a), to_numpy(b), f"layer {layer} slot {slot}")


def test_mlx_lm_loads_kvspec_files(llama, tmp_path) -> None:
    """mlx-lm's own load_prompt_cache reads a file of kvspec caches."""
    cache = adapter.make_prompt_cache(llama, "turbo:k8v4")
    greedy(llama, PROMPT, cache, 2)
    path = str(tmp_path / "cache.safetensors")
    mlx_lm_cache.save_prompt_cache(path, cache)
    loaded = mlx_lm_cache.load_prompt_cache(path)
    assert [layer.cache.signature() for layer in loaded] == [
        layer.cache.signature() for layer in cache
    ]


def test_load_rejects_another_model_or_scheme(llama, tmp_path) -> None:
    """A file's layer count, windows and scheme are checked against the model and scheme."""
    path = str(tmp_path / "cache.safetensors")
    cache = adapter.make_prompt_cache(llama, "affine:4:64")
    greedy(llama, PROMPT, cache, 1)
    adapter.save_prompt_cache(path, cache)
    with pytest.raises(ValueError, match="holds 2 layer caches; the model has 3"):
        adapter.load_prompt_cache(path, build_model(GEMMA3))
    with pytest.raises(ValueError, match="layer 0: saved with window None, the model declares 16"):
        adapter.load_prompt_cache(path, build_model(SLIDING_LLAMA))
    with pytest.raises(ValueError, match="saved with scheme 'affine:4:64', expected 'affine:8:64'"):
        adapter.load_prompt_cache(path, llama, "affine:8:64")
    assert len(adapter.load_prompt_cache(path, llama, "affine:4:64:start=0")) == 2
    mlx_lm_cache.save_prompt_cache(path, mlx_lm_cache.make_prompt_cache(llama))
    with pytest.raises(ValueError, match="mlx-lm's KVCache, not a kvspec cache"):
        adapter.load_prompt_cache(path, llama, "bf16")


def test_decodes_use_decode_reads(llama) -> None:
    """One-position appends take the decode read (READ-2), the read the decode kernels
    serve; longer ones the window read (READ-3)."""
    cache = adapter.make_prompt_cache(llama, "turbo:k8v4")
    counts = {"append_decode": 0, "append_window": 0}
    for layer in cache:
        for name in counts:
            method = getattr(layer.cache, name)

            def counted(k, v, name=name, method=method):
                counts[name] += 1
                return method(k, v)

            setattr(layer.cache, name, counted)
    greedy(llama, PROMPT, cache, 8)
    assert counts == {"append_decode": 2 * 9, "append_window": 2}


def test_masks_follow_the_cache(model) -> None:
    """make_mask and size answer as mlx-lm's caches do (MASK-2, MASK-3), masks as arrays on
    request, and make_mask refuses a window the cache's reads would not apply."""
    ours = adapter.make_prompt_cache(model, "bf16")
    theirs = mlx_lm_cache.make_prompt_cache(model)
    for n in (len(PROMPT), 1, 1, 5):
        for our, their in zip(ours, theirs, strict=True):
            window = our.cache.sliding_window
            for return_array in (False, True):
                mine = our.make_mask(n, return_array=return_array, window_size=window)
                expected = their.make_mask(n, return_array=return_array, window_size=window)
                if isinstance(expected, mx.array):
                    assert_same_bits(to_numpy(mine), to_numpy(expected), f"n={n}")
                else:
                    assert mine == expected
            assert our.size() == their.size()
            with pytest.raises(ValueError, match="asks for an attention window of 3"):
                our.make_mask(n, window_size=3)
        k = mx.zeros((1, 2, n, 64), mx.bfloat16)
        for cache in ours, theirs:
            for layer in cache:
                layer.update_and_fetch(k, k)


def test_protocol_answers(llama) -> None:
    """size, empty, nbytes and trimming as mlx-lm's callers read them; bytes against bf16."""
    bf16 = adapter.make_prompt_cache(llama, "bf16")
    affine = adapter.make_prompt_cache(llama, "affine:4:64")
    assert all(layer.empty() and layer.nbytes == 0 and layer.size() == 0 for layer in bf16)
    for cache in bf16, affine:
        greedy(llama, PROMPT, cache, 4)
    for plain, packed in zip(bf16, affine, strict=True):
        assert not plain.empty() and plain.size() == plain.offset == len(PROMPT) + 4
        # 2 KV heads x (64 + 64) values x 2 bytes per position.
        assert plain.nbytes == plain.bf16_nbytes == plain.offset * 2 * 128 * 2
        # 4 bits per value and a bf16 scale and bias per 64 values: 4.5 / 16 of bf16.
        assert packed.nbytes * 16 == packed.bf16_nbytes * 4.5
    assert bf16[0].is_trimmable() and bf16[0].trim(100) == len(PROMPT) + 4
    assert bf16[0].offset == 0


def test_make_prompt_cache_rejects_what_it_cannot_compose(llama) -> None:
    with pytest.raises(ValueError, match="malformed KV scheme"):
        adapter.make_prompt_cache(llama, "affine:7:64")
    with pytest.raises(TypeError, match="short form"):
        adapter.make_prompt_cache(llama, AffineScheme(4, 64))
    with pytest.raises(ValueError, match=r"lists layers \[2, 5\]; the model has 2 layers"):
        adapter.make_prompt_cache(llama, "affine-layers:0=4/64,2=4/64,5=8/64")

    class Declares:
        def __init__(self, *caches):
            self.caches = caches

        def make_cache(self):
            return list(self.caches)

    with pytest.raises(ValueError, match="layer 1: the model's ArraysCache has no kvspec"):
        adapter.make_prompt_cache(Declares(mlx_lm_cache.KVCache(), mlx_lm_cache.ArraysCache(2)))
    with pytest.raises(ValueError, match="keeps 4 positions"):
        adapter.make_prompt_cache(Declares(mlx_lm_cache.RotatingKVCache(64, keep=4)))
    assert adapter.layer_windows(Declares(mlx_lm_cache.RotatingKVCache(64))) == [64]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, llama):
    """LLAMA saved as mlx-lm saves models, with a byte-level tokenizer built locally (one
    token per byte, no merges: the model's 256-token vocabulary) whose chat template puts
    each message in angle brackets, then a colon where a generation prompt is asked for."""
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("model")
    save_model(path, llama)
    save_config(dict(LLAMA), path / "config.json")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    chat_template = (
        "{% for message in messages %}<{{ message.content }}>{% endfor %}"
        "{% if add_generation_prompt %}:{% endif %}"
    )
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, chat_template=chat_template)
    wrapped.save_pretrained(path)
    return path


def test_command_generates_from_a_model_directory(model_dir) -> None:
    """python -m kvspec.accelerated.mlx_lm streams text, then speed and KV memory."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "kvspec.accelerated.mlx_lm", "--model", str(model_dir)]
    command += ["--kv-scheme", "turbo:k8v4", "--prompt", "hello world", "--max-tokens", "12"]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # "<hello world>:": the chat template's 14 bytes, its generation prompt included.
    assert lines[-2].startswith("prompt: 14 tokens, ")
    assert "; generation: 12 tokens, " in lines[-2] and lines[-2].endswith(" tokens/s")
    # 26 positions x 2 layers x 2 KV heads x 64 keys and 64 values: 26624 bytes in bf16;
    # TurboQuant k8v4 stores (8 + 1) + (4 + 0.5) bits per key and value pair of 32 bits.
    assert lines[-1] == "KV memory (turbo:k8v4): 11232 bytes, 0.422 of bf16's 26624"


def test_command_takes_the_prompt_raw_on_request(model_dir, capsys) -> None:
    from kvspec.accelerated.mlx_lm.__main__ import main

    argv = ["--model", str(model_dir), "--prompt", "hello world", "--max-tokens", "3"]
    assert main([*argv, "--ignore-chat-template"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("prompt: 11 tokens, ")
    # 14 positions x 2 layers x 2 KV heads x 128 values x 2 bytes.
    assert lines[-1] == "KV memory (bf16): 14336 bytes, 1.000 of bf16's 14336"


def test_command_rejects_bad_arguments(model_dir, tmp_path, capsys) -> None:
    from kvspec.accelerated.mlx_lm.__main__ import main, parse_args

    model = ["--model", str(model_dir)]
    cases = [
        ([*model, "--prompt", "hi", "--kv-scheme", "turbo:k9v4"], "key bits must be one of"),
        ([*model, "--prompt", "hi", "--max-tokens", "0"], "--max-tokens must be at least 1"),
        (["--prompt", "hi"], "the following arguments are required: --model"),
        (model, "the following arguments are required: --prompt"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
    assert parse_args([*model, "--prompt", "hi", "--max-tokens", "1"]).max_tokens == 1
    with pytest.raises(SystemExit):
        main(["--model", str(tmp_path), "--prompt", "hi"])
    assert "is not a model directory (no config.json)" in capsys.readouterr().err


def test_lru_prompt_cache_reuses_kvspec_caches(llama) -> None:
    """mlx-lm's LRUPromptCache (its server's prompt reuse: nbytes, deep copies, trimming)
    holds kvspec caches; a fetched, trimmed copy continues as mlx-lm's own caches do."""
    results = []
    for make in mlx_lm_cache.make_prompt_cache, adapter.make_prompt_cache:
        cache = make(llama)
        generated, _ = greedy(llama, PROMPT, cache, 6)
        store = mlx_lm_cache.LRUPromptCache()
        store.insert_cache("llama", PROMPT + generated, cache)
        assert store.nbytes > 0
        reused, rest = store.fetch_nearest_cache("llama", [*PROMPT[:30], 1, 2, 3])
        assert rest == [1, 2, 3] and reused[0].offset == 30 and cache[0].offset == 46
        results.append(greedy(llama, rest, reused, 8)[0])
    assert results[0] == results[1]


@pytest.mark.mlx_ops_reads
def test_generate_with_a_tokenizer(model_dir, llama) -> None:
    """mlx_lm.generate with the bf16 scheme returns mlx-lm's own text."""
    from mlx_lm import generate
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    texts = [
        generate(llama, tokenizer, "hello world", max_tokens=16, prompt_cache=cache)
        for cache in (mlx_lm_cache.make_prompt_cache(llama), adapter.make_prompt_cache(llama))
    ]
    assert texts[0] == texts[1] and texts[0]


@pytest.mark.parametrize("separate_meta_state", [False, True])
def test_from_state_as_each_mlx_lm_version_calls_it(separate_meta_state, monkeypatch) -> None:
    """from_state restores what state (and meta_state) gave, in mlx-lm 0.32's form (scalars
    inside `state`) and 0.31's (array-only `state`, then string `meta_state`)."""
    from kvspec.accelerated.mlx_lm import cache as adapter_cache

    monkeypatch.setattr(adapter_cache, "SEPARATE_META_STATE", separate_meta_state)
    model = build_model(SLIDING_LLAMA)
    cache = adapter.make_prompt_cache(model, "affine:4:32:start=48")
    greedy(model, PROMPT, cache, 12)
    arrays_only = all(isinstance(part, mx.array) for layer in cache for part in layer.state)
    assert arrays_only == separate_meta_state
    if separate_meta_state:
        restored = [type(c).from_state(c.state, c.meta_state) for c in cache]
    else:
        restored = [type(c).from_state(list(c.state)) for c in cache]
    assert_same_caches(restored, cache)
    # A restored layer is one row, as mlx-lm's own caches are: its offset an int.
    assert [c.offset for c in restored] == [c.offset for c in cache]
    assert all(type(c.offset) is int for c in restored)


def test_speculative_decoding_equals_mlx_lm(llama) -> None:
    """speculative_generate_step (multi-position verification, then trimming the rejected
    drafts) with the bf16 scheme equals mlx-lm's own caches: tokens, which came from the
    draft, and log-probabilities bit for bit."""
    from mlx.utils import tree_flatten
    from mlx_lm.generate import speculative_generate_step

    # The main model without its second layer: it agrees on some drafts, not all, so
    # rejected drafts are trimmed.
    draft = build_model({**LLAMA, "num_hidden_layers": 1})
    weights = tree_flatten(llama.parameters())
    draft.load_weights([(k, v) for k, v in weights if not k.startswith("model.layers.1.")])
    runs = []
    for make in mlx_lm_cache.make_prompt_cache, adapter.make_prompt_cache:
        steps = speculative_generate_step(
            mx.array(PROMPT),
            llama,
            draft,
            prompt_cache=make(llama) + make(draft),
            max_tokens=24,
            num_draft_tokens=3,
        )
        runs.append(list(steps))
    theirs, ours = runs
    assert [(t, d) for t, _, d in ours] == [(t, d) for t, _, d in theirs]
    assert {from_draft for _, _, from_draft in ours} == {False, True}
    for step, ((_, a, _), (_, b, _)) in enumerate(zip(ours, theirs, strict=True)):
        assert_same_bits(to_numpy(a), to_numpy(b), f"step {step} logprobs")


def test_layer_kinds_from_args() -> None:
    """Without make_cache, `layer_types` and `sliding_window` in the args name the kinds."""
    from types import SimpleNamespace

    args = SimpleNamespace(layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    declared = SimpleNamespace(args=args, layers=[None, None])
    assert adapter.layer_windows(declared) == [8, None]
    assert adapter.layer_windows(SimpleNamespace(layers=[None] * 3)) == [None] * 3
    cache = adapter.make_prompt_cache(declared, "affine:4:64")
    assert [layer.cache.sliding_window for layer in cache] == [8, None]


def test_routed_attention_refuses_what_reads_cannot_do() -> None:
    """A decode read sees every key its cache holds (READ-2): a mask there means a window
    the cache does not apply. Attention sinks have no kvspec read."""
    from kvspec.accelerated.mlx_lm.attention import scaled_dot_product_attention

    (layer,) = adapter.make_prompt_cache(type("OneLayer", (), {"layers": [None]})(), "bf16")
    k = mx.zeros((1, 2, 1, 64), mx.bfloat16)
    keys, values = layer.update_and_fetch(k, k)
    queries = mx.zeros((1, 4, 1, 64), mx.bfloat16)
    with pytest.raises(ValueError, match="the model passed a mask"):
        scaled_dot_product_attention(queries, keys, values, layer, 0.125, mx.array([True]))
    with pytest.raises(ValueError, match="attention sinks"):
        scaled_dot_product_attention(queries, keys, values, layer, 0.125, None, mx.zeros((4,)))
    output = scaled_dot_product_attention(queries, keys, values, layer, 0.125, None)
    assert output.shape == (1, 4, 1, 64)


def test_attention_of_other_keys_is_mlx_lms(monkeypatch) -> None:
    """Keys that are not a kvspec read (a layer of mlx-lm's own cache) attend through
    mlx-lm's own function, sinks included; routing reaches mlx-lm's model modules that use
    its function, and no other module or function."""
    import types

    from kvspec.accelerated.mlx_lm import attention

    mlx_lms = attention._MLX_LM_ATTENTION
    queries, keys = mx.random.normal((1, 4, 3, 64)), mx.random.normal((1, 2, 3, 64))
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    for extra in ({}, {"sinks": sinks}):
        got = attention.scaled_dot_product_attention(
            queries, keys, keys, None, 0.125, "causal", **extra
        )
        expected = mlx_lms(queries, keys, keys, cache=None, scale=0.125, mask="causal", **extra)
        assert_same_bits(to_numpy(got), to_numpy(expected), str(extra))

    def own_attention(*args, **kwargs):
        raise AssertionError("a model's own attention")

    modules = {
        "mlx_lm.models.kvspec_late": mlx_lms,
        "mlx_lm.models.kvspec_own": own_attention,
        "kvspec_elsewhere": mlx_lms,
    }
    for name, function in modules.items():
        module = types.ModuleType(name)
        module.scaled_dot_product_attention = function
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(attention.base, "scaled_dot_product_attention", mlx_lms)
    attention.route_attention()
    routed = attention.scaled_dot_product_attention
    assert attention.base.scaled_dot_product_attention is routed
    assert sys.modules["mlx_lm.models.kvspec_late"].scaled_dot_product_attention is routed
    assert sys.modules["mlx_lm.models.kvspec_own"].scaled_dot_product_attention is own_attention
    assert sys.modules["kvspec_elsewhere"].scaled_dot_product_attention is mlx_lms


def test_server_command_gives_the_loaded_model_kvspec_caches(model_dir, monkeypatch) -> None:
    """python -m kvspec.accelerated.mlx_lm.server: mlx-lm's server main, its provider's
    models given the scheme's caches (`use_scheme`), so every request's caches, batched or
    not, are kvspec's; the server still finds them batchable."""
    from mlx_lm import server
    from mlx_lm.models.cache import make_prompt_cache as mlx_lm_make_prompt_cache

    from kvspec.accelerated.mlx_lm import KvspecCache
    from kvspec.accelerated.mlx_lm import server as kvspec_server

    providers = []
    monkeypatch.setattr(server, "run", lambda host, port, provider: providers.append(provider))
    monkeypatch.setattr(server, "ModelProvider", server.ModelProvider)
    monkeypatch.setattr(sys, "argv", sys.argv)
    with pytest.raises(SystemExit) as exit_info:
        kvspec_server.main(["--model", str(model_dir)])
    assert exit_info.value.code == 2 and not providers
    kvspec_server.main(["--kv-scheme", "affine:8:64", "--model", str(model_dir)])
    (provider,) = providers
    model, _ = provider.load("default_model")
    made = mlx_lm_make_prompt_cache(model)
    assert all(isinstance(cache, KvspecCache) for cache in made)
    assert {cache.recipe.scheme for cache in made} == {"affine:8:64"}
    assert provider.is_batchable
