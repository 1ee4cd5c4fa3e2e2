"""bf16-first caches: plain storage until an append leaves `start` positions, converted
storage after (spec B16F-1 .. B16F-6).

mlx-lm's generate loop and the seeds' served path run the first forward on unquantized
keys and values and convert afterwards, even with a start of 0; these caches keep that
order inside their own appends.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence

import numpy as np

from kvspec.reference.caches.compiled import DecodePlan, DecodeSlot
from kvspec.reference.caches.kv import KVCache
from kvspec.reference.caches.protocol import (
    A,
    Cache,
    CacheState,
    KvLayout,
    Mask,
    Read,
    check_checks,
)
from kvspec.reference.caches.quantized import QuantizedKVCache, check_affine_parameters
from kvspec.reference.caches.reads import PositionwiseRead
from kvspec.reference.caches.rotating import RotatingKVCache
from kvspec.reference.caches.rotating_quantized import RotatingQuantizedKVCache
from kvspec.reference.caches.turboquant import TurboQuantKVCache, check_turboquant_parameters


def transition_due(offset: int, start: int) -> bool:
    """Whether plain storage holding `offset` positions converts under `start` (B16F-1):
    once it holds at least `start`, and never while empty, so the first append is plain
    even when start is 0."""
    return offset >= start and offset != 0


class Bf16FirstCache(Cache[A]):
    """Plain storage, then converted storage, switching inside the append that makes
    `transition_due` true (B16F-2). That append is read plain; the storage converts
    before the append returns; later appends go to the converted storage.

    Invariants: exactly one storage is held; plain storage is held iff it has never been
    due; the switch is irreversible (trimming below start keeps converted storage).
    Subclasses name the two storages and the conversion (which consumes the plain one);
    this base holds no arrays of its own. The storage kinds are class attributes, so the
    MLX backend binds its own storages and inherits every step.
    """

    #: The only head_dim this cache accepts, when its converted storage is specialized.
    head_dim: int | None = None

    def __init__(self, start: int, checks: str = "eager") -> None:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        check_checks(checks)
        self.start = start
        self.checks = checks
        self._plain: Cache[A] | None = self._new_plain()
        self._converted: Cache[A] | None = None

    @abstractmethod
    def _new_plain(self) -> Cache[A]:
        """Empty plain storage."""

    @abstractmethod
    def _new_converted(self) -> Cache[A]:
        """Empty converted storage (for its signature and its append checks)."""

    @abstractmethod
    def _convert(self, plain: Cache[A]) -> Cache[A]:
        """The converted storage of `plain`, which is consumed (CACHE-9)."""

    @property
    def storage(self) -> Cache[A]:
        """The storage held now: what row layouts, clones and saved files take."""
        held = self._converted if self._converted is not None else self._plain
        assert held is not None
        return held

    @property
    def converted(self) -> bool:
        """Whether the switch happened."""
        return self._converted is not None

    @property
    def offset(self) -> int:  # type: ignore[override]
        return self.storage.offset

    @property
    def minimum_reusable_offset(self) -> int:  # type: ignore[override]
        return self.storage.minimum_reusable_offset

    @property
    def layout(self) -> KvLayout | None:
        return self.storage.layout

    @property
    def ring_index(self) -> int | None:
        return self.storage.ring_index

    @property
    def left_padding(self) -> tuple[int, ...]:
        return self.storage.left_padding

    def prepare(self, *, left_padding: Sequence[int]) -> None:
        """ROWS-11: the held storage's."""
        self.storage.prepare(left_padding=left_padding)

    @property
    def sliding_window(self) -> int | None:
        return self.storage.sliding_window

    def check_append(self, k: A, v: A) -> None:
        """CACHE-2, B16F-3: raise ValueError if `k`, `v` could not be appended."""
        self._check_convertible(k, v)
        self.storage.check_append(k, v)

    def _check_convertible(self, k: A, v: A) -> None:
        """B16F-3: before the switch, positions must also be convertible, so a conversion
        never fails on what was accepted. (The storage's own append checks the rest.)"""
        if self.head_dim is not None and (
            k.shape[-1] != self.head_dim or v.shape[-1] != self.head_dim
        ):
            raise ValueError(
                f"{type(self).__name__} takes head_dim {self.head_dim}, got "
                f"{k.shape[-1]} and {v.shape[-1]}"
            )
        if self._converted is None:
            self._new_converted().check_append(k, v)

    def _settle(self) -> None:
        """B16F-2, B16F-4: convert once due; a nonzero start records the converted offset
        as the minimum reusable offset."""
        plain = self._plain
        if plain is None or not transition_due(plain.offset, self.start):
            return
        offset = plain.offset
        converted = self._convert(plain)
        if self.start > 0:
            converted.minimum_reusable_offset = offset
        self._converted = converted
        self._plain = None

    def update_and_fetch(self, k: A, v: A) -> tuple[A, A]:
        """The storage's fetch, then the switch the append may owe (B16F-2)."""
        self._check_convertible(k, v)
        fetched = self.storage.update_and_fetch(k, v)
        self._settle()
        return fetched

    def keys_and_values(self) -> tuple[A, A] | None:
        return self.storage.keys_and_values()

    def append_decode(self, k: A, v: A) -> Read[A]:
        """READ-2 on the storage held, then the switch."""
        self._check_convertible(k, v)
        read = self.storage.append_decode(k, v)
        self._settle()
        return read

    def append_window(self, k: A, v: A) -> Read[A]:
        """READ-3 on the storage held, then the switch."""
        self._check_convertible(k, v)
        read = self.storage.append_window(k, v)
        self._settle()
        return read

    def append_committed(self, k: A, v: A) -> Read[A]:
        """READ-4 on the storage held, then the switch."""
        self._check_convertible(k, v)
        read = self.storage.append_committed(k, v)
        self._settle()
        return read

    def read_block(self, k: A, v: A) -> Read[A]:
        """READ-5 on the storage held; it appends nothing, so nothing converts."""
        return self.storage.read_block(k, v)

    def _first_window_storage(self, read: str) -> Cache[A]:
        if self._plain is None:
            raise ValueError(f"{read} reads a sequence's first window; this cache has converted")
        return self._plain

    def append_bidirectional(self, k: A, v: A, bidirectional: A) -> Read[A]:
        """READ-6: plain storage only, then the switch."""
        self._check_convertible(k, v)
        read = self._first_window_storage("append_bidirectional").append_bidirectional(
            k, v, bidirectional
        )
        self._settle()
        return read

    def append_encoder_window(self, k: A, v: A, bidirectional: A) -> Read[A]:
        """READ-6: plain storage only, then the switch."""
        self._check_convertible(k, v)
        read = self._first_window_storage("append_encoder_window").append_encoder_window(
            k, v, bidirectional
        )
        self._settle()
        return read

    def prepare_decode_step(self) -> DecodePlan:
        """COMPILE-2 on the storage held (B16F-2)."""
        return self.storage.prepare_decode_step()

    def decode_slot(self, plan: DecodePlan) -> DecodeSlot:
        """COMPILE-3: the held storage's slot; the switch changes its key."""
        return self.storage.decode_slot(plan)

    def decode_inputs(self, plan: DecodePlan) -> tuple[A, ...]:
        return self.storage.decode_inputs(plan)

    def commit_decode_step(self, slot: DecodeSlot, outputs: Sequence[A]) -> None:
        """COMPILE-5 on the storage held, then the switch the append owes (B16F-2): plain
        storage's outputs are the new position's k and v, checked as convertible first
        (B16F-3)."""
        if self._plain is not None:
            self._check_convertible(*outputs)
        self.storage.commit_decode_step(slot, outputs)
        self._settle()

    def max_append_tokens(self) -> float:
        """B16F-5: positions an append may add before the switch, start - offset; math.inf
        once converted or when the start is already reached."""
        if self._plain is not None and self._plain.offset < self.start:
            return self.start - self._plain.offset
        return math.inf

    def is_trimmable(self) -> bool:
        return self.storage.is_trimmable()

    def trim(self, n: int) -> int:
        """The storage's trim; never converts back (B16F-2)."""
        return self.storage.trim(n)

    def make_mask(self, n: int, window_size: int | None) -> Mask:
        return self.storage.make_mask(n, window_size)

    def check(self) -> None:
        """DEFER-3: the converted storage checks as this cache's `checks` says."""
        self.storage.check()

    def bytes_per_token(self) -> int:
        return self.storage.bytes_per_token()

    def signature(self) -> str:
        """CACHE-7: "kv:bf16-first:" and the storage's signature."""
        return f"kv:bf16-first:{self.storage.signature()}"

    def state(self) -> CacheState[A]:
        """B16F-6: the storage's state; its signature says which storage it is."""
        return self.storage.state()

    def restore_state(self, state: CacheState[A]) -> None:
        """B16F-6: adopt plain or converted storage by the state's signature; plain
        storage that is already due converts now."""
        plain, converted = self._new_plain(), self._new_converted()
        if state.signature == plain.signature():
            restored = plain
        elif state.signature == converted.signature():
            restored = converted
        else:
            raise ValueError(
                f"state of {state.signature!r} is neither {plain.signature()!r} nor "
                f"{converted.signature()!r}"
            )
        restored.restore_state(state)
        layout = restored.layout
        if (
            self.head_dim is not None
            and layout is not None
            and (layout.k_dim != self.head_dim or layout.v_dim != self.head_dim)
        ):
            raise ValueError(f"{type(self).__name__} takes head_dim {self.head_dim}, got {layout}")
        if restored is plain:
            self._plain, self._converted = plain, None
            self._settle()
        else:
            self._plain, self._converted = None, converted

    def check_invariants(self) -> None:
        """B16F-2 invariants, then the storage's own."""
        if (self._plain is None) == (self._converted is None):
            raise AssertionError("a bf16-first cache holds exactly one storage")
        if self._plain is not None and transition_due(self._plain.offset, self.start):
            raise AssertionError("plain storage is held past its transition")
        self.storage.check_invariants()


