"""The counts a decode step hands its kernels (accelerated/caches/counting.py): views of a
table the device made, in device memory, made and evaluated ahead of the steps that ask
for them, without waiting for the device."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

mx = pytest.importorskip("mlx.core")

from kvspec.accelerated.caches.counting import CountingTable  # noqa: E402


def _address(array: mx.array) -> int:
    """Where `array`'s first element lies (MLX's CPU and unified memory hand NumPy views)."""
    return np.asarray(memoryview(array)).__array_interface__["data"][0]


def _primitives(array: mx.array) -> list[str]:
    graph = io.StringIO()
    mx.export_to_dot(graph, array)
    return re.findall(r'label ="(\w+)", shape=rectangle', graph.getvalue())


@pytest.mark.parametrize("value", [0, 1, 63, 64, 1000, CountingTable.LEAST - 1])
def test_a_count_is_its_value_as_int32_single(value: int) -> None:
    count = CountingTable().single(value)
    assert count.dtype == mx.int32 and count.shape == (1,)
    assert count.tolist() == [value]


def test_a_count_is_a_view_of_the_table_shared_by_its_callers() -> None:
    """Every caller of a value gets one array, which lies in the table's buffer at its
    offset: no array of its own (MLX would place one of 4 bytes in host memory)."""
    counts = CountingTable()
    first = counts.single(130)
    assert counts.single(130) is first
    table = counts._table
    assert table is not None
    for value in (130, 131, 193, 7):
        assert _address(counts.single(value)) == _address(table) + 4 * value


def test_counts_ahead_are_made_and_evaluated_with_the_first() -> None:
    """A decode loop's next steps find their counts made: no op in their graphs."""
    counts = CountingTable()
    first = counts.single(500)
    made = {value: counts.single(value) for value in range(500, 500 + counts.AHEAD)}
    assert made[500] is first
    for value, count in made.items():
        assert _primitives(count) == [], value
    assert counts.single(500 + counts.AHEAD) is not None
    assert len(counts._views) == 2 * counts.AHEAD


def test_making_counts_never_waits_for_the_device(monkeypatch) -> None:
    counts = CountingTable()

    def refused(*arrays: mx.array) -> None:
        raise AssertionError("a count waited for the device")

    monkeypatch.setattr(mx, "eval", refused)
    for value in (0, 200, 3 * CountingTable.LEAST):
        counts.single(value)


def test_the_table_grows_past_its_end_and_earlier_counts_stay() -> None:
    counts = CountingTable()
    early = counts.single(10)
    late_value = 5 * CountingTable.LEAST + 3
    late = counts.single(late_value)
    table = counts._table
    assert table is not None and table.size > late_value + counts.AHEAD
    assert late.tolist() == [late_value]
    assert early.tolist() == [10]
    assert _address(late) == _address(table) + 4 * late_value


def test_only_the_newest_counts_are_kept() -> None:
    counts = CountingTable()
    for block in range(2 * counts.KEPT // counts.AHEAD):
        counts.single(block * counts.AHEAD)
    assert len(counts._views) == counts.KEPT
    assert min(counts._views) == counts.KEPT


def test_a_negative_count_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 0"):
        CountingTable().single(-1)
