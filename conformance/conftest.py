"""Suite-wide options: the backend under test, the hypothesis profiles, and the CUDA
kernels run on the CPU for the whole session where KVSPEC_EMULATED_CUDA=1
(conformance/emulated_cuda.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, Phase, settings

from kvspec.conformance.backend import Backend, load_backend
from kvspec.conformance.stand_ins import EMULATED_CUDA_ENV

# ci: the default; at least 200 examples per property, whole run under 15 minutes
# on 2 cores. fuzz: a long local run (HYPOTHESIS_PROFILE=fuzz).
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.register_profile("fuzz", parent=settings.get_profile("ci"), max_examples=5000)
settings.register_profile("quick", parent=settings.get_profile("ci"), max_examples=25)
# mutants: ci's examples without shrinking, for tools/mutants.py (a fault is caught or
# missed when generation ends; shrinking its example can take minutes).
settings.register_profile(
    "mutants",
    parent=settings.get_profile("ci"),
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target],
)
# mutants-fixed: the same draw every run, for the subset CI runs (a catch must not depend
# on the run's luck; the catalogue runs keep drawing afresh).
settings.register_profile(
    "mutants-fixed", parent=settings.get_profile("mutants"), derandomize=True, database=None
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session", autouse=True)
def emulated_cuda() -> Iterator[bool]:
    """Whether this session runs the CUDA kernels emulated (and, if so, for its time)."""
    if os.environ.get(EMULATED_CUDA_ENV) != "1":
        yield False
        return
    from kvspec.conformance.emulated_cuda import emulated_cuda_path

    with emulated_cuda_path():
        yield True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under emulated kernels, what needs a lazy kernel skips: tests marked lazy_graph (an
    emulated kernel evaluates its inputs as it is called); so do those marked
    device_detection."""
    if os.environ.get(EMULATED_CUDA_ENV) != "1":
        return
    graph = pytest.mark.skip(reason="an emulated kernel evaluates its inputs when called")
    detection = pytest.mark.skip(reason="the emulated kernels replace the device's detection")
    for item in items:
        if item.get_closest_marker("lazy_graph"):
            item.add_marker(graph)
        elif item.get_closest_marker("device_detection"):
            item.add_marker(detection)


@pytest.fixture(autouse=True)
def reads_in_mlx_ops(request: pytest.FixtureRequest) -> None:
    """Tests marked mlx_ops_reads skip where the CUDA kernels answer the decode reads: they
    assert bits of MLX's own attention, which the kernels hold to READ-7's bound instead
    (docs/mlx-lm.md)."""
    if request.node.get_closest_marker("mlx_ops_reads") is None:
        return
    from kvspec.accelerated.device import fused_kernels_enabled

    if fused_kernels_enabled():
        pytest.skip("asserts MLX attention's bits; the CUDA kernels answer the reads here")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--backend",
        default="accelerated",
        help="backend under test: accelerated, reference, or package.module:factory",
    )


@pytest.fixture(scope="session")
def backend(request: pytest.FixtureRequest) -> Backend:
    return load_backend(request.config.getoption("--backend"))
