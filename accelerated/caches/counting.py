"""The counts a decode step hands its kernels (READ-7's live row count, COMPILE-3's write
position and active length) as int32 [1] arrays in device memory.

MLX keeps an array of 8 bytes or less in a small pool of host memory (MLX 0.32's CUDA
allocator), so a count made from host data is read across the bus by every block of every
read that needs it before it knows its rows: up to 10 us a layer of a read on an H200, of
which a decode step keeps 1-3 (docs/performance-log.md, "The live row count in device
memory"). Here the device makes a table of 0, 1, 2, ... once, and a count is a one-element
view of it, which a kernel reads at its offset in the table's buffer. The views are made
and their evaluation started a block at a time, ahead of the steps that ask for them, so
that no step's graph holds an op for its count and nothing here waits for the device."""

from __future__ import annotations

import mlx.core as mx


class CountingTable:
    """int32 0, 1, 2, ... made by the device, handed out as one-element views."""

    #: The fewest values a table holds (256 KiB): contexts up to 64k never grow it.
    LEAST = 1 << 16
    #: Views made at once, from the value asked for on: a decode loop's next steps find
    #: theirs made and evaluated.
    AHEAD = 64
    #: Views kept; the oldest go first (a view keeps its table alive, nothing else).
    KEPT = 1024

    def __init__(self) -> None:
        self._table: mx.array | None = None
        self._views: dict[int, mx.array] = {}

    def single(self, value: int) -> mx.array:
        """`value` as int32 [1]: the same array for every caller while it is kept, a view of
        the table in device memory, evaluated or being evaluated."""
        if value < 0:
            raise ValueError(f"a count is at least 0, not {value}")
        view = self._views.get(value)
        if view is None:
            self._make_views(value)
            view = self._views[value]
        return view

    def _make_views(self, first: int) -> None:
        """Views of `first` .. first + AHEAD - 1, their evaluation started, never waited for."""
        end = first + self.AHEAD
        table = self._table
        if table is None or table.size < end:
            table = self._table = mx.arange(max(self.LEAST, 1 << end.bit_length()), dtype=mx.int32)
        views = {
            value: table[value : value + 1]
            for value in range(first, end)
            if value not in self._views
        }
        mx.async_eval(*views.values())
        self._views.update(views)
        while len(self._views) > self.KEPT:
            del self._views[next(iter(self._views))]


#: The table every cache of this process takes its counts from: caches at one offset share
#: their counts' arrays, so a step over many layers hands the device one of each.
COUNTS = CountingTable()
