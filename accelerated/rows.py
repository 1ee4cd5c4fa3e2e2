"""Rows of caches on MLX (spec ROWS-1 .. ROWS-10): the reference's functions, which rebuild
each cache from the caches package its class belongs to and join rows through its `xp`."""

from kvspec.reference.rows import (
    clone_caches,
    clone_single_row_state,
    extend,
    extract_row,
    filter_rows,
    merge,
    minimum_reusable_offset,
)

__all__ = [
    "clone_caches",
    "clone_single_row_state",
    "extend",
    "extract_row",
    "filter_rows",
    "merge",
    "minimum_reusable_offset",
]
