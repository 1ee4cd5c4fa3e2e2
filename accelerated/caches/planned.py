"""Appends planned once per shape (CACHE-2 on MLX): the checks an append makes, and the
encode path it takes, depend on the shapes and dtype of its keys and values and on the
layout the storage holds, not on their values. A decode step appends one shape at every
layer and step, and the reference's checked path costs the host more than the encode and
write it leads to, so an MLX storage keeps the plan of its last checked append
(`ReadMethods._checked`) and runs the next of those shapes through it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from kvspec.accelerated.cuda_source import KERNELS_MADE
from kvspec.reference.caches.protocol import KvLayout
from kvspec.reference.caches.storage import Fields

#: An encode planned for one shape of appends (`ReadMethods._append_encoder`): keys, values
#: and the running rank (DEFER-3; None before the first) to the fields to store and the new
#: running rank (None: the storage keeps its own).
Encoder = Callable[[mx.array, mx.array, mx.array | None], tuple[Fields, mx.array | None]]


class PlannedAppend:
    """The checked append of keys and values of one shape and dtype into a storage of one
    layout: what `_checked` found for it (the layout, the encoder its checks chose). An
    append it `takes` runs the same encode (`ReadMethods._checked`), so the storage stores
    what the checked path stores; whatever it does not take (another shape or dtype, a
    storage whose layout changed) goes that path. The storage's own steps (growing, the
    ring's room, the write) run as always."""

    __slots__ = ("dtype", "encode", "generation", "k_shape", "layout", "v_shape")

    def __init__(self, k: mx.array, v: mx.array, layout: KvLayout, encode: Encoder) -> None:
        self.k_shape = k.shape
        self.v_shape = v.shape
        self.dtype = k.dtype
        #: The layout object the checked append gave the storage.
        self.layout = layout
        self.encode = encode
        #: The kernels' generation the encode was made in (KERNELS_MADE).
        self.generation = KERNELS_MADE.count

    def __copy__(self) -> PlannedAppend:
        return self

    def __deepcopy__(self, memo: dict) -> PlannedAppend:
        # Immutable and tied to no storage's arrays: a copied storage shares it.
        return self

    def takes(self, storage: Any, k: mx.array, v: mx.array) -> bool:
        """Whether `k`, `v` are of the planned shapes and dtype and the storage still holds
        the layout they were checked against (CACHE-2), with the kernels the encode was made
        with (none dropped since: KERNELS_MADE)."""
        return (
            storage._layout is self.layout
            and self.generation == KERNELS_MADE.count
            and k.shape == self.k_shape
            and v.shape == self.v_shape
            and k.dtype == self.dtype
            and v.dtype == self.dtype
        )
