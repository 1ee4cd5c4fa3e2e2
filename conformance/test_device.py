"""Where the accelerated backend's kernels run (accelerated/device.py): KVSPEC_FUSED_KERNELS
turns them off on CUDA, and is read once a process."""

from __future__ import annotations

import pytest

# Each test replaces what fused_kernels_enabled asks; emulated kernels replace the function.
pytestmark = pytest.mark.device_detection

mx = pytest.importorskip("mlx.core")

from kvspec.accelerated import device  # noqa: E402


@pytest.fixture
def on_cuda(monkeypatch):
    """A CUDA default device as `fused_kernels_enabled` sees it, the variable not yet read."""
    monkeypatch.setattr(device, "cuda_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    device.fused_kernels_allowed.cache_clear()
    yield
    device.fused_kernels_allowed.cache_clear()


@pytest.mark.parametrize(("value", "enabled"), [(None, True), ("1", True), ("0", False)])
def test_the_variable_turns_the_kernels_off(on_cuda, monkeypatch, value, enabled) -> None:
    if value is None:
        monkeypatch.delenv(device.FUSED_KERNELS_ENV, raising=False)
    else:
        monkeypatch.setenv(device.FUSED_KERNELS_ENV, value)
    assert device.fused_kernels_enabled() is enabled


def test_the_variable_is_read_once(on_cuda, monkeypatch) -> None:
    monkeypatch.setenv(device.FUSED_KERNELS_ENV, "0")
    assert not device.fused_kernels_enabled()
    monkeypatch.setenv(device.FUSED_KERNELS_ENV, "1")
    assert not device.fused_kernels_enabled()


def test_no_kernels_without_mlx_cuda(on_cuda, monkeypatch) -> None:
    monkeypatch.delenv(device.FUSED_KERNELS_ENV, raising=False)
    monkeypatch.setattr(device, "cuda_available", lambda: False)
    assert not device.fused_kernels_enabled()


@pytest.mark.parametrize(
    ("default", "cuda", "fused", "roundoff"),
    [
        ("cpu", True, False, 2.0**-24),  # CUDA present, the CPU the default: IEEE float32
        ("gpu", False, False, 2.0**-24),  # a GPU that is not CUDA's
        ("gpu", True, False, 2.0**-11),  # CUDA's attention through TF32, kernels off
        ("cpu", False, True, 2.0**-11),  # the kernels, wherever they run (emulated)
    ],
)
def test_the_attention_roundoff_is_the_devices(monkeypatch, default, cuda, fused, roundoff) -> None:
    """READ-1's r for the MLX backend: 2^-11 where attention multiplies through TF32 (MLX's
    CUDA default device, or the kernels), else IEEE float32's 2^-24."""
    from kvspec.accelerated.caches import attention

    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(getattr(mx, default)))
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(device, "fused_kernels_enabled", lambda: fused)
    assert attention.attention_roundoff() == roundoff
