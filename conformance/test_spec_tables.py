"""docs/spec.md's own tables hold: its sign tables and codebooks are the frozen ones in
`turboquant_tables` (TQ-1, TQ-2), its contents list names every section, and its version
is the change log's last entry and the golden vectors' specVersion."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvspec.conformance.vectors import SPEC_VERSION
from kvspec.reference.turboquant_tables import CODEBOOK_IDS, POSITIVE_CENTROID_BITS, SIGN_HEX

SPEC = Path(__file__).resolve().parents[1] / "docs" / "spec.md"

if not SPEC.exists():
    pytest.skip("docs/spec.md is not beside this checkout", allow_module_level=True)

TEXT = SPEC.read_text()
SIGN_ROW = re.compile(r"^\| (\d+) \| `([0-9a-f]+)` \|$", re.MULTILINE)
CODEBOOK_ROW = re.compile(r"^\| (\d) \| `([a-z0-9-]+)` \| `([0-9a-f]+)` \|$", re.MULTILINE)
SECTION = re.compile(r"^### ([A-Z][A-Z0-9]*)-(\d+)\b", re.MULTILINE)
ID_RANGE = r"[A-Z0-9]+-\d+(?: \.\. [A-Z0-9]+-\d+)?"
CONTENTS_ROW = re.compile(rf"^\| \d+ [^|]+\| ((?:{ID_RANGE}(?:, )?)+) \|$")


def test_sign_tables_are_the_frozen_ones() -> None:
    rows = {int(dim): hex_bytes for dim, hex_bytes in SIGN_ROW.findall(TEXT)}
    assert rows == SIGN_HEX


def test_codebooks_are_the_frozen_ones() -> None:
    rows = CODEBOOK_ROW.findall(TEXT)
    assert [int(bits) for bits, _, _ in rows] == list(POSITIVE_CENTROID_BITS)
    for bits, codebook_id, patterns in rows:
        frozen = POSITIVE_CENTROID_BITS[int(bits)]
        assert codebook_id == CODEBOOK_IDS[int(bits)]
        assert len(patterns) == 8 * len(frozen), f"{bits} bits: one pattern per centroid"
        spec = tuple(int(patterns[i : i + 8], 16) for i in range(0, len(patterns), 8))
        assert spec == frozen, f"{bits}-bit codebook differs from turboquant_tables"


def _listed_ids() -> set[str]:
    listed = set()
    for line in TEXT.splitlines():
        match = CONTENTS_ROW.match(line)
        if not match:
            continue
        for item in match.group(1).split(", "):
            first, _, last = item.partition(" .. ")
            prefix, low = first.rsplit("-", 1)
            high = last.rsplit("-", 1)[1] if last else low
            listed |= {f"{prefix}-{i}" for i in range(int(low), int(high) + 1)}
    return listed


def test_contents_list_every_section() -> None:
    defined = {f"{prefix}-{number}" for prefix, number in SECTION.findall(TEXT)}
    assert _listed_ids() == defined, "update the contents table at the top of docs/spec.md"


def test_version_is_the_change_logs_last_and_the_vectors() -> None:
    version = re.search(r"^Version (\d+\.\d+), format version (\d+)\.", TEXT, re.MULTILINE)
    assert version is not None
    log = re.findall(r"^\| (\d+\.\d+) \| (\d+) \|", TEXT.split("## Change log")[1], re.MULTILINE)
    assert log[-1] == version.groups()
    assert version.group(1) == SPEC_VERSION
