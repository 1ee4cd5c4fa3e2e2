"""The MLX backend's CUDA sources are handed to MLX compacted (`accelerated/cuda_source.py`):
comments and indentation go, every token stays. These run on any device: the sources are
text."""

from __future__ import annotations

import re

import pytest

from kvspec.conformance.backend import Backend


def _sources() -> dict[str, str]:
    from kvspec.accelerated import affine_kernels, attention_kernels, turboquant_kernels

    sources = {
        "attention header": attention_kernels._HEADER,
        "attention CUDA-core header": attention_kernels._CORE_HEADER,
        "attention tensor-core header": attention_kernels._MMA_HEADER,
        "attention merge": attention_kernels._MERGE_SOURCE,
        "turboquant header": turboquant_kernels._HEADER,
        "turboquant decode": turboquant_kernels._SOURCE,
        "turboquant encode": turboquant_kernels._ENCODE_SOURCE,
        "affine encode": affine_kernels._SOURCE,
    }
    for mma, source in attention_kernels._PARTIAL_SOURCES.items():
        sources[f"attention pass 1, tensor cores {mma}"] = source
    return sources


def _tokens(source: str) -> list[str]:
    without_comments = re.sub(r"//[^\n]*", "", source)
    return re.findall(r"\w+|[^\w\s]", without_comments)


def test_compacting_keeps_every_token_and_every_line_break_a_directive_needs(
    backend: Backend,
) -> None:
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's CUDA sources")
    from kvspec.accelerated.cuda_source import compact

    for name, source in _sources().items():
        # What compact cannot keep apart: a comment marker inside a string, a continued line.
        assert not re.search(r'"[^"\n]*//', source), name
        assert "\\\n" not in source, name
        compacted = compact(source)
        assert _tokens(compacted) == _tokens(source), name
        assert "//" not in compacted and "\n\n" not in compacted, name
        directives = [line.strip() for line in source.splitlines() if line.strip()[:1] == "#"]
        assert [line for line in compacted.splitlines() if line[:1] == "#"] == directives, name
        assert len(compacted) < len(source), name
