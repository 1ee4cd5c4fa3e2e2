"""A kvspec cache (spec chapter 5) that speaks mlx-lm's cache protocol, one per layer.

Appends go to the kvspec cache a KV storage scheme composes for the layer (SCHEME-3), and
attention to its read (`attention.PendingAttention`). `state` and `from_state` follow the
installed mlx-lm: 0.31 saves array-only states beside string `meta_state`s, 0.32 saves
strings inside `state`. Either way the arrays are the cache's CacheState arrays (CACHE-8)
and one JSON string records how to compose the cache again and its CacheState scalars,
so a bf16-first cache saved before its switch keeps its scheme and start (B16F-6).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as mlx_lm_cache

from kvspec.accelerated import caches, rows
from kvspec.accelerated.caches import masks
from kvspec.accelerated.mlx_lm import batch
from kvspec.accelerated.mlx_lm.attention import PendingAttention, route_attention

#: mlx-lm 0.31 keeps a cache's scalars in `meta_state` strings; 0.32 keeps them in `state`.
SEPARATE_META_STATE = hasattr(mlx_lm_cache._BaseCache, "meta_state")

#: Names the layout of the JSON string a saved cache carries.
STATE_FORMAT = "kvspec.mlx_lm/1"


@dataclass(frozen=True)
class CacheRecipe:
    """What composes a layer's cache (SCHEME-3): a scheme in its short form (SCHEME-2), the
    layer index, and the window of a sliding-window layer (None for full attention)."""

    scheme: str
    layer: int
    max_size: int | None = None

    def compose(self, start: int | None = None) -> caches.Cache:
        """An empty cache of this recipe (with another bf16-first `start`, if given). Its
        checks are deferred (DEFER-3): a generation step never waits for the device; `state`
        (saving, prefill) raises what was recorded."""
        scheme = caches.parse_scheme(self.scheme)
        if start is not None and not isinstance(scheme, caches.Bf16Scheme):
            scheme = dataclasses.replace(scheme, quantized_kv_start=start)
        if self.max_size is None:
            return caches.composed_full_attention_cache(scheme, self.layer, checks="deferred")
        return caches.composed_sliding_attention_cache(
            scheme, self.layer, self.max_size, checks="deferred"
        )


class KvspecCache:
    """One layer's kvspec cache, as mlx-lm's generate loop, prompt-cache files and trimming
    use a cache. `update_and_fetch` returns the append's read for keys and values, so the
    model's attention runs in kvspec (see `attention`)."""

    # Not a batch until `merge` (a cache built by `from_state` takes these too).
    rows_apart: list[caches.Cache] | None = None
    batched: bool = False
    right_padding: list[int] | None = None
    prepared_padding: tuple[int, ...] = ()

    def __init__(
        self,
        recipe: CacheRecipe,
        cache: caches.Cache | None = None,
        rows_apart: list[caches.Cache] | None = None,
        batched: bool = False,
    ) -> None:
        """A batch (`batched`, as `merge` builds it) speaks mlx-lm's batch protocol (see
        `batch`); `rows_apart` are its rows, held apart until the next append."""
        route_attention()
        self.recipe = recipe
        self.cache = recipe.compose() if cache is None else cache
        self.rows_apart = rows_apart
        self.batched = batched or rows_apart is not None

    @property
    def offset(self) -> int | mx.array:
        """Positions held; for a batch, per row (mlx-lm's batch caches give the model's
        RoPE an array): the row offsets (ROWS-5)."""
        if not self.batched:
            return self.cache.offset
        if self.rows_apart is not None:
            return mx.array([row.offset for row in self.rows_apart])
        if self.cache.layout is None:
            # Prepared left padding (ROWS-11): each row's first own position is 0.
            return mx.array([-count for count in self.prepared_padding])
        return mx.array(self.cache.row_offsets)

    def update_and_fetch(
        self, keys: mx.array, values: mx.array
    ) -> tuple[PendingAttention | batch.RowsAttention, PendingAttention | batch.RowsAttention]:
        """Append keys and values [B, H, L, D]: a decode read for one position (READ-2), a
        window read for more (READ-3). Rows held apart or right padded append alone, each
        without its padding, and are joined after it (see `batch`)."""
        B, _, L, _ = keys.shape
        if self.rows_apart is None and self.right_padding is None:
            if L == 1:
                read = self.cache.append_decode(keys, values)
            else:
                read = self.cache.append_window(keys, values)
            pending = PendingAttention(read, L)
            return pending, pending
        row_caches = self.rows_apart
        if row_caches is None:
            row_caches = batch.rows_apart(self.cache, self.recipe.compose)
        if len(row_caches) != B:
            raise ValueError(
                f"layer {self.recipe.layer}: an append of {B} rows to a batch of "
                f"{len(row_caches)} rows"
            )
        padding = self.right_padding or [0] * B
        rows_read = batch.append_rows(row_caches, keys, values, [L - p for p in padding])
        self.cache = batch.joined(row_caches, self.recipe.compose)
        self.rows_apart = None
        self.right_padding = None
        return rows_read, rows_read

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        """The mask of the next append of N positions (MASK-2, MASK-3), as mlx-lm's caches
        give it. The reads apply their cache's own window, so a model asking another one
        is refused rather than attended without it."""
        own = self.cache.sliding_window
        if window_size is not None and window_size != own:
            raise ValueError(
                f"layer {self.recipe.layer}: the model asks for an attention window of "
                f"{window_size}, its kvspec cache reads with "
                f"{'no window' if own is None else f'window {own}'}"
            )
        mask = self.cache.make_mask(N, window_size)
        if return_array and isinstance(mask, str):
            # "causal" on a ring means nothing was evicted yet: offset is what it holds.
            return masks.create_causal_mask(N, self.cache.offset, window_size)
        return mask

    def is_trimmable(self) -> bool:
        """Rows held apart are not trimmable until their next append joins them."""
        return self.rows_apart is None and self.cache.is_trimmable()

    def trim(self, n: int) -> int:
        return 0 if self.rows_apart is not None else self.cache.trim(n)

    def size(self) -> int:
        """Positions the cache holds for attention: offset, at most the window on a ring."""
        window = self.cache.sliding_window
        offset = self.cache.offset
        return offset if window is None else min(offset, window)

    def empty(self) -> bool:
        if self.rows_apart is not None:
            return all(row.layout is None for row in self.rows_apart)
        return self.cache.layout is None

    @property
    def nbytes(self) -> int:
        """Bytes of the stored fields a saved state holds (CACHE-8)."""
        held = [self.cache] if self.rows_apart is None else self.rows_apart
        return sum(array.nbytes for cache in held for array in cache.state().arrays)

    # mlx-lm's batch protocol (BatchKVCache, BatchRotatingKVCache) on kvspec's rows.

    @classmethod
    def merge(cls, caches_: Sequence[KvspecCache]) -> KvspecCache:
        """A batch of the rows of `caches_`, in order (ROWS-3, ROWS-9); the caches are
        unchanged. They must be kvspec caches of one scheme, layer and window."""
        first = caches_[0]
        for other in caches_:
            if not isinstance(other, KvspecCache) or other.recipe != first.recipe:
                raise ValueError(
                    f"layer {first.recipe.layer}: a batch joins kvspec caches of one recipe "
                    f"({first.recipe}), not {getattr(other, 'recipe', type(other).__name__)}"
                )
        if all(other.rows_apart is None and not other.empty() for other in caches_):
            merged = batch.joined([other.cache for other in caches_], first.recipe.compose)
            return cls(first.recipe, merged, batched=True)
        row_caches = [row for other in caches_ for row in other._rows()]
        return cls(first.recipe, rows_apart=row_caches)

    def _rows(self) -> list[caches.Cache]:
        """This cache's rows, each a single-row cache of its own, copies of the stored
        fields (ROWS-8)."""
        self._refuse_prepared_rows()
        if self.rows_apart is None:
            return batch.rows_apart(self.cache, self.recipe.compose)
        return [
            self.recipe.compose() if row.layout is None else rows.extract_row(row, 0)
            for row in self.rows_apart
        ]

    def _refuse_prepared_rows(self) -> None:
        if self.prepared_padding and self.cache.layout is None:
            raise ValueError(
                f"layer {self.recipe.layer}: a batch prepared with left padding (ROWS-11) "
                "takes its first append before its rows are filtered, extracted or merged"
            )

    def extend(self, other: KvspecCache) -> None:
        """The rows of `other` after this batch's, in place (ROWS-3, mlx-lm's `extend`)."""
        merged = type(self).merge([self, other])
        self.cache, self.rows_apart = merged.cache, merged.rows_apart

    def filter(self, batch_indices: Sequence[int]) -> None:
        """Keep rows `batch_indices`, in that order, in place; padding no kept row needs is
        dropped (ROWS-8, mlx-lm's `filter`)."""
        indices = [int(index) for index in batch_indices]
        self._refuse_prepared_rows()
        if self.rows_apart is not None:
            self.rows_apart = [self.rows_apart[index] for index in indices]
        elif self.cache.layout is not None:
            self.cache = rows.filter_rows(self.cache, indices)

    def extract(self, idx: int) -> KvspecCache:
        """Row `idx` as a cache of its own (ROWS-8): the cache that row would be alone."""
        self._refuse_prepared_rows()
        if self.rows_apart is not None:
            return kvspec_cache(self.recipe, self._rows()[idx])
        return kvspec_cache(self.recipe, rows.extract_row(self.cache, idx))

    def prepare(
        self,
        *,
        left_padding: Sequence[int] | None = None,
        lengths: Sequence[int] | None = None,
        right_padding: Sequence[int] | None = None,
    ) -> None:
        """mlx-lm's `prepare`: `left_padding` before the first append (ROWS-11);
        `right_padding` (with `lengths`) for the next append, whose rows then append
        alone, each without its padding (see `batch`)."""
        if left_padding is not None:
            if not self.empty():
                raise ValueError(
                    f"layer {self.recipe.layer}: left padding is for a batch holding nothing "
                    "(ROWS-11)"
                )
            self.prepared_padding = tuple(int(count) for count in left_padding)
            self.cache, self.rows_apart = self.recipe.compose(), None
            self.cache.prepare(left_padding=self.prepared_padding)
        if right_padding is not None and max(right_padding) > 0:
            self.right_padding = [int(count) for count in right_padding]

    def finalize(self) -> None:
        """mlx-lm's `finalize`: nothing to roll, a right-padded append left its rows left
        padded (see `batch`)."""
        self.right_padding = None

    @property
    def bf16_nbytes(self) -> int:
        """Bytes the positions this cache holds would take as bfloat16 keys and values."""
        layout = self.cache.layout
        if layout is None:
            return 0
        return self.size() * layout.batch * layout.kv_heads * (layout.k_dim + layout.v_dim) * 2

    def _joined(self) -> caches.Cache:
        if self.rows_apart is not None:
            raise ValueError(
                f"layer {self.recipe.layer}: a batch holds its rows apart until its next "
                "append; it has no state of one cache before it"
            )
        return self.cache

    def _meta(self, state: caches.CacheState) -> str:
        return json.dumps(
            {
                "format": STATE_FORMAT,
                "scheme": self.recipe.scheme,
                "layer": self.recipe.layer,
                "max_size": self.recipe.max_size,
                "signature": state.signature,
                "offset": state.offset,
                "ring_index": state.ring_index,
                "minimum_reusable_offset": state.minimum_reusable_offset,
                "left_padding": list(state.left_padding),
            }
        )

    @property
    def state(self) -> tuple[Any, ...]:
        """The CacheState arrays, after the JSON string of `meta_state` on mlx-lm 0.32."""
        state = self._joined().state()
        if SEPARATE_META_STATE:
            return state.arrays
        return (self._meta(state), *state.arrays)

    @state.setter
    def state(self, value: Sequence[Any]) -> None:
        if SEPARATE_META_STATE:
            # mlx-lm 0.31 sets meta_state next, which restores.
            self._pending_arrays = tuple(value)
            return
        self._restore(value[0], tuple(value[1:]))

    @property
    def meta_state(self) -> tuple[str]:
        return (self._meta(self._joined().state()),)

    @meta_state.setter
    def meta_state(self, value: Sequence[str]) -> None:
        arrays = getattr(self, "_pending_arrays", None)
        if arrays is None:
            arrays = self.cache.state().arrays
        self._pending_arrays = None
        self._restore(value[0], arrays)

    def _restore(self, meta: str, arrays: tuple[mx.array, ...]) -> None:
        fields = json.loads(meta)
        if fields.get("format") != STATE_FORMAT:
            raise ValueError(f"not a kvspec cache state: format {fields.get('format')!r}")
        recipe = CacheRecipe(fields["scheme"], fields["layer"], fields["max_size"])
        cache = recipe.compose()
        cache.restore_state(
            caches.CacheState(
                fields["signature"],
                arrays,
                fields["offset"],
                fields["ring_index"],
                fields["minimum_reusable_offset"],
                tuple(fields.get("left_padding", ())),
            )
        )
        route_attention()
        self.recipe, self.cache = recipe, cache

    @classmethod
    def from_state(cls, state: Sequence[Any], meta_state: Sequence[str] | None = None) -> Any:
        """A cache adopting a saved `state` (and, on mlx-lm 0.31, `meta_state`)."""
        cache = cls.__new__(cls)
        cache.state = state
        if meta_state is not None:
            cache.meta_state = meta_state
        return cache