class Bf16FirstQuantizedKVCache(Bf16FirstCache):
    """KVCache, then QuantizedKVCache(group_size, bits) (B16F-2)."""

    #: The two storages; the MLX backend binds its own.
    plain_kind: type[KVCache] = KVCache
    converted_kind: type[QuantizedKVCache] = QuantizedKVCache

    def __init__(self, group_size: int, bits: int, start: int, checks: str = "eager") -> None:
        self.group_size = group_size
        self.bits = bits
        check_affine_parameters(group_size, bits)
        super().__init__(start, checks)

    def _new_plain(self) -> KVCache:
        return self.plain_kind()

    def _new_converted(self) -> QuantizedKVCache:
        return self.converted_kind(self.group_size, self.bits, self.checks)

    def _convert(self, plain: Cache[np.ndarray]) -> QuantizedKVCache:
        assert isinstance(plain, self.plain_kind)
        return plain.to_quantized(self.group_size, self.bits, self.checks)


class Bf16FirstRotatingQuantizedKVCache(Bf16FirstCache):
    """RotatingKVCache(max_size), then RotatingQuantizedKVCache (B16F-2). A committed span
    is one decode per position through this cache, so the switch falls where that many
    decodes put it (READ-4)."""

    plain_kind: type[RotatingKVCache] = RotatingKVCache
    converted_kind: type[RotatingQuantizedKVCache] = RotatingQuantizedKVCache
    positionwise_read: type[PositionwiseRead] = PositionwiseRead

    def __init__(
        self, max_size: int, group_size: int, bits: int, start: int, checks: str = "eager"
    ) -> None:
        self.max_size = max_size
        self.group_size = group_size
        self.bits = bits
        check_affine_parameters(group_size, bits)
        super().__init__(start, checks)

    def _new_plain(self) -> RotatingKVCache:
        return self.plain_kind(self.max_size)

    def _new_converted(self) -> RotatingQuantizedKVCache:
        return self.converted_kind(self.max_size, self.group_size, self.bits, checks=self.checks)

    def _convert(self, plain: Cache[np.ndarray]) -> RotatingQuantizedKVCache:
        assert isinstance(plain, self.plain_kind)
        return plain.to_quantized(self.group_size, self.bits, self.checks)

    def append_committed(self, k: np.ndarray, v: np.ndarray) -> PositionwiseRead:
        """READ-4: one `append_decode` per position."""
        # check_append covers both storages: the switch may fall inside the span.
        self.check_append(k, v)
        reads = [
            self.append_decode(k[:, :, i : i + 1], v[:, :, i : i + 1]) for i in range(k.shape[2])
        ]
        return self.positionwise_read(tuple(reads))


