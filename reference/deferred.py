"""Deferred checks: how an encode reports input it cannot hold without a host read
(spec DEFER-1 .. DEFER-3).

A deferred encode stores what it cannot hold as NaN groups (DEFER-1) and returns a
failure rank: for a codec's value checks c_0, c_1, ... in the order its eager encode
makes them, the rank of check i is len(checks) - i, and 0 means every check passed. The
larger of two ranks names the earlier check, so ranks of several encodes combine by max,
and a cache keeps one (DEFER-3).
"""

from __future__ import annotations


def failure_rank(checks: tuple[str, ...], failed: list[bool]) -> int:
    """DEFER-2: the rank of the first check in `failed` that failed, 0 if none."""
    for i, failed_here in enumerate(failed):
        if failed_here:
            return len(checks) - i
    return 0


def failure_message(checks: tuple[str, ...], rank: int) -> str:
    """DEFER-2: the message of the check a nonzero rank names."""
    if not 0 < rank <= len(checks):
        raise ValueError(f"failure rank {rank} names none of {len(checks)} checks")
    return checks[len(checks) - rank]
