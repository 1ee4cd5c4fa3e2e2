"""The cache protocol, its state record and the checks every append shares (spec CACHE-1,
CACHE-2, CACHE-8).

Array-agnostic: both backends build their caches on these types, so a cache of either
backend answers the same questions in the same words.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, Protocol, TypeVar

A = TypeVar("A")

#: A mask as the reads pass it to attention (MASK-1): None (every key visible), the string
#: "causal" (lower-right aligned), or a boolean array broadcastable to [N, T].
Mask = Any


class KvLayout(NamedTuple):
    """What stays fixed over a cache's life once its first append fixed it (CACHE-2). A
    named tuple: every append makes one, in a fraction of a frozen dataclass's time."""

    batch: int
    kv_heads: int
    k_dim: int
    v_dim: int
    dtype: str


def kv_layout(k: Any, v: Any, dtype_name: str) -> tuple[KvLayout, int]:
    """The layout and length L of an append's k [B, H, L, Dk] and v [B, H, L, Dv] (CACHE-2).

    `dtype_name` is the backend's name of k's dtype (it rejects unsupported ones).
    """
    if k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"k and v must be [B, H, L, D], got shapes {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if tuple(k.shape[:3]) != tuple(v.shape[:3]):
        raise ValueError(f"k and v disagree on [B, H, L]: {tuple(k.shape)} and {tuple(v.shape)}")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v must share one dtype, got {k.dtype} and {v.dtype}")
    B, H, L, k_dim = k.shape
    if L < 1:
        raise ValueError("an append holds at least one position")
    return KvLayout(B, H, k_dim, v.shape[3], dtype_name), L


def require_same_layout(stored: KvLayout | None, new: KvLayout) -> None:
    """Reject an append whose layout differs from the one the cache holds (CACHE-2)."""
    if stored is not None and stored != new:
        raise ValueError(f"append layout {new} differs from the cache's {stored}")


@dataclass(frozen=True)
class CacheState(Generic[A]):
    """Everything a cache needs to resume (CACHE-8).

    signature: the cache kind and parameters, as `Cache.signature()`.
    arrays: the stored fields in the slot order of the kind's section (empty when nothing
        is stored).
    offset: positions appended and not trimmed.
    ring_index: the ring's write index (rotating caches), else None.
    minimum_reusable_offset: the shortest prefix a caller may reuse (B16F-4).
    left_padding: per row, the leading buffer positions that are not the row's own (ROWS-5);
        empty when every row starts at position 0.
    """

    signature: str
    arrays: tuple[A, ...]
    offset: int
    ring_index: int | None = None
    minimum_reusable_offset: int = 0
    left_padding: tuple[int, ...] = ()


class Read(Protocol[A]):
    """What attention sees after a read (READ-1)."""

    def attend(self, queries: A, scale: float) -> A:
        """Attention of `queries` [B, Hq, N, D] over the read's keys and values."""
        ...


class Cache(ABC, Generic[A]):
    """One layer's keys and values (CACHE-1). Every cache kind implements all of this."""

    offset: int
    minimum_reusable_offset: int

    @property
    @abstractmethod
    def layout(self) -> KvLayout | None:
        """The layout the first append fixed; None while nothing is stored (CACHE-2)."""

    @property
    @abstractmethod
    def ring_index(self) -> int | None:
        """The ring's write index (RING-1); None for caches that are not rings."""

    @property
    @abstractmethod
    def left_padding(self) -> tuple[int, ...]:
        """Per row, the leading buffer positions that are not the row's own (ROWS-5): B
        zeros unless rows of different lengths were merged; empty while nothing is stored."""

    @abstractmethod
    def prepare(self, *, left_padding: Sequence[int]) -> None:
        """Row b's first `left_padding[b]` positions of the first append are padding
        (ROWS-11; mlx-lm's `prepare`)."""

    @property
    def row_offsets(self) -> tuple[int, ...]:
        """Per row, the positions that row holds: offset - left_padding (ROWS-5; mlx-lm's
        per-row `offset`)."""
        return tuple(self.offset - padding for padding in self.left_padding)

    @property
    @abstractmethod
    def sliding_window(self) -> int | None:
        """The window every read of this cache applies (RING-1); None for full attention."""

    @abstractmethod
    def check_append(self, k: A, v: A) -> None:
        """Raise ValueError if `k`, `v` could not be appended; changes nothing (CACHE-2)."""

    @abstractmethod
    def update_and_fetch(self, k: A, v: A) -> tuple[A, A]:
        """Append, then the window as mlx-lm lays it out, decoded (CACHE-3)."""

    @abstractmethod
    def keys_and_values(self) -> tuple[A, A] | None:
        """The window `update_and_fetch` last returned, without appending; None if empty."""

    @abstractmethod
    def append_decode(self, k: A, v: A) -> Read[A]:
        """READ-2."""

    @abstractmethod
    def append_window(self, k: A, v: A) -> Read[A]:
        """READ-3."""

    @abstractmethod
    def append_committed(self, k: A, v: A) -> Read[A]:
        """READ-4."""

    @abstractmethod
    def read_block(self, k: A, v: A) -> Read[A]:
        """READ-5."""

    @abstractmethod
    def append_bidirectional(self, k: A, v: A, bidirectional: A) -> Read[A]:
        """READ-6."""

    @abstractmethod
    def append_encoder_window(self, k: A, v: A, bidirectional: A) -> Read[A]:
        """READ-6."""

    @abstractmethod
    def is_trimmable(self) -> bool:
        """CACHE-5."""

    @abstractmethod
    def trim(self, n: int) -> int:
        """Drop the last min(n, offset) positions and return how many (CACHE-5)."""

    @abstractmethod
    def make_mask(self, n: int, window_size: int | None) -> Mask:
        """The mask of the next append of `n` positions (MASK-2, MASK-3)."""

    @abstractmethod
    def bytes_per_token(self) -> int:
        """Bytes one position occupies in the stored fields, all rows and heads (CACHE-6)."""

    @abstractmethod
    def signature(self) -> str:
        """Kind and parameters, e.g. "kv:affine:4:64" (CACHE-7)."""

    @abstractmethod
    def state(self) -> CacheState[A]:
        """CACHE-8."""

    @abstractmethod
    def restore_state(self, state: CacheState[A]) -> None:
        """Adopt `state`, replacing what this cache holds (CACHE-8)."""

    @abstractmethod
    def check(self) -> None:
        """Raise the ValueError a deferred check recorded since the last call, once; nothing
        to raise for eager checks (DEFER-3)."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise AssertionError if a stated invariant of the kind does not hold."""


#: How a cache checks what it encodes (DEFER-3): "eager" raises before anything is
#: stored; "deferred" stores NaN groups and raises from `check()`, with no host read.
CHECKS = ("eager", "deferred")


def check_checks(checks: str) -> None:
    """DEFER-3: a checks mode of CHECKS."""
    if checks not in CHECKS:
        raise ValueError(f"checks must be one of {CHECKS}, got {checks!r}")


def require(condition: bool, message: str) -> None:
    """A class invariant check (CACHE-1) that survives `python -O`."""
    if not condition:
        raise AssertionError(message)
