"""mlx-lm's HTTP server on kvspec caches: every model it loads is given `use_scheme`.

python -m kvspec.accelerated.mlx_lm.server --kv-scheme SCHEME [mlx_lm.server's options]

Every other option is mlx-lm's (`python -m mlx_lm.server --help`). The server then builds
each request's caches, batched or not, with the scheme.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any

from mlx_lm import server

from kvspec.accelerated.mlx_lm.__main__ import scheme_argument
from kvspec.accelerated.mlx_lm.prompt_cache import use_scheme


class KvspecModelProvider(server.ModelProvider):
    """mlx-lm's model provider, each model it loads given kvspec caches by `scheme`."""

    def __init__(self, cli_args: argparse.Namespace, scheme: str) -> None:
        self.scheme = scheme
        super().__init__(cli_args)

    def load(self, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        model, tokenizer = super().load(*args, **kwargs)
        if getattr(model, "kvspec_scheme", None) != self.scheme:
            use_scheme(model, self.scheme)
            model.kvspec_scheme = self.scheme
        return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvspec.accelerated.mlx_lm.server",
        description=__doc__.splitlines()[0],
        epilog="Every other option is mlx_lm.server's: python -m mlx_lm.server --help",
    )
    parser.add_argument(
        "--kv-scheme",
        required=True,
        type=scheme_argument,
        help="KV storage scheme (spec SCHEME-2), e.g. bf16, affine:4:64, turbo:k8v4:start=256",
    )
    args, rest = parser.parse_known_args(argv)
    # mlx-lm's main makes its provider by this name and parses sys.argv itself.
    server.ModelProvider = functools.partial(KvspecModelProvider, scheme=args.kv_scheme)
    sys.argv = [parser.prog, *rest]
    server.main()


if __name__ == "__main__":
    main()
