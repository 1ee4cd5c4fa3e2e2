"""The compiled decode step on MLX (spec COMPILE-1 .. COMPILE-6): the reference's contract,
the step's graph compiled with `mx.compile` once per tuple of slot keys and replayed.

The traced graph holds every op of the eager step but the write: the encode (on CUDA the
fused encode kernels), the join and the read. It sees whole buffers with the write
position and the live length as data, so replaying it builds no graph in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from kvspec.reference.caches import compiled
from kvspec.reference.caches.compiled import (
    KEPT_GRAPHS,
    WINDOW_STEP,
    DecodePlan,
    DecodeRoom,
    DecodeSlot,
    DecodeStepMethods,
    DecodeTrace,
)

__all__ = [
    "KEPT_GRAPHS",
    "WINDOW_STEP",
    "CompiledDecode",
    "DecodePlan",
    "DecodeRoom",
    "DecodeSlot",
    "DecodeStepMethods",
    "DecodeTrace",
    "compile_decode",
]


class CompiledDecode(compiled.CompiledDecode):
    """COMPILE-6 with `mx.compile`: one compiled graph per tuple of slot keys."""

    @staticmethod
    def compile_graph(graph: Callable[..., Any]) -> Callable[..., Any]:
        return mx.compile(graph)

    @staticmethod
    def start_evaluation(outputs: Any, step_outputs: Sequence[Any]) -> None:
        """The device runs the step's graph while the host commits every cache (the
        commits' writes are left to the next step)."""
        mx.async_eval(outputs, step_outputs)


def compile_decode(step_fn: Callable[..., Any], caches: Sequence[Any]) -> CompiledDecode:
    """COMPILE-6: `step_fn(traces, *args)` over the MLX `caches`, compiled; returns
    `step(*args) -> outputs`. The caches' buffers with the step's writes are left to
    whatever reads them next (the next step, whose evaluation writes them in place):
    evaluated together with the outputs, a write could not take over a buffer the
    step's read still holds, and would copy it."""
    return CompiledDecode(step_fn, caches)
