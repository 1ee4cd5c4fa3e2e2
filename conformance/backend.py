"""A backend under test, as one adapter: its modules and how its arrays meet NumPy.

The conformance suite holds any backend against `kvspec.reference`. A backend is
found by the same module and function names as the reference (`backend.module
("affine").quantize`), so a port in another runtime joins by writing one adapter:
a factory returning `Backend`, named on the command line as
`pytest --backend=package.module:factory`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Backend:
    """What the suite needs of an implementation.

    name: shown in test ids and reports.
    package: dotted package whose submodules mirror kvspec.reference's.
    to_numpy: a backend array to a NumPy array holding the same bits.
    from_numpy: a NumPy array to a backend array holding the same bits.
    attention_roundoff: the unit roundoff of the products and sums of the backend's
        attention on float32 operands (READ-1): 2^-24 for IEEE float32.
    exact_affine_decode: whether affine fetches decode bit for bit as the reference's
        (QKV-2: on MLX's CPU stream; elsewhere only within AFF-6's bound).
    rounded_attention: whether the backend's attention rounds as MLX's CPU attention
        does (bounds.rounded_attention_interval), which the suite then also checks.
    """

    name: str
    package: str
    to_numpy: Callable[[Any], np.ndarray]
    from_numpy: Callable[[np.ndarray], Any]
    attention_roundoff: float = 2.0**-24
    exact_affine_decode: bool = False
    rounded_attention: bool = False

    def module(self, name: str) -> ModuleType:
        """The backend's twin of `kvspec.reference.<name>`."""
        return importlib.import_module(f"{self.package}.{name}")


def reference_backend() -> Backend:
    """The reference itself: the suite run against it checks the suite."""
    return Backend(
        name="reference",
        package="kvspec.reference",
        to_numpy=np.asarray,
        from_numpy=np.array,
        exact_affine_decode=True,
    )


def backend_of_side(backend: Backend, side: str) -> Backend:
    """The adapter of one side of a test run on both: the reference's for "reference",
    else `backend`."""
    return reference_backend() if side == "reference" else backend


def accelerated_backend() -> Backend:
    """The MLX backend, on MLX's default device."""
    import mlx.core as mx

    from kvspec.accelerated import device
    from kvspec.accelerated.caches.attention import attention_roundoff
    from kvspec.accelerated.dtypes import from_numpy, to_numpy

    # MLX's CPU ops, unless the CUDA kernels run there (conformance/emulated_cuda.py).
    on_cpu = mx.default_device().type == mx.DeviceType.cpu and not device.fused_kernels_enabled()
    return Backend(
        name="accelerated",
        package="kvspec.accelerated",
        to_numpy=to_numpy,
        from_numpy=from_numpy,
        attention_roundoff=attention_roundoff(),
        exact_affine_decode=on_cpu,
        rounded_attention=on_cpu,
    )


BUILTIN_BACKENDS: dict[str, Callable[[], Backend]] = {
    "accelerated": accelerated_backend,
    "reference": reference_backend,
}


def load_backend(spec: str) -> Backend:
    """A backend by builtin name or as `package.module:factory`."""
    if spec in BUILTIN_BACKENDS:
        return BUILTIN_BACKENDS[spec]()
    module_name, sep, factory_name = spec.partition(":")
    if not sep:
        builtin = ", ".join(BUILTIN_BACKENDS)
        raise ValueError(f"backend {spec!r}: expected one of {builtin} or 'package.module:factory'")
    factory = getattr(importlib.import_module(module_name), factory_name)
    backend = factory()
    if not isinstance(backend, Backend):
        raise ValueError(f"backend factory {spec!r} returned {type(backend).__name__}, not Backend")
    return backend
