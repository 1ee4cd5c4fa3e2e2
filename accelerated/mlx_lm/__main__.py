"""Generate from a local mlx-lm model directory with a kvspec KV storage scheme.

python -m kvspec.accelerated.mlx_lm --model DIR --kv-scheme SCHEME --prompt TEXT
    [--max-tokens N]

Prints the text as it streams, then prompt and generation tokens per second and the KV
memory held against the same positions in bfloat16.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvspec.accelerated import caches


def scheme_argument(text: str) -> str:
    """A --kv-scheme value, checked (SCHEME-2)."""
    try:
        caches.parse_scheme(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def _model_dir(text: str) -> Path:
    path = Path(text)
    if not (path / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a model directory (no config.json)")
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvspec.accelerated.mlx_lm", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", required=True, type=_model_dir, help="local model directory")
    parser.add_argument(
        "--kv-scheme",
        default="bf16",
        type=scheme_argument,
        help="KV storage scheme (spec SCHEME-2), e.g. bf16, affine:4:64, turbo:k8v4:start=256",
    )
    parser.add_argument("--prompt", required=True, help="the prompt text")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate")
    parser.add_argument(
        "--ignore-chat-template", action="store_true", help="use the prompt as raw text"
    )
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error(f"--max-tokens must be at least 1, got {args.max_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # Imported after parsing: a bad argument is answered before transformers loads.
    from mlx_lm import load, stream_generate

    from kvspec.accelerated.mlx_lm import make_prompt_cache

    model, tokenizer = load(str(args.model))
    prompt = args.prompt
    if tokenizer.has_chat_template and not args.ignore_chat_template:
        messages = [{"role": "user", "content": args.prompt}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    cache = make_prompt_cache(model, args.kv_scheme)
    response = None
    for response in stream_generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, prompt_cache=cache
    ):
        print(response.text, end="", flush=True)
    print()
    assert response is not None
    held = sum(layer.nbytes for layer in cache)
    bf16 = sum(layer.bf16_nbytes for layer in cache)
    print(
        f"prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.1f} tokens/s; "
        f"generation: {response.generation_tokens} tokens, {response.generation_tps:.1f} tokens/s"
    )
    print(
        f"KV memory ({args.kv_scheme}): {held} bytes, {held / bf16:.3f} of bf16's {bf16}"
        if bf16
        else f"KV memory ({args.kv_scheme}): {held} bytes"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
