"""Independent models of every cache kind (spec CACHE-3 .. CACHE-9, QKV-1, RING-1 .. RING-6,
QRING-1, TQC-1 .. TQC-5, B16F-1 .. B16F-6, READ-2 .. READ-6, MASK-1 .. MASK-3).

Both backends run the cache state machines of `kvspec.reference.caches` (the MLX classes
subclass them), so holding one against the other cannot see a fault in them. These
models share no code with that package: each keeps the positions a cache should hold as
a plain list in temporal order, and states each rule as the spec words it:

- growable kinds hold every appended position that was not trimmed (CACHE-3, CACHE-5);
- a ring holds its first `keep` positions and its most recent ones: an append to a ring
  holding max_size or more first keeps the first `keep` and the last max_size - 1 - keep
  (RING-2 and RING-3 agree on this), so a one-position append leaves max_size positions
  and an L-position one max_size - 1 + L; beside the list, the position each entry holds;
  a query at position p sees a held position j <= p that is kept (j < keep) or one of
  the last max_size - keep, or with a window w, one of the last w (MASK-3);
- quantized kinds hold that list passed through the codec, one position at a time
  (QKV-1, QRING-1, TQC-1); the codecs themselves are held by the golden vectors;
- a bf16-first cache is a plain model until an append leaves it due, then the converted
  model of the same list (B16F-1, B16F-2).

A ring's stored rows are in ring order; `temporal` puts rows back into the order of the
list with the ring index (RING-4), so the models never compute a ring layout.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvspec.reference import affine, turboquant
from kvspec.reference import caches as reference

#: One position's stored fields, each [B, H, 1, *].
Fields = tuple[np.ndarray, ...]


class PlainCodec:
    """Keys and values stored as given (CACHE-3, RING-1)."""

    signature = ""

    def encode(self, k: np.ndarray, v: np.ndarray) -> Fields:
        return (k, v)

    def decode(self, fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        return fields[0], fields[1]


@dataclass(frozen=True)
class AffineCodec:
    """The six affine fields (QKV-1): k_words, k_scales, k_biases, v_words, v_scales,
    v_biases."""

    group_size: int
    bits: int

    @property
    def signature(self) -> str:
        return f"{self.bits}:{self.group_size}"

    def encode(self, k: np.ndarray, v: np.ndarray) -> Fields:
        return (
            *affine.quantize(k, self.group_size, self.bits),
            *affine.quantize(v, self.group_size, self.bits),
        )

    def decode(self, fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        keys = affine.dequantize(*fields[:3], self.group_size, self.bits)
        values = affine.dequantize(*fields[3:], self.group_size, self.bits)
        return keys, values


@dataclass(frozen=True)
class TurboQuantCodec:
    """The five TurboQuant fields (TQC-5): k_idx, k_scales, k_zeros, v_packed, v_scales."""

    k_bits: int
    v_bits: int
    deferred: bool

    @property
    def signature(self) -> str:
        return f"{self.k_bits}:{self.v_bits}"

    def encode(self, k: np.ndarray, v: np.ndarray) -> Fields:
        t = turboquant.encode(k, v, self.k_bits, self.v_bits)
        return (t.k_idx, t.k_scales, t.k_zeros, t.v_packed, t.v_scales)

    def decode(self, fields: Fields) -> tuple[np.ndarray, np.ndarray]:
        t = turboquant.TurboQuantTensor(*fields)
        head_dim = t.k_scales.shape[-1] * turboquant.BLOCK_SIZE
        return turboquant.decode(t, t.k_idx.shape[2], head_dim)


Codec = PlainCodec | AffineCodec | TurboQuantCodec


@dataclass(frozen=True)
class ExpectedRead:
    """Keys and values [B, Hk, T, *] in temporal order and which of them each query sees,
    visible [N, T]; `deferred` for TurboQuant's deferred kernels (TQC-4)."""

    keys: np.ndarray
    values: np.ndarray
    visible: np.ndarray
    deferred: bool = False

    def tolerance(self) -> float:
        """How far the reference's float32 read may lie from `attend`: its rounding to
        float32 (CONV-2), and for deferred kernels TQC-4's dense-deferred tolerance
        (2 2^-24 + 2 t (1 + 2^-24)) R, t = (log2 D + 1) 2^-24, R the largest value norm."""
        values = self.values.astype(np.float64)
        # Relative, and float32's smallest subnormal for outputs below its normal range.
        rounding = 2.0**-22 * np.abs(values).max(initial=0.0) + 2.0**-149
        if not self.deferred:
            return rounding
        t = (np.log2(values.shape[-1]) + 1) * 2.0**-24
        R = np.linalg.norm(values, axis=-1).max(initial=0.0) * (1 + 2.0**-20)
        return rounding + (2 * 2.0**-24 + 2 * t * (1 + 2.0**-24)) * R

    def attend(self, queries: np.ndarray, scale: float) -> np.ndarray:
        """softmax(scale q k^T over visible keys) v in float64 (READ-1)."""
        group = queries.shape[1] // self.keys.shape[1]
        keys = np.repeat(self.keys.astype(np.float64), group, axis=1)
        values = np.repeat(self.values.astype(np.float64), group, axis=1)
        scores = np.einsum("bhnd,bhtd->bhnt", queries.astype(np.float64), keys) * scale
        scores = np.where(self.visible, scores, -np.inf)
        weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        return np.einsum("bhnt,bhtd->bhnd", weights, values)


