"""The backend mirrors the reference module for module and name for name, so every
test can find a function's twin by name (STYLE 2)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import kvspec.reference

# (module, name): why the backend need not have it.
NOT_MIRRORED = {
    ("dtypes", "unit_roundoff"): "a fact about a NumPy format, used by the bounds",
    ("dtypes", "smallest_subnormal"): "a fact about a NumPy format, used by the bounds",
    ("dtypes", "largest_finite"): "a fact about a NumPy format, used by the strategies",
    ("bits", "bytes_to_words"): "the backend packs words directly",
    ("bits", "words_to_bytes"): "the backend packs words directly",
}


def _public_names(module) -> list[str]:
    return [
        name
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj))
        and obj.__module__ == module.__name__
    ]


# module: why the backend has no twin of it.
NOT_MIRRORED_MODULES = {
    "turboquant_tables": "frozen constants; both backends read them from the reference",
}

REFERENCE_MODULES = [
    info.name
    for info in pkgutil.iter_modules(kvspec.reference.__path__)
    if info.name not in NOT_MIRRORED_MODULES
]


@pytest.mark.parametrize("module_name", REFERENCE_MODULES)
def test_backend_has_every_public_name(backend, module_name: str) -> None:
    reference = importlib.import_module(f"kvspec.reference.{module_name}")
    twin = backend.module(module_name)
    missing = [
        name
        for name in _public_names(reference)
        if (module_name, name) not in NOT_MIRRORED and not hasattr(twin, name)
    ]
    assert not missing, f"{backend.name}.{module_name} lacks {missing}"
