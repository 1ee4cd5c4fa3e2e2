"""Decode attention over stored fields, as two CUDA kernels (spec READ-7).

One query position attends over every stored position of a cache without decoding the
window into memory first. Keys and values are read where they lie: the growable buffer
up to the offset (a strided view, never copied), affine words with their scales and
biases, TurboQuant codes with their scales and zero points, apart or side by side in one
record per row (accelerated/records.py; `record_pass` reads each field at its offset).
Each element is decoded in registers to exactly the operand the reference's attention
sees (AFF-6's two roundings in the scales' format, TQ-5's `(code + zero) * scale`, TQ-8's
`centroid * scale` in the rotated domain), so only the attention arithmetic itself
departs from the reference, within READ-1's bound; TurboQuant's 8-bit keys on tensor
cores enter as their codes, and each group's zero and scale complete its partial score;
so do affine values there, their scales in the weights and their biases summed apart.

Pass 1 (split-K, as FlashDecoding): the live positions are cut into splits, as many as
the live count alone asks for (`_splits`: never the buffer's capacity nor the batch), so
that equal rows read alike whatever buffer holds them; a launch has room for the splits of
its buffer's whole length, and a block past the live count's splits reads nothing. A block of
WARPS warps takes one split of one KV head and serves every query head that reads that
head (GQA), so each stored byte is read once. The warps of a block merge in shared memory
and write one partial (max, sum, weighted values) per split. Pass 1 has two bodies:
- on tensor cores (the default where `tensor_core_fit`): a warp takes 8 positions at a
  time; S = Q K^T and O^T += V^T P^T are TF32 MMAs (m16n8k8) with float32 accumulation,
  the lanes laid out so that the scores leave each lane holding exactly the weights its
  next MMA needs (no shuffle of weights), and the softmax runs once per 8 positions;
  keys that decode to 16-bit values of the queries' format (plain bfloat16 or float16,
  affine in whole pairs) score on 16-bit MMAs (m16n8k16) instead, half as many, of exact
  products, the softmax scale applied to each float32 score; so do TurboQuant's 8-bit
  keys, group by group: a lane holds 8 codes of each 32-element group (each k-step in
  one group) as float16 1152 + code, against the query scaled by its head's power of two
  and rounded to float16, and the lane that holds a score applies each group's zero
  (times the group's query sum) and scale to the group's partial sum; affine values of
  2, 4 or 8 bits (`scaled_weights`) enter as their codes, 2^bits + code, against each
  weight times its row's group scale, the value MMA's columns being query heads of one
  group each (a query head's row repeated in the score MMA for each group), and the
  weights times the biases are summed apart: a decode of two instructions an element;
- on CUDA cores: lane l of a warp owns elements [l E, l E + E) of a row (E = D / 32); a
  warp takes every WARPS-th position of the split, STAGE at a time, loading the next
  stage's raw words before it decodes this one; the stage's dot products reduce together
  (5 + G shuffles each) and update one online softmax.
Either way the decode avoids conversion instructions, which run at a quarter of the
float32 rate: codes become floats through the bits of 2^23 + c, and AFF-6 runs on pairs
in the scales' 16-bit format.
Pass 2 merges the splits of each query head and, for TurboQuant values, unrotates the
output row once (TQ-8): the Hadamard butterflies, 1/sqrt(D), then the signs. It is bound
by its loads' latency, not their bytes: a block of about MERGE_THREADS threads takes a
head, each split's weight is computed once, and each output element is summed by
`_merge_parts` threads over a share of the splits each.

The CUDA code is accelerated/cuda/decode_attention.cuh (partial_pass, merge_pass); the
kernels handed to MLX include it and call into it, so that the source MLX builds and
hashes at every call is a few hundred bytes (cuda_source.included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from kvspec.accelerated.cuda_source import KERNELS_MADE, Constant, cuda_kernel, included
from kvspec.accelerated.device import cuda_available
from kvspec.accelerated.turboquant_kernels import CODEBOOK, SIGNS, constants_header
from kvspec.reference.turboquant_tables import INV_SQRT_BITS

#: Storage formats of one side (keys or values) of a cache.
PLAIN = 0  # the input dtype, as appended
AFFINE = 1  # uint32 words, scales and biases in the input dtype (AFF-5)
TURBO_KEY = 2  # int8 codes (8 bits) or packed unsigned codes, float16 scales, zeros (TQ-4)
TURBO_VALUE = 3  # packed codebook indices, float16 scales, rotated domain (TQ-7)

WARPS = 4
#: Positions a warp reads and reduces together (pass 1).
STAGE = 4
#: A split takes at least this many positions; at most MAX_SPLITS splits per head; about
#: TARGET_BLOCKS blocks in all (four per SM of an H200 hold one resident wave).
MIN_SPLIT = 64
MAX_SPLITS = 128
TARGET_BLOCKS = 528
#: Threads of the merge per query head (pass 2 is bound by its loads' latency: more threads
#: keep more in flight).
MERGE_THREADS = 1024
#: Pass 1's blocks resident per SM that TARGET_BLOCKS counts on; the variants that took more
#: registers than that leaves them are compiled to fit (`_launch_bounds`).
BLOCKS_PER_SM = 4
#: The largest head dim and query heads per KV head of the variants held to BLOCKS_PER_SM:
#: those whose eager variants were measured to fit it (119 to 128 registers a thread at head
#: dim 128, four query heads per KV head, on the H200).
BOUNDED_DIM = 128
BOUNDED_GROUP = 4


def _bounded(mma: bool, slot: bool, ordered: bool) -> bool:
    # The variants whose builds without bounds took more than 128 registers a thread (nvcc
    # for sm_90a, `tools/cuda_build.py`): the slot variant (affine 8-bit 139), and the
    # CUDA-core body's ordered variant (affine 4-bit 136, 8-bit 133). The others fit as they
    # are, and bounds would change the code the H200 measured.
    return slot or (ordered and not mma)


def _launch_bounds(plan: _Plan) -> str:
    """The header line that holds a variant to BLOCKS_PER_SM blocks an SM: the compiler gave
    the slot variant more registers than the eager variant (affine 8-bit 139 against 119 at
    head dim 128), which left room for three blocks, not four, and took 35% longer. MLX
    writes the kernel's declaration after the header, with CUDA's `__global__`, which this
    redefines; nothing for plans no eager variant was measured to fit."""
    constants = dict(plan.partial_constants)
    if max(constants["DK"], constants["DV"]) > BOUNDED_DIM or constants["G"] > BOUNDED_GROUP:
        return ""
    return (
        "#undef __global__\n"
        "#define __global__ __location__(global) "
        f"__launch_bounds__({WARPS * 32}, {BLOCKS_PER_SM})\n"
    )


#: The query heads one block serves and the head dims the kernels take.
MAX_GROUP = 8
HEAD_DIMS = (32, 64, 96, 128, 160, 192, 256, 512)

#: The kernels' code, which every kernel MLX builds includes: the source MLX builds and
#: hashes at every call is then the call alone (cuda_source.included).
_INCLUDE = included("decode_attention.cuh")

#: The group fields a side's format stores: (scales, biases).
_GROUP_FIELDS = {PLAIN: (False, False), AFFINE: (True, True), TURBO_KEY: (True, True)}
_GROUP_FIELDS[TURBO_VALUE] = (True, False)


def _merge_call(rotated: bool) -> str:
    """The body of a merge kernel; without rotation it reads no signs (a null pointer)."""
    return (
        "kvspec_attn::merge_pass<DV, PARTS, MAX_SPLITS, ROTATED, OT, INV_SQRT_BITS>("
        f"partial, partial_shape, {SIGNS if rotated else 'nullptr'}, out);"
    )


# The template constants of pass 1 (_plan) in the order partial_pass takes them.
_PARTIAL_CONSTANTS = (
    "QT, KC, VC, KS, VS, DK, DV, G, WARPS, STAGE, KFMT, KBITS, KGROUP, VFMT, VBITS, VGROUP, "
    "TABLE, SCALE_BITS, SCALED, MIN_SPLIT, MOST_SPLITS"
)


def _pass_inputs(
    key_fmt: int, value_fmt: int, counted: bool, slot: bool, record: bool, ordered: bool
) -> list[str]:
    """The inputs of a pass-1 kernel: the fields the two formats store (none stands in for
    a field a format does not have) or the record that holds them all, the compiled step's
    row count and write slot, and the order of each batch row's rows, where the variant
    takes them (with a slot, `order` alone: RowOrder::after_write). (TurboQuant's codebook
    is in the kernel's header.)"""
    order = ["order"] if slot else ["order", "turn", "oldest"]
    if record:
        return [
            "queries",
            "record",
            *(["rows"] if counted else []),
            *(["slot_row", "new_record"] if slot else []),
            *(order if ordered else []),
        ]
    key_scales, key_biases = _GROUP_FIELDS[key_fmt]
    value_scales, value_biases = _GROUP_FIELDS[value_fmt]
    present = {
        "scales": {"k": key_scales, "v": value_scales},
        "biases": {"k": key_biases, "v": value_biases},
    }

    def side(prefix: str, name: str) -> list[str]:
        fields = ["codes", *(f for f in ("scales", "biases") if present[f][name])]
        return [f"{prefix}{name}_{field}" for field in fields]

    return [
        "queries",
        *side("", "k"),
        *side("", "v"),
        *(["rows"] if counted else []),
        *(["slot_row", *side("new_", "k"), *side("new_", "v")] if slot else []),
        *(order if ordered else []),
    ]


def _record_field_names(key_fmt: int, value_fmt: int) -> list[str]:
    """The fields the two formats store, as a record's offsets are given (RecordFormat)."""
    inputs = _pass_inputs(key_fmt, value_fmt, False, False, False, False)
    return [name for name in inputs if name.startswith(("k_", "v_"))]


def _record_offsets(
    key_fmt: int, value_fmt: int, offsets: tuple[int, ...] | None
) -> tuple[int, ...] | None:
    """RecordFormat's offsets as record_pass takes them: one for each of the six fields of
    two sides (codes, scales, biases; keys, then values), -1 for a field not stored."""
    if offsets is None:
        return None
    stored = dict(zip(_record_field_names(key_fmt, value_fmt), offsets, strict=True))
    names = [f"{side}_{field}" for side in "kv" for field in ("codes", "scales", "biases")]
    return tuple(stored.get(name, -1) for name in names)


def _partial_call(
    mma: bool,
    counted: bool,
    slot: bool,
    ordered: bool,
    inputs: list[str],
    offsets: tuple[int, ...] | None,
    codebook: bool,
) -> str:
    """The body of a pass-1 kernel: one call of partial_pass with the kernel's `inputs`
    (_pass_inputs) and, for TurboQuant values (`codebook`), the header's codebook. An
    argument without its input is a null pointer, and the key codes' strides stand in for
    its strides (never read: the format has no such field, or COUNTED and SLOT are false).
    With `offsets` (_record_offsets) a call of record_pass, which reads the fields of
    `record` at those byte offsets."""
    flags = ", ".join("true" if on else "false" for on in (mma, counted, slot, ordered))
    table = CODEBOOK if codebook else "nullptr"

    def pointer(name: str) -> str:
        return name if name in inputs else "nullptr"

    # The counted, slot and ordered variants' own inputs, in partial_pass's order.
    counts = ", ".join(pointer(name) for name in ("rows", "slot_row", "order", "turn", "oldest"))

    if offsets is not None:
        return (
            f"kvspec_attn::record_pass<{flags}, {_PARTIAL_CONSTANTS}, "
            f"{', '.join(str(offset) for offset in offsets)}>("
            "queries, queries_shape, queries_strides, record, record_shape, record_strides, "
            f"{table}, {counts}, {pointer('new_record')}, "
            f"{'new_record_strides' if 'new_record' in inputs else 'record_strides'}, "
            "partial);"
        )

    def strides(name: str) -> str:
        return f"{name}_strides" if name in inputs else "k_codes_strides"

    def side(name: str, shape: bool = False) -> str:
        # Codes (the key codes with their shape), their strides, scales and their strides,
        # biases (which share the scales' strides).
        codes = f"{name}_codes"
        return ", ".join(
            [
                pointer(codes),
                *([f"{codes}_shape"] if shape else []),
                strides(codes),
                pointer(f"{name}_scales"),
                strides(f"{name}_scales"),
                pointer(f"{name}_biases"),
            ]
        )

    return (
        f"kvspec_attn::partial_pass<{flags}, {_PARTIAL_CONSTANTS}>("
        f"queries, queries_shape, queries_strides, {side('k', shape=True)}, {side('v')}, "
        f"{table}, {counts}, {side('new_k')}, "
        f"{side('new_v')}, partial);"
    )


@cache
def _partial_kernel(
    plan: _Plan,
    counted: bool,
    mma: bool,
    slot: bool,
    ordered: bool,
    key_fmt: int,
    value_fmt: int,
    offsets: tuple[int, ...] | None,
) -> object:
    # One kernel object per plan (its constants and the dynamic shared memory of each
    # body) and variant. The counted variant takes one more input, `rows` (int32 [1]): the
    # live row count of an eager read or of the compiled step (COMPILE-4); the slot variant
    # the write slot's row (int32 [1]) and the new position's fields; the ordered one the
    # order of each batch row's live rows (RowsOrder: ROWS-6, READ-7); the
    # plain one none. Each takes only the fields its formats store, or with `offsets`
    # (RecordFormat) the record that holds them, whose offsets are in the source and so in
    # the kernel's name (MLX keeps one build per name).
    name = "kvspec_decode_attention" + "".join(
        suffix
        for suffix, on in (
            ("_mma", mma),
            ("_counted", counted),
            ("_slot", slot),
            ("_ordered", ordered),
        )
        if on
    )
    name = f"{name}_{key_fmt}{value_fmt}"
    inputs = _pass_inputs(key_fmt, value_fmt, counted, slot, offsets is not None, ordered)
    if offsets is not None:
        name += "_record_" + "_".join(str(offset) for offset in offsets)
    rotated = value_fmt == TURBO_VALUE
    # The codebook's bits are in the kernel's name (VBITS), so one name holds one codebook.
    codebook_bits = dict(plan.partial_constants)["VBITS"] if rotated else 0
    call_offsets = _record_offsets(key_fmt, value_fmt, offsets)
    return cuda_kernel(
        name,
        _partial_call(mma, counted, slot, ordered, inputs, call_offsets, rotated),
        plan.partial_constants,
        input_names=inputs,
        output_names=["partial"],
        header=_INCLUDE
        + constants_header(codebook_bits)
        + (_launch_bounds(plan) if _bounded(mma, slot, ordered) else ""),
        ensure_row_contiguous=False,
        shared_memory=plan.shared_bytes[mma],
    )


@cache
def _merge_kernel(plan: _Plan, rotated: bool) -> object:
    # The signs' head dim is in the kernel's name (DV).
    signs_dim = dict(plan.merge_constants)["DV"] if rotated else 0
    return cuda_kernel(
        "kvspec_decode_merge" + ("_rotated" if rotated else ""),
        _merge_call(rotated),
        plan.merge_constants,
        input_names=["partial"],
        output_names=["out"],
        header=_INCLUDE + constants_header(signs_dim=signs_dim),
    )


class StoredSide(NamedTuple):
    """Keys or values of a cache as stored: rows [B, H, T, *] of `codes` (a view that may
    be strided along T), and for coded formats their group fields [B, H, T', D / group].
    The read covers the first T rows of the key codes; every other field holds at least
    T rows (the whole buffer may be passed). A named tuple: a decode step makes two, and
    a tuple is made in a fifth of a frozen dataclass's time.

    fmt is PLAIN, AFFINE, TURBO_KEY or TURBO_VALUE; bits and group_size describe the codes
    (0 for PLAIN); dim is the head dim the codes hold.
    """

    fmt: int
    codes: mx.array
    scales: mx.array | None
    biases: mx.array | None
    bits: int
    group_size: int
    dim: int


class SideFormat(NamedTuple):
    """What the kernels are built for of one side: its format, the dtypes of its codes and
    of its group fields (the codes' for PLAIN), bits, group size (32 for PLAIN) and dim."""

    fmt: int
    codes: mx.Dtype
    scales: mx.Dtype
    bits: int
    group_size: int
    dim: int


def side_format(side: StoredSide) -> SideFormat:
    """The format of a stored side."""
    scales = side.scales if side.scales is not None else side.codes
    return SideFormat(
        side.fmt, side.codes.dtype, scales.dtype, side.bits, side.group_size or 32, side.dim
    )


class RecordFormat(NamedTuple):
    """Keys and values stored side by side in one record per row (accelerated/records.py):
    the two sides' formats and the byte offsets in a row of the fields they store, as
    StoredSide orders them (codes, scales, biases; keys, then values; a field the format
    does not store has none)."""

    keys: SideFormat
    values: SideFormat
    offsets: tuple[int, ...]


def supported(
    keys: SideFormat | StoredSide, values: SideFormat | StoredSide, kv_heads: int, query_heads: int
) -> bool:
    """Whether the kernels take this read: a CUDA device, a read their CUDA-core body takes
    (`cuda_core_fit`; the tensor-core body takes fewer), at most MAX_GROUP query heads per
    KV head. (Stored fields are contiguous in their last axis: caches slice them along
    positions only.)"""
    if not on_cuda():
        return False
    if query_heads % kv_heads != 0 or query_heads // kv_heads > MAX_GROUP:
        return False
    return cuda_core_fit(keys, values)


def on_cuda() -> bool:
    """Whether MLX's default device, where a read's kernels would run, is a CUDA GPU."""
    return mx.default_device() == mx.gpu and cuda_available()


def cuda_core_fit(keys: SideFormat | StoredSide, values: SideFormat | StoredSide) -> bool:
    """Whether the CUDA-core body takes a read: head dims of HEAD_DIMS. A lane's share of a
    row (D / 32 elements, fewer than any group holds) lies in one group of a coded format
    or reaches into the next (affine codes at head dims 96, 160 and 192), whose scale and
    bias the lane reads too."""
    return keys.dim in HEAD_DIMS and values.dim in HEAD_DIMS


#: Head dims the tensor-core body takes: those its tests have run on a GPU (any multiple
#: of 16 up to 256 cuts into its fragments).
TENSOR_CORE_HEAD_DIMS = (64, 128, 256)


def tensor_core_fit(keys: SideFormat | StoredSide, values: SideFormat | StoredSide) -> bool:
    """Whether the tensor-core body takes a read: head dims of TENSOR_CORE_HEAD_DIMS, and
    each lane's share of a row (D / 4 key elements, D / 8 value elements) inside one group
    of a coded format. Other reads run on CUDA cores."""

    def fits(side: SideFormat | StoredSide, share: int) -> bool:
        if side.dim not in TENSOR_CORE_HEAD_DIMS:
            return False
        return side.fmt == PLAIN or side.group_size % (side.dim // share) == 0

    return fits(keys, 4) and fits(values, 8)


def scaled_weights(values: SideFormat | StoredSide, group: int) -> bool:
    """Whether the tensor-core body reads these values with their scales in the weights
    (READ-7's scaled weights): affine codes of 2, 4 or 8 bits whose share a lane holds (D / 8
    elements) fills whole words, where the value MMA's 8 columns hold each of the `group`
    query heads once for each group a row of D / 8 lanes spans (D / group_size groups)."""
    if values.fmt != AFFINE or values.bits not in (2, 4, 8):
        return False
    share = values.dim // 8
    return share * values.bits % 32 == 0 and group * values.dim <= 8 * values.group_size


def _most_splits(kv_heads: int) -> int:
    # About one resident wave of blocks (TARGET_BLOCKS) for one row of the batch: a row's
    # splits do not follow the batch, so that it reads as it would alone.
    return max(1, min(MAX_SPLITS, math.ceil(TARGET_BLOCKS / kv_heads)))


def _splits(T: int, kv_heads: int) -> int:
    """READ-7's split count of T live rows: no split shorter than MIN_SPLIT, at most
    `_most_splits`. Pass 1 cuts the live count this way on the device; a launch over a
    buffer of T rows has room for this many."""
    return max(1, min(_most_splits(kv_heads), math.ceil(T / MIN_SPLIT)))


def _merge_parts(DV: int) -> int:
    """Threads of the merge that share an output element, each over its share of the
    splits: about MERGE_THREADS threads a query head."""
    return max(1, MERGE_THREADS // DV)


@cache
def _float_bits(x: float) -> int:
    """The float32 bits of x as a signed int (a template constant)."""
    return int(np.array(x, np.float32).view(np.int32))


@dataclass(frozen=True, eq=False)
class _Plan:
    """What one read configuration launches with; built once per configuration (`_plan`),
    so a decode step spends no host time on it, and its kernels are looked up by identity."""

    #: The template constants of pass 1 and of the merge (cuda_source.cuda_kernel).
    partial_constants: tuple[Constant, ...]
    merge_constants: tuple[Constant, ...]
    #: Dynamic shared memory of pass 1 by body: the warps' merge; on tensor cores also the
    #: query fragment (16 bytes per lane per 8 key elements), past the merge's 16-byte end.
    shared_bytes: dict[bool, int]


@cache
def _plan(
    query_dtype: mx.Dtype,
    keys: SideFormat,
    values: SideFormat,
    kv_heads: int,
    group: int,
    scale_bits: int,
    table_size: int,
    out_dtype: mx.Dtype,
) -> _Plan:
    (k_fmt, k_codes, k_scales, k_bits, k_group, DK) = keys
    (v_fmt, v_codes, v_scales, v_bits, v_group, DV) = values
    partial = [
        # The operand dtypes name the instance (one NVRTC compile per combination).
        ("QT", query_dtype),
        ("KC", k_codes),
        ("VC", v_codes),
        ("KS", k_scales),
        ("VS", v_scales),
        ("DK", DK),
        ("DV", DV),
        ("G", group),
        ("WARPS", WARPS),
        ("STAGE", STAGE),
        ("KFMT", k_fmt),
        ("KBITS", k_bits),
        ("KGROUP", k_group),
        ("VFMT", v_fmt),
        ("VBITS", v_bits),
        ("VGROUP", v_group),
        ("TABLE", table_size),
        ("SCALE_BITS", scale_bits),
        ("SCALED", scaled_weights(SideFormat(*values), group)),
        ("MIN_SPLIT", MIN_SPLIT),
        ("MOST_SPLITS", _most_splits(kv_heads)),
    ]
    merge = [
        ("DV", DV),
        ("PARTS", _merge_parts(DV)),
        ("MAX_SPLITS", MAX_SPLITS),
        ("ROTATED", v_fmt == TURBO_VALUE),
        ("OT", out_dtype),
        ("INV_SQRT_BITS", INV_SQRT_BITS.get(DV, 0)),
    ]
    merged = -(-(WARPS * group * DV + 2 * WARPS * group) // 4) * 16
    return _Plan(tuple(partial), tuple(merge), {False: merged, True: merged + DK // 8 * 32 * 16})


def _fields(side: StoredSide) -> list[mx.array]:
    """The side's fields as a kernel takes them: its codes, then the group fields its format
    stores (_GROUP_FIELDS); nothing stands in for a field the format does not have, since
    every array a kernel takes costs the host time at every step."""
    has_scales, has_biases = _GROUP_FIELDS[side.fmt]
    return [
        side.codes,
        *([side.scales] if has_scales else []),
        *([side.biases] if has_biases else []),
    ]


class StoredRecord(NamedTuple):
    """Keys and values stored in one record per row (accelerated/records.py): `record`
    uint8 [B, H, T, row_bytes] whose T rows a read covers (its buffer may hold more), in
    `record_format`."""

    record: mx.array
    record_format: RecordFormat


#: What a read attends over: the two stored sides, or the record holding both.
Stored = tuple[StoredSide, StoredSide] | StoredRecord


def decode_attention(
    queries: mx.array,
    stored: Stored,
    scale: float,
    out_dtype: mx.Dtype,
    rows: mx.array | None = None,
    tensor_cores: bool | None = None,
    slot: tuple[mx.array, tuple[StoredSide, StoredSide] | mx.array] | None = None,
    order: RowsOrder | mx.array | None = None,
) -> mx.array:
    """READ-7: the attention of queries [B, Hq, 1, Dk] over every stored row of `stored`
    (the sides, the read covering the first T rows of the key codes; or a record, its T
    rows), [B, Hq, 1, Dv] in `out_dtype`; TURBO_VALUE values are read with their codebook
    and the output unrotated with the signs of Dv, both held by the kernels. `rows`
    (int32 [1]), when given, limits the read to the first rows[0] rows as data
    (COMPILE-4): splits are planned for the whole buffer, and a split past the count reads
    nothing. `tensor_cores` picks the pass-1 body (None: tensor cores wherever
    `tensor_core_fit`). `slot` = (row, new), the compiled step's write slot (COMPILE-4):
    buffer row row[0] (int32 [1]) is read from the new position (its one-row sides, or its
    record row) instead of the buffers. `order`: the order of each batch row's live rows
    where it is not the buffer's, a padded batch's (ROWS-6) or a ring's (READ-7); with a
    slot, a ring's `padding_order` alone, whose turn follows from the write row, the newest
    position (the compiled step has no padding). Call only when `supported`."""
    formats = stored_formats(stored)
    counted, slotted, ordered = rows is not None, slot is not None, order is not None
    launch = _read_launch(
        tuple(queries.shape),
        queries.dtype,
        formats,
        scale,
        out_dtype,
        counted,
        tensor_cores,
        slotted,
        ordered,
    )
    return launch(queries, stored, rows, slot, order)


class RowsOrder(NamedTuple):
    """The ordered variant's inputs (decode_attention.cuh's RowOrder): of a buffer whose live
    rows hold positions oldest, oldest + 1, ..., batch row b reads those from its left
    padding on, oldest first, temporal row u (0 the oldest) lying at buffer row u below
    keep and at keep + (u - keep + turn) mod (rows - keep) from there on."""

    #: keep, then each batch row's left padding (`padding_order`).
    order: mx.array
    #: int32 [1] each, in device memory (caches.counting).
    turn: mx.array
    oldest: mx.array


#: The fewest values an `order` array holds: MLX keeps an array of 8 bytes or less in host
#: memory, which each block of a read would read across the bus (caches.counting).
_LEAST_ORDER = 4


@lru_cache(maxsize=64)
def padding_order(keep: int, left_padding: tuple[int, ...]) -> mx.array:
    """RowsOrder's `order`: int32 [max(4, 1 + B)], keep then each row's left padding (zeros
    after). One array per storage configuration, shared by every layer and step that reads
    it (arrays are values): managed memory, which moves to the device at its first read
    there and stays."""
    values = [keep, *left_padding]
    values += [0] * (_LEAST_ORDER - len(values))
    return mx.array(values, dtype=mx.int32)


#: A read's batch, KV heads, rows, key and value formats and record offsets (or None).
Formats = tuple[int, int, int, SideFormat, SideFormat, tuple[int, ...] | None]


def read_launch(
    queries: mx.array,
    formats: Formats,
    scale: float,
    out_dtype: mx.Dtype,
    counted: bool,
    tensor_cores: bool | None,
    slotted: bool,
    ordered: bool = False,
) -> ReadLaunch | None:
    """The launches of `decode_attention(queries, stored, scale, out_dtype, rows,
    tensor_cores, slot, order)` for stored rows of `formats` (`stored_formats`), `counted`
    whether it has rows, `slotted` a slot and `ordered` an order, planned once per
    configuration; None where the kernels do not take the read (`supported`, one query
    position). It does not check the queries against the stored keys
    (`ReadLaunch.keys_shape`)."""
    _, Hq, N, _ = queries.shape
    if N != 1:
        return None
    _, Hk, _, keys, values, _ = formats
    if not supported(keys, values, Hk, Hq):
        return None
    return _read_launch(
        tuple(queries.shape),
        queries.dtype,
        formats,
        scale,
        out_dtype,
        counted,
        tensor_cores,
        slotted,
        ordered,
    )


def stored_formats(stored: Stored) -> Formats:
    """What the kernels read `stored` as: its batch, KV heads and rows (the key codes' or
    the record's), the formats of keys and values, and a record's field offsets (None for
    sides)."""
    if isinstance(stored, StoredRecord):
        B, Hk, T, _ = stored.record.shape
        record_format = stored.record_format
        return B, Hk, T, record_format.keys, record_format.values, record_format.offsets
    B, Hk, T, _ = stored[0].codes.shape
    return B, Hk, T, side_format(stored[0]), side_format(stored[1]), None


class ReadLaunch(NamedTuple):
    """Both passes of one read configuration, with what they launch with (`read_launch`),
    and the shape of the keys [B, Hk, T, Dk] its queries must fit (READ-1)."""

    partial: Any
    partial_options: dict[str, Any]
    merge: Any
    merge_options: dict[str, Any]
    keys_shape: tuple[int, int, int, int]

    def __call__(
        self,
        queries: mx.array,
        stored: Stored,
        rows: mx.array | None,
        slot: tuple[mx.array, tuple[StoredSide, StoredSide] | mx.array] | None,
        order: RowsOrder | mx.array | None = None,
    ) -> mx.array:
        """The read's output [B, Hq, 1, Dv] (`decode_attention`'s arguments)."""
        if isinstance(stored, StoredRecord):
            inputs = [queries, stored.record]
            slot_inputs = [] if slot is None else [slot[0], slot[1]]
        else:
            inputs = [queries, *_fields(stored[0]), *_fields(stored[1])]
            slot_inputs = (
                [] if slot is None else [slot[0], *_fields(slot[1][0]), *_fields(slot[1][1])]
            )
        if rows is not None:
            inputs.append(rows)
        inputs += slot_inputs
        if isinstance(order, mx.array):
            inputs.append(order)
        elif order is not None:
            inputs += order
        (partial,) = self.partial(inputs=inputs, **self.partial_options)
        (out,) = self.merge(inputs=[partial], **self.merge_options)
        return out


@lru_cache(maxsize=256)
def _read_launch(
    query_shape: tuple[int, ...],
    query_dtype: mx.Dtype,
    formats: Formats,
    scale: float,
    out_dtype: mx.Dtype,
    counted: bool,
    tensor_cores: bool | None,
    slotted: bool,
    ordered: bool = False,
) -> ReadLaunch:
    """The kernels and launch options of a read configuration, made once: a decode step
    reads with the same configuration at every layer, and (whole buffers with a live count)
    at every step until its buffers grow, so it spends no host time on planning.
    ValueError where the body asked for does not take the read."""
    _, Hq, N, _ = query_shape
    B, Hk, T, keys, values, offsets = formats
    table_size = 1 << values.bits if values.fmt == TURBO_VALUE else 0
    plan = _plan(query_dtype, keys, values, Hk, Hq // Hk, _float_bits(scale), table_size, out_dtype)
    if tensor_cores is None:
        tensor_cores = tensor_core_fit(keys, values)
    if tensor_cores:
        body, fits = "tensor-core", tensor_core_fit(keys, values)
    else:
        body, fits = "CUDA-core", cuda_core_fit(keys, values)
    if not fits:
        raise ValueError(
            f"the {body} body does not take this read: head dims "
            f"{keys.dim}, {values.dim}, groups {keys.group_size}, {values.group_size}"
        )
    splits = _splits(T, Hk)
    threads = WARPS * 32
    DV = values.dim
    return ReadLaunch(
        _partial_kernel(
            plan, counted, tensor_cores, slotted, ordered, keys.fmt, values.fmt, offsets
        ),
        {
            "grid": (splits * threads, B * Hk, 1),
            "threadgroup": (threads, 1, 1),
            # Each split's DV sums, then its maximum and total: one array for the merge.
            "output_shapes": [(B * Hq, splits, DV + 2)],
            "output_dtypes": [mx.float32],
        },
        _merge_kernel(plan, values.fmt == TURBO_VALUE),
        {
            "grid": (B * Hq * DV * _merge_parts(DV), 1, 1),
            "threadgroup": (DV * _merge_parts(DV), 1, 1),
            "output_shapes": [(B, Hq, N, DV)],
            "output_dtypes": [out_dtype],
        },
        (B, Hk, T, keys.dim),
    )


#: What this module keeps made (kernel objects, the plans they are made from, the reads'
#: launches, and the count that drops what storages keep made: KERNELS_MADE): a tool that
#: builds the kernels from other sources or shapes, or a test that stands in for them,
#: clears these.
KERNEL_CACHES = (_partial_kernel, _merge_kernel, _plan, _read_launch, KERNELS_MADE)