class Bf16FirstKv4Head256Cache(Bf16FirstQuantizedKVCache):
    """Bf16FirstQuantizedKVCache at 4 bits, group 64, for head_dim 256 only (B16F-2)."""

    head_dim = 256

    def __init__(self, start: int, checks: str = "eager") -> None:
        super().__init__(64, 4, start, checks)


class Bf16FirstTurboQuantKVCache(Bf16FirstCache):
    """KVCache, then TurboQuantKVCache(k_bits, v_bits, kernels) (B16F-2): the cache the turbo
    scheme composes for full-attention layers (SCHEME-4)."""

    plain_kind: type[KVCache] = KVCache
    converted_kind: type[TurboQuantKVCache] = TurboQuantKVCache

    def __init__(
        self,
        k_bits: int,
        v_bits: int,
        start: int,
        kernels: str = "dense",
        checks: str = "eager",
    ) -> None:
        check_turboquant_parameters(k_bits, v_bits, kernels)
        self.k_bits = k_bits
        self.v_bits = v_bits
        self.kernels = kernels
        super().__init__(start, checks)

    def _new_plain(self) -> KVCache:
        return self.plain_kind()

    def _new_converted(self) -> TurboQuantKVCache:
        return self.converted_kind(self.k_bits, self.v_bits, self.kernels, self.checks)

    def _convert(self, plain: Cache[np.ndarray]) -> TurboQuantKVCache:
        assert isinstance(plain, self.plain_kind)
        return self.converted_kind.from_kv_cache(
            plain, self.k_bits, self.v_bits, self.kernels, self.checks
        )
