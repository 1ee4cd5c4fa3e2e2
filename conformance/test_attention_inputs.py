"""READ-1's attention takes queries [B, Hq, N, D], keys [B, Hk, T, D] and values
[B, Hk, T, Dv] with Hq a multiple of Hk, and refuses every other shape: each condition is
broken alone here, on the reference and on the backend, and refused by the check that
names it (a product of misfit arrays may raise too, or broadcast), so that no weaker check
(one that needs two conditions broken at once) passes."""

from __future__ import annotations

import numpy as np
import pytest

from kvspec.conformance.backend import Backend, backend_of_side

#: queries, keys, values shapes that fit: B 2, Hq 4 over Hk 2, N 3, T 5, D 8, Dv 6.
FITS = ((2, 4, 3, 8), (2, 2, 5, 8), (2, 2, 5, 6))

#: One condition of READ-1 broken alone: (what, queries, keys, values, the refusal's words).
MISFITS = [
    ("keys of another batch", FITS[0], (1, 2, 5, 8), FITS[2], "do not fit"),
    ("keys of another head dim", FITS[0], (2, 2, 5, 4), FITS[2], "do not fit"),
    ("values of another batch", FITS[0], FITS[1], (1, 2, 5, 6), "do not fit"),
    ("values of other heads", FITS[0], FITS[1], (2, 1, 5, 6), "do not fit"),
    ("values of another length", FITS[0], FITS[1], (2, 2, 4, 6), "do not fit"),
    ("query heads not a multiple", (2, 3, 3, 8), FITS[1], FITS[2], "not a multiple"),
]


def _arrays(side: Backend, *shapes: tuple[int, ...]) -> list:
    rng = np.random.default_rng(0)
    return [side.from_numpy(rng.standard_normal(shape).astype(np.float32)) for shape in shapes]


@pytest.mark.parametrize("side_name", ["reference", "backend"])
@pytest.mark.parametrize("misfit", MISFITS, ids=[m[0] for m in MISFITS])
def test_attention_refuses_inputs_that_do_not_fit(
    backend: Backend, side_name: str, misfit: tuple
) -> None:
    side = backend_of_side(backend, side_name)
    attention = side.module("caches.attention").attention
    output = attention(*_arrays(side, *FITS), 0.5, None)
    assert side.to_numpy(output).shape == (2, 4, 3, 6)
    _, *shapes, words = misfit
    with pytest.raises(ValueError, match=words):
        attention(*_arrays(side, *shapes), 0.5, None)