def causal(n: int, before: int, window: int | None) -> np.ndarray:
    """Entry `before + i` of a list sees entry j iff j <= before + i and, with a window,
    before + i - j < window (MASK-1), as bool [n, before + n]."""
    query = before + np.arange(n)[:, None]
    key = np.arange(before + n)[None, :]
    return (key <= query) & ((query - key < window) if window is not None else True)


def visible_matrix(mask: Any, n: int, t: int, to_numpy: Any = np.asarray) -> np.ndarray:
    """A read's mask as bool [n, t] (MASK-1): None sees every key, "causal" aligns the last
    query with the last key, an array [t] or [n, t] broadcasts."""
    if mask is None:
        return np.ones((n, t), bool)
    if isinstance(mask, str):
        assert mask == "causal", mask
        return causal(n, t - n, None)
    array = to_numpy(mask)
    assert array.dtype == np.bool_ and array.shape in ((t,), (n, t)), (array.dtype, array.shape)
    return np.broadcast_to(array, (n, t))


def temporal(rows: np.ndarray, ring_index: int, keep: int) -> np.ndarray:
    """Live ring rows [B, H, T, *] in temporal order (RING-4): as they are while the ring
    index is past them; once it wrapped, the first keep, then from the ring index on,
    then keep up to the ring index."""
    if ring_index >= rows.shape[2]:
        return rows
    order = [*range(keep), *range(ring_index, rows.shape[2]), *range(keep, ring_index)]
    return rows[:, :, order]


