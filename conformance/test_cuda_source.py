"""The MLX backend's CUDA sources are handed to MLX short (`accelerated/cuda_source.py`):
compacted (comments and indentation go, every token stays) or included from a file of
`accelerated/cuda/` (the source is a call). These run on any device: the sources are
text."""

from __future__ import annotations

import re

import pytest

from kvspec.conformance.backend import Backend


def _sources() -> dict[str, str]:
    from kvspec.accelerated import affine_kernels, turboquant_kernels

    sources = {
        "turboquant header": turboquant_kernels._HEADER,
        "turboquant decode": turboquant_kernels._SOURCE,
        "turboquant encode": turboquant_kernels._ENCODE_SOURCE,
        "affine encode": affine_kernels._SOURCE,
    }
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


def test_an_included_file_is_named_by_its_path_and_its_contents(
    backend: Backend, tmp_path, monkeypatch
) -> None:
    """MLX keys a built kernel by a hash of the source it builds (in memory and in its PTX
    cache on disk): a header that includes a file must change when the file does."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's CUDA sources")
    from kvspec.accelerated import cuda_source

    monkeypatch.setattr(cuda_source, "CUDA_DIR", tmp_path)
    cuda_source.included.cache_clear()
    try:
        (tmp_path / "a.cuh").write_text("__device__ int one() { return 1; }\n")
        first = cuda_source.included("a.cuh")
        assert f'#include "{tmp_path / "a.cuh"}"' in first.splitlines()
        cuda_source.included.cache_clear()
        (tmp_path / "a.cuh").write_text("__device__ int one() { return 2; }\n")
        assert cuda_source.included("a.cuh") != first
        with pytest.raises(FileNotFoundError):
            cuda_source.included("missing.cuh")
    finally:
        cuda_source.included.cache_clear()


def test_the_decode_attention_kernels_hand_mlx_a_call_not_their_code(backend: Backend) -> None:
    """Pass 1 and the merge include accelerated/cuda/decode_attention.cuh, whose entry
    points they call with every argument the function takes, by name: the source MLX
    builds and hashes at every call stays under a kilobyte."""
    if backend.package != "kvspec.accelerated":
        pytest.skip("the MLX backend's CUDA sources")
    from kvspec.accelerated import attention_kernels, cuda_source

    code = (cuda_source.CUDA_DIR / "decode_attention.cuh").read_text()
    signature = code[
        code.index("void partial_pass(") : code.index(") {", code.index("void partial_pass("))
    ]
    parameters = [part.split()[-1].strip("&*") for part in signature.split("(", 1)[1].split(",")]
    for mma in (False, True):
        for counted, slot in ((False, False), (True, False), (True, True)):
            call = attention_kernels._partial_call(mma, counted, slot)
            assert len(call) < 1024
            arguments = [a.strip() for a in call.split(">(", 1)[1].rstrip(");").split(",")]
            assert len(arguments) == len(parameters)
            for parameter, argument in zip(parameters, arguments, strict=True):
                # each argument is the parameter's namesake, or a stand-in the variant never reads
                assert argument in (parameter, "nullptr", "k_codes_strides"), (parameter, argument)
            assert ("rows" in arguments) == counted and ("slot_row" in arguments) == slot
