"""tools/codebooks.py against the frozen tables (TQ-2): a fresh scipy computation
rounds to the same float32 bits, and --check says so."""

from __future__ import annotations

import codebooks
import numpy as np
import pytest

from kvspec.reference import turboquant


@pytest.mark.parametrize("bits", turboquant.VALUE_BITS)
def test_frozen_centroids_match_a_fresh_computation(bits: int) -> None:
    fresh = codebooks.centroids(bits)
    frozen = turboquant.centroids(bits)
    assert fresh.dtype == frozen.dtype == np.float32
    np.testing.assert_array_equal(fresh.view(np.uint32), frozen.view(np.uint32))
    # The frozen bits do not hinge on the solver's last digits.
    assert codebooks.float32_margin(codebooks.positive_levels(bits)) > 1e-4


def test_distortion_matches_lloyd_max() -> None:
    """The classic Lloyd-Max MSE figures of N(0, 1) (FACTS section 4)."""
    expected = {2: 0.11748, 3: 0.03455, 4: 0.00950}
    for bits, mse in expected.items():
        assert codebooks.distortion(codebooks.positive_levels(bits)) == pytest.approx(mse, abs=5e-6)


def test_check_passes_on_the_frozen_tables(capsys: pytest.CaptureFixture[str]) -> None:
    assert codebooks.main(["--check"]) == 0
    assert "lloyd-max-gauss-8b-v1" in capsys.readouterr().out


def test_check_fails_on_a_changed_table(monkeypatch: pytest.MonkeyPatch) -> None:
    changed = turboquant.centroids(2).copy()
    changed[-1] = np.nextafter(changed[-1], np.float32(2))
    monkeypatch.setattr(codebooks.frozen, "centroids", lambda bits: changed)
    assert codebooks.main(["--check", "--bits", "2"]) == 1