@dataclass
class CacheModel:
    """One cache kind as a list of positions (growable unless `max_size` is set)."""

    codec: Codec
    kind: str
    max_size: int | None = None
    keep: int = 0
    offset: int = 0
    minimum_reusable_offset: int = 0
    held: list[Fields] = field(default_factory=list)
    #: The position each entry of `held` holds (on a ring, kept ones and recent ones).
    positions: list[int] = field(default_factory=list)
    #: Whether anything was appended (trimming to 0 keeps empty fields, CACHE-8).
    stored: bool = False
    #: Rows of growable fields (CACHE-3): whole steps of 256, cut to the offset first when
    #: it is off a step; a restore or a conversion leaves exactly the offset (CACHE-8).
    capacity: int = 0
    #: fields() and window() of the positions held now (cleared by every change).
    _memo: dict[str, Any] = field(default_factory=dict, repr=False)

    def signature(self) -> str:
        """CACHE-7."""
        if self.max_size is None:
            return f"kv:{self.kind}:{self.codec.signature}" if self.kind else "kv"
        ring = "rotating-affine" if self.kind else "rotating"
        tail = f":{self.codec.signature}" if self.kind else ""
        return f"kv:{ring}:{self.max_size}:{self.keep}{tail}"

    def is_trimmable(self) -> bool:
        """CACHE-5, RING-5."""
        return self.max_size is None or self.offset < self.max_size

    def trim(self, n: int) -> int:
        trimmed = min(n, self.offset)
        self._memo.clear()
        self.offset -= trimmed
        del self.held[len(self.held) - trimmed :]
        del self.positions[len(self.positions) - trimmed :]
        return trimmed

    def append(self, k: np.ndarray, v: np.ndarray) -> ExpectedRead:
        """Append L positions; the causal (windowed, on a ring) read of them."""
        L = k.shape[2]
        self._memo.clear()
        if not self.stored or self.offset + L > self.capacity:
            kept = self.capacity if self.offset % 256 == 0 else self.offset
            self.capacity = kept + -(-L // 256) * 256
        if self.max_size is not None and len(self.held) >= self.max_size:
            recent = len(self.held) - (self.max_size - 1 - self.keep)
            self.held = self.held[: self.keep] + self.held[recent:]
            self.positions = self.positions[: self.keep] + self.positions[recent:]
        for i in range(k.shape[2]):
            self.held.append(self.codec.encode(k[:, :, i : i + 1], v[:, :, i : i + 1]))
            self.positions.append(self.offset + i)
        self.offset += k.shape[2]
        self.stored = True
        return self.read(self.visible(L, None))

    def visible(self, n: int, window: int | None) -> np.ndarray:
        """Which held entries each of the last `n` appended positions sees, bool
        [n, len(held)] (MASK-2, MASK-3): entries up to its own position, and within a
        window: `window` if given, else on a ring the kept positions and the last
        max_size - keep."""
        query = np.array(self.positions[len(self.positions) - n :])[:, None]
        key = np.array(self.positions)[None, :]
        if window is not None:
            in_window = query - key < window
        elif self.max_size is not None:
            in_window = (key < self.keep) | (query - key < self.max_size - self.keep)
        else:
            in_window = np.ones_like(key, dtype=bool)
        return (key <= query) & in_window

    def fields(self) -> Fields:
        """The held positions' stored fields, [B, H, len(held), *] each."""
        if "fields" not in self._memo:
            slots = zip(*self.held, strict=True)
            self._memo["fields"] = tuple(np.concatenate(slot, axis=2) for slot in slots)
        return self._memo["fields"]

    def window(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The held positions decoded, in temporal order; None when nothing is held."""
        if not self.held:
            return None
        if "window" not in self._memo:
            self._memo["window"] = self.codec.decode(self.fields())
        return self._memo["window"]

    def is_empty(self) -> bool:
        """Whether the cache stores no fields at all (CACHE-8)."""
        return not self.stored

    def read(self, visible: np.ndarray) -> ExpectedRead:
        keys, values = self.window()  # type: ignore[misc]
        deferred = isinstance(self.codec, TurboQuantCodec) and self.codec.deferred
        return ExpectedRead(keys, values, visible, deferred)

    def block(self, k: np.ndarray, v: np.ndarray) -> ExpectedRead:
        """READ-5: the held window, then the block; every key visible."""
        stored = self.window() or (k[:, :, :0], v[:, :, :0])
        keys = np.concatenate([stored[0].astype(np.float64), k.astype(np.float64)], axis=2)
        values = np.concatenate([stored[1].astype(np.float64), v.astype(np.float64)], axis=2)
        return ExpectedRead(keys, values, np.ones((k.shape[2], keys.shape[2]), bool))

    def converted(self, codec: Codec, kind: str) -> CacheModel:
        """CACHE-9: the same positions through another codec."""
        held = [codec.encode(*self.codec.decode(position)) for position in self.held]
        return CacheModel(
            codec,
            kind,
            self.max_size,
            self.keep,
            self.offset,
            self.minimum_reusable_offset,
            held,
            list(self.positions),
            self.stored,
            self.offset,
        )

    def restored(self) -> None:
        """CACHE-8: a restore keeps every position; growable fields hold exactly the offset."""
        self.capacity = self.offset


@dataclass
class Bf16FirstModel:
    """Plain until an append leaves offset >= start (and not 0), then converted (B16F-1,
    B16F-2); the due append's read is plain. Rotating kinds commit a span one decode at
    a time (READ-4)."""

    model: CacheModel
    target: Codec
    target_kind: str
    start: int
    positionwise_commit: bool
    converted: bool = False

    @property
    def offset(self) -> int:
        return self.model.offset

    @property
    def minimum_reusable_offset(self) -> int:
        return self.model.minimum_reusable_offset

    @property
    def max_size(self) -> int | None:
        return self.model.max_size

    @property
    def keep(self) -> int:
        return self.model.keep

    @property
    def held(self) -> list[Fields]:
        return self.model.held

    def signature(self) -> str:
        return f"kv:bf16-first:{self.model.signature()}"

    def is_trimmable(self) -> bool:
        return self.model.is_trimmable()

    def trim(self, n: int) -> int:
        return self.model.trim(n)

    def append(self, k: np.ndarray, v: np.ndarray) -> ExpectedRead:
        read = self.model.append(k, v)
        offset = self.model.offset
        if not self.converted and offset >= self.start and offset != 0:
            self.model = self.model.converted(self.target, self.target_kind)
            self.model.minimum_reusable_offset = offset if self.start > 0 else 0
            self.converted = True
        return read

    def visible(self, n: int, window: int | None) -> np.ndarray:
        return self.model.visible(n, window)

    def fields(self) -> Fields:
        return self.model.fields()

    def window(self) -> tuple[np.ndarray, np.ndarray] | None:
        return self.model.window()

    def is_empty(self) -> bool:
        return self.model.is_empty()

    @property
    def capacity(self) -> int:
        return self.model.capacity

    def restored(self) -> None:
        self.model.restored()

    def block(self, k: np.ndarray, v: np.ndarray) -> ExpectedRead:
        return self.model.block(k, v)


Model = CacheModel | Bf16FirstModel


def model_of(cache: Any) -> Model:
    """The model of a freshly constructed reference cache (its class and parameters)."""
    if isinstance(cache, reference.Bf16FirstCache):
        plain = CacheModel(PlainCodec(), "", getattr(cache, "max_size", None))
        if isinstance(cache, reference.Bf16FirstTurboQuantKVCache):
            target: Codec = TurboQuantCodec(cache.k_bits, cache.v_bits, cache.kernels == "deferred")
            kind = "turboquant"
        else:
            target, kind = AffineCodec(cache.group_size, cache.bits), "affine"
        rotating = isinstance(cache, reference.Bf16FirstRotatingQuantizedKVCache)
        return Bf16FirstModel(plain, target, kind, cache.start, rotating)
    if isinstance(cache, reference.RotatingKVCache):
        return CacheModel(PlainCodec(), "", cache.max_size, cache.keep)
    if isinstance(cache, reference.RotatingQuantizedKVCache):
        codec = AffineCodec(cache.group_size, cache.bits)
        return CacheModel(codec, "affine", cache.max_size, cache.keep)
    if isinstance(cache, reference.QuantizedKVCache):
        return CacheModel(AffineCodec(cache.group_size, cache.bits), "affine")
    if isinstance(cache, reference.TurboQuantKVCache):
        codec = TurboQuantCodec(cache.k_bits, cache.v_bits, cache.kernels == "deferred")
        return CacheModel(codec, "turboquant")
    if isinstance(cache, reference.KVCache):
        return CacheModel(PlainCodec(), "")
    raise TypeError(f"no model of {type(cache).__name__}")


def plain_model(model: Model) -> CacheModel:
    """The list of positions under a model: its own, or a bf16-first model's held one."""
    return model.model if isinstance(model, Bf16FirstModel) else model


@dataclass
class RowsModel:
    """Rows of their own lengths (ROWS-5 .. ROWS-11): one model per row, each the list of
    that row's own positions. Each row's padding is how much shorter it is than the
    longest row. A bf16-first batch switches as one, when its longest row is due (ROWS-7):
    a row's model is due once its offset plus its padding reaches the start. A ring row
    taken out, or aligned by a merge, keeps its window: its last max_size positions
    (ROWS-8, ROWS-9)."""

    rows: list[Model]
    #: The bf16-first batch's start (B16F-1); None for other kinds.
    start: int | None = None

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(row.offset for row in self.rows)

    @property
    def left_padding(self) -> tuple[int, ...]:
        longest = max(self.offsets)
        return tuple(longest - offset for offset in self.offsets)

    def follow(self, padding: tuple[int, ...], cut: bool) -> None:
        """Rows padded by `padding` from now on; with `cut`, ring rows keep their window."""
        for row, pad in zip(self.rows, padding, strict=True):
            if isinstance(row, Bf16FirstModel) and not row.converted:
                assert self.start is not None
                row.start = self.start - pad
            plain = plain_model(row)
            if cut and plain.max_size is not None and len(plain.held) > plain.max_size:
                plain.held = plain.held[-plain.max_size :]
                plain.positions = plain.positions[-plain.max_size :]
                plain._memo.clear()

    def trim(self, n: int) -> int:
        """ROWS-7: every row loses min(n, the shortest row's offset)."""
        trimmed = min(n, min(self.offsets))
        for row in self.rows:
            row.trim(trimmed)
        return trimmed

    def filter(self, indices: list[int], cut: bool) -> None:
        """ROWS-8: rows `indices` (repeats are copies), padding no kept row needs dropped."""
        self.rows = [copy.deepcopy(self.rows[i]) for i in indices]
        self.follow(self.left_padding, cut)

    def extend(self, row: Model, cut: bool) -> None:
        """ROWS-9: `row` joins after the others."""
        self.rows.append(row)
        self.follow(self.left_padding, cut)
