"""Deferred checks (spec DEFER-1 .. DEFER-3): the reference's failure ranks. On MLX a
rank is a lazy uint32 scalar; ranks combine by `mx.maximum` and are read only by a cache's
`check()`."""

from kvspec.reference.deferred import failure_message, failure_rank

__all__ = ["failure_message", "failure_rank"]