class KvspecPlainCache(KvspecCache):
    """A layer whose scheme keeps keys and values as given (KVCache, RotatingKVCache):
    mlx-lm's `kv_bits` converts it, as it converts mlx-lm's own caches."""

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> KvspecCache:
        """This layer's positions in the affine format: the cache `affine:BITS:GROUP`
        composes, restored from this one's state, so it converts at once (B16F-6) and, for
        a ring, keeps its window (QRING-2); a batch stays a batch, its padding kept
        (ROWS-10). This cache is left as it was."""
        recipe = CacheRecipe(f"affine:{bits}:{group_size}", self.recipe.layer, self.recipe.max_size)
        converted = recipe.compose()
        converted.restore_state(self._joined().state())
        return KvspecCache(recipe, converted, batched=self.batched)


def kvspec_cache(recipe: CacheRecipe, cache: caches.Cache | None = None) -> KvspecCache:
    """The cache of `recipe` (holding `cache`, else empty), convertible by `kv_bits` when it
    stores keys and values as given."""
    cache = recipe.compose() if cache is None else cache
    if isinstance(cache, caches.KVCache | caches.RotatingKVCache):
        return KvspecPlainCache(recipe, cache)
    return KvspecCache(recipe, cache)


# mlx-lm's load_prompt_cache finds a saved cache's class by name in its cache module.
for _cls in (KvspecCache, KvspecPlainCache):
    if not hasattr(mlx_lm_cache, _cls.__name__):
        setattr(mlx_lm_cache, _cls.__name__, _cls)
