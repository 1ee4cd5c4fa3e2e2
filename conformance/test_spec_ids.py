"""Every spec id the code cites exists in docs/spec.md, and every public reference
function cites one (STYLE: the spec has section ids; code cites ids, not prose)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import re
from pathlib import Path

import pytest

import kvspec.reference

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "spec.md"
SOURCE_DIRS = ("reference", "accelerated", "conformance", "tools")

if not SPEC.exists():
    pytest.skip("docs/spec.md is not beside this checkout", allow_module_level=True)

DEFINED = set(re.findall(r"^#{2,4} ([A-Z][A-Z0-9]*-\d+)\b", SPEC.read_text(), re.MULTILINE))
PREFIXES = sorted({identifier.split("-")[0] for identifier in DEFINED})
CITATION = re.compile(r"\b(?:" + "|".join(PREFIXES) + r")-\d+\b")


def _reference_modules():
    for info in pkgutil.walk_packages(kvspec.reference.__path__, "kvspec.reference."):
        yield importlib.import_module(info.name)


def test_spec_defines_ids() -> None:
    assert {"CONV-1", "BITS-1", "AFF-1"} <= DEFINED


def test_every_cited_id_is_defined() -> None:
    undefined = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for match in CITATION.finditer(path.read_text()):
                if match.group() not in DEFINED:
                    undefined.append(f"{path.relative_to(ROOT)}: {match.group()}")
    assert not undefined, "cited but not defined in docs/spec.md:\n" + "\n".join(undefined)


def test_every_public_reference_function_cites_the_spec() -> None:
    silent = []
    for module in _reference_modules():
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            is_public = inspect.isfunction(obj) or inspect.isclass(obj)
            if is_public and not CITATION.search(inspect.getdoc(obj) or ""):
                silent.append(f"{module.__name__}.{name}")
    assert not silent, "public reference names without a spec id:\n" + "\n".join(silent)
