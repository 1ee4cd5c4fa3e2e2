"""Measure the conformance suite by deliberate faults (mutants).

Each mutant of the catalogue replaces one piece of text, which must occur exactly once,
in one file of a temporary copy of the project; the tests named for it then run on that
copy under a hypothesis profile (by default "mutants": the ci profile's examples without
shrinking, which can take minutes once a fault is found). A mutant is caught
when a test fails, missed when all pass; a run that cannot even start (exit status other
than 0 or 1) is reported as an error. The copy is imported through PYTHONPATH ahead of
the editable install, and each run checks that it imports the copy.

    .venv/bin/python tools/mutants.py                       # the whole catalogue
    .venv/bin/python tools/mutants.py --list
    .venv/bin/python tools/mutants.py ring-wraps-early trim-past-offset --runs 3

Prints a Markdown table (mutant, file, fault, tests, result per run, seconds); exits 1
when a mutant is missed, does not apply, or errs. A fault in a CUDA kernel is caught on a
GPU by the tests that reach the kernels there, and anywhere else by
conformance/test_kernels_emulated.py, which runs the kernels' source on the CPU; each
such mutant names tests of both.
docs/mutants.md holds the catalogue and its last result.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
#: What the copy holds: the packages (imported as kvspec.*) and what the tests read.
COPIED = ("reference", "accelerated", "conformance", "tools", "docs", "pyproject.toml", "README.md")
PACKAGES = ("reference", "accelerated", "conformance")


@dataclass(frozen=True)
class Mutant:
    """One deliberate fault: `before` (exactly once in `path`) becomes `after`."""

    name: str
    path: str
    before: str
    after: str
    fault: str
    tests: tuple[str, ...]


KV = "conformance/test_caches_kv.py"
RING = "conformance/test_caches_rotating.py"
BF16 = "conformance/test_caches_bf16_first.py"
TQC = "conformance/test_caches_turboquant.py"
AFFINE = "conformance/test_affine.py"
TQ = "conformance/test_turboquant.py"
EDGES = "conformance/test_edges.py"
MASKS = "conformance/test_masks.py"
CONVERSIONS = "conformance/test_conversions.py"
DECODE = "conformance/test_decode_step.py"
STEP_OPS = "conformance/test_step_ops.py"
COUNTING = "conformance/test_counting_table.py"
EMPTY_ENCODES = "conformance/test_empty_encodes.py"
RECORDS_VIEWS = "test_a_decode_step_reads_a_records_rows_without_a_fields_view"
CUDA_SOURCE = "conformance/test_cuda_source.py"
HELD_TO_THE_BLOCKS = (
    "test_the_variants_that_outgrew_it_are_held_to_the_blocks_an_sm_the_split_counts_on"
)
GOLDEN = "conformance/test_golden.py"
COMPILED = "conformance/test_compiled_step.py"
#: The reads of affine values with scaled weights (READ-7) at 4 query heads per KV head.
SCALED_READS = f"{DECODE}::test_decode_read_of_stored_fields_is_within_bound[default-4-affine-4-64]"
#: The same tests with the kernels emulated on the CPU (conformance/test_kernels_emulated.py).
EMULATED = "conformance/test_kernels_emulated.py"
ROW_ORDER = "conformance/test_row_order.py"
EMULATED_FAR_ZERO = f"{EMULATED}::test_turboquant_far_zero_reads_are_within_bound"
EMULATED_SCALED_READS = (
    f"{EMULATED}::test_reads_of_stored_fields_are_within_bound[default-affine-4-64]"
)
FAR_ZERO_READS = (
    "conformance/test_decode_step.py::"
    "test_turboquant_reads_of_far_zero_points_and_extreme_queries_are_within_bound"
)
RECORDS = "conformance/test_records.py"
RING_MASKS = "test_ring_masks_against_positions_written"
ROWS = "conformance/test_rows.py"
MLX_LM_BATCH = "conformance/test_mlx_lm_batch.py"
PLANNED = "conformance/test_planned_append.py"
READ_LAUNCHES = "conformance/test_read_launches.py"

CATALOGUE = (
    # -- the state machines both backends share (reference/caches) --------------------
    Mutant(
        "ring-wraps-early",
        "reference/caches/rotating.py",
        "        if index == self.max_size:\n",
        "        if index >= self.max_size - 1 and self.offset >= self.max_size:\n",
        "a full ring wraps to keep one slot early (RING-2)",
        (f"{RING}::test_rotating_kv_cache_machine", f"{RING}::test_a_full_ring_wraps_at_max_size"),
    ),
    Mutant(
        "ring-evicts-keep",
        "reference/caches/rotating.py",
        "[f[:, :, : self.keep], f[:, :, count + self.keep :]]",
        "[f[:, :, count : count + self.keep], f[:, :, count + self.keep :]]",
        "eviction drops the kept positions instead of the oldest after them (RING-3)",
        (f"{RING}::test_rotating_kv_cache_machine",),
    ),
    Mutant(
        "ring-temporal-order",
        "reference/caches/rotating.py",
        "                        f[:, :, self._index :],\n"
        "                        f[:, :, self.keep : self._index],\n",
        "                        f[:, :, self.keep : self._index],\n"
        "                        f[:, :, self._index :],\n",
        "a wrapped ring put in temporal order with its two runs swapped (RING-3)",
        (f"{RING}::test_rotating_kv_cache_machine",),
    ),
    Mutant(
        "ring-trimmable-when-full",
        "reference/caches/rotating.py",
        "        return self.offset < self.max_size\n",
        "        return self.offset <= self.max_size\n",
        "a ring holding max_size positions counts as trimmable (RING-5)",
        (f"{RING}::test_rotating_kv_cache_machine",),
    ),
    Mutant(
        "ring-conversion-index",
        "reference/caches/rotating.py",
        "        target._index = self._index\n",
        "        target._index = self.length\n",
        "to_quantized moves the ring index to the buffer's end (CACHE-9, QRING-2)",
        (CONVERSIONS, f"{RING}::test_rotating_kv_cache_machine"),
    ),
    Mutant(
        "ring-restore-index-unchecked",
        "reference/caches/rotating.py",
        "        if index is None or not 0 <= index <= length:\n",
        "        if index is None:\n",
        "restore_state takes a ring index beyond the buffer (RING-6)",
        (f"{RING}::test_rotating_kv_cache_machine",),
    ),
    Mutant(
        "affine-state-swaps-scales-biases",
        "reference/caches/kv.py",
        "        arrays = () if self._fields is None else self._live()\n",
        "        arrays = () if self._fields is None else self._live()\n"
        "        if len(arrays) == 6:\n"
        "            arrays = (arrays[0], arrays[2], arrays[1], *arrays[3:])\n",
        "an affine state lists k_biases before k_scales (CACHE-8)",
        (f"{KV}::test_quantized_kv_cache_machine",),
    ),
    Mutant(
        "trim-past-offset",
        "reference/caches/storage.py",
        "        return min(n, self.offset - max(self._left_padding, default=0))\n",
        "        return n if n <= self.offset else 0\n",
        "trim(n) with n > offset trims nothing (CACHE-5)",
        (f"{KV}::test_kv_cache_machine",),
    ),
    Mutant(
        "growth-step-128",
        "reference/caches/kv.py",
        "STEP = 256\n",
        "STEP = 128\n",
        "growable storage grows in steps of 128 rows (CACHE-3)",
        (f"{KV}::test_kv_cache_machine", f"{TQC}::test_growth_and_trim_follow_kv_cache"),
    ),
    Mutant(
        "growth-keeps-rows-past-offset",
        "reference/caches/kv.py",
        "        if prev % STEP != 0:\n",
        "        if False:\n",
        "growth off a step boundary keeps the rows past the offset (CACHE-3)",
        (f"{KV}::test_kv_cache_machine", f"{TQC}::test_growth_and_trim_follow_kv_cache"),
    ),
    Mutant(
        "restore-offset-unchecked",
        "reference/caches/kv.py",
        "            if any(a.shape[2] != state.offset for a in state.arrays):\n",
        "            if False:\n",
        "restore_state takes arrays of another length than the offset (CACHE-8)",
        (f"{KV}::test_kv_cache_machine",),
    ),
    Mutant(
        "conversion-encodes-capacity",
        "reference/caches/turboquant.py",
        "        window = cache.keys_and_values()\n",
        "        window = None if cache._fields is None else cache._decode(cache._fields)\n",
        "from_kv_cache encodes the unused capacity rows too (TQC-3)",
        (CONVERSIONS, f"{TQC}::test_turboquant_kv_cache_machine"),
    ),
    Mutant(
        "turboquant-rejects-format-mixing",
        "reference/caches/turboquant.py",
        "        return super()._append_layout(k, v)._replace(dtype=READ_DTYPE)\n",
        "        return super()._append_layout(k, v)\n",
        "TurboQuant storage fixes the input format (TQC-2)",
        (f"{TQC}::test_turboquant_kv_cache_machine",),
    ),
    Mutant(
        "bf16-first-converts-late",
        "reference/caches/bf16_first.py",
        "    return offset >= start and offset != 0\n",
        "    return offset > start and offset != 0\n",
        "the switch waits one position past start (B16F-1)",
        (f"{BF16}::test_transition_due", f"{BF16}::test_bf16_first_quantized_machine"),
    ),
    Mutant(
        "bf16-first-reuse-floor",
        "reference/caches/bf16_first.py",
        "        if self.start > 0:\n",
        "        if self.start >= 0:\n",
        "start 0 records a minimum reusable offset (B16F-4)",
        (f"{BF16}::test_bf16_first_quantized_machine",),
    ),
    Mutant(
        "bf16-first-ring-commits-at-once",
        "reference/caches/bf16_first.py",
        "        self.check_append(k, v)\n        reads = [",
        "        return self.storage.append_committed(k, v)\n        reads = [",
        "a bf16-first ring commits a span as one window read, not decode by decode (READ-4)",
        (f"{BF16}::test_bf16_first_rotating_quantized_machine",),
    ),
    Mutant(
        "mask-window-off-by-one",
        "reference/caches/masks.py",
        "(query_positions < key_positions + window_size)",
        "(query_positions <= key_positions + window_size)",
        "the causal window shows one key too many (MASK-1)",
        (f"{RING}::test_rotating_kv_cache_machine", MASKS),
    ),
    Mutant(
        "mask-one-query-drops-window",
        "reference/caches/masks.py",
        "    if n == 1 and (window_size is None or offset < window_size):\n",
        "    if n == 1:\n",
        "one query on full attention ignores the window, as the seeds do (MASK-2)",
        (f"{KV}::test_kv_cache_machine", MASKS),
    ),
    Mutant(
        "ring-mask-causal-from-first-query",
        "reference/caches/masks.py",
        "        last_query = offset + n - 1\n",
        "        last_query = offset\n",
        "a ring's span mask judged causal from its first query, the nearest to the keys (MASK-3)",
        (MASKS,),
    ),
    Mutant(
        "ring-mask-roll",
        "reference/caches/masks.py",
        "    cycled = offset - (write_row - rows) % (max_size - keep)\n",
        "    cycled = offset - (write_row - 1 - rows) % (max_size - keep)\n",
        "a ring's one-query window rolled one slot short (MASK-3)",
        (f"{RING}::test_rotating_kv_cache_machine", MASKS),
    ),
    Mutant(
        "ring-mask-wraps-to-zero",
        "reference/caches/masks.py",
        "    write_row = ring_index if ring_index < max_size else keep\n",
        "    write_row = ring_index if ring_index < max_size else 0\n",
        "a ring's one-query window wraps to slot 0, not keep, as mlx-lm's does (MASK-3)",
        (f"{RING}::test_one_query_window_with_keep", f"{MASKS}::{RING_MASKS}"),
    ),
    Mutant(
        "ring-mask-slides-kept",
        "reference/caches/masks.py",
        "        return (key_positions < keep) | (distance < max_size - keep)\n",
        "        return distance < max_size\n",
        "a ring's own window ignores keep: kept positions slide out, as in mlx-lm's span "
        "masks (MASK-3)",
        (f"{RING}::test_span_window_with_keep", f"{MASKS}::{RING_MASKS}"),
    ),
    # -- the codecs' reference (held by MLX's and the golden vectors) --------------------
    Mutant(
        "affine-round-half-away",
        "reference/affine.py",
        "    steps = np.rint(shifted / scale[..., None])\n",
        "    steps = np.floor(shifted / scale[..., None] + np.float32(0.5))\n",
        "affine codes round half up, not half to even (AFF-4, CONV-2)",
        (f"{AFFINE}::test_stored_fields_equal_reference", EDGES),
    ),
    Mutant(
        "turboquant-key-round-half-away",
        "reference/turboquant.py",
        "        codes = np.rint(shifted)\n",
        "        codes = np.trunc(shifted + np.copysign(np.float32(0.5), shifted))\n",
        "TurboQuant key codes round half away from zero (TQ-4, CONV-2)",
        (EDGES,),
    ),
    Mutant(
        "turboquant-value-boundary-tie",
        "reference/turboquant.py",
        "    below = boundaries(bits) < u[..., None]\n",
        "    below = boundaries(bits) <= u[..., None]\n",
        "a value on a codebook boundary takes the upper index (TQ-7: ties go down)",
        (EDGES,),
    ),
    Mutant(
        "turboquant-constant-key-group",
        "reference/turboquant.py",
        "        scale = np.where(constant, np.abs(top), scale)\n",
        "",
        "a constant key group keeps TQ-4's scale 0 instead of its magnitude (TQ-11)",
        (EDGES,),
    ),
    # -- the MLX backend ------------------------------------------------------------------
    Mutant(
        "mlx-write-rows-one-late",
        "accelerated/caches/reads.py",
        "        field[:, :, start : start + part.shape[2]] = part\n",
        "        field[:, :, start + 1 : start + 1 + part.shape[2]] = part\n",
        "the MLX storages write new positions one row past where they belong (CACHE-3)",
        (f"{KV}::test_kv_cache_machine", f"{RING}::test_rotating_kv_cache_machine"),
    ),
    Mutant(
        "mlx-rank-depends-op",
        "accelerated/caches/reads.py",
        "        self._failure = failure\n        return fields\n",
        "        self._failure = failure\n"
        "        return (mx.depends(fields[0], failure), *fields[1:])\n",
        "a deferred append ties the running rank to its fields with an op of its own, one "
        "more per layer and step (DEFER-3)",
        (f"{STEP_OPS}::test_a_decode_step_hands_mlx_its_budget_of_ops",),
    ),
    Mutant(
        "mlx-write-rows-array-start",
        "accelerated/caches/reads.py",
        "        field[:, :, start : start + part.shape[2]] = part\n",
        "        field = mx.slice_update(field, part, mx.array([start]), (2,))\n",
        "the MLX storages write the right bits through slice updates whose start is an array, "
        "0.5 ms per layer on CUDA (CACHE-3)",
        (f"{DECODE}::test_a_decode_append_writes_its_rows_at_a_static_start",),
    ),
    Mutant(
        "mlx-step-scalars-per-layer",
        "accelerated/caches/reads.py",
        "        return COUNTS.single(value)\n",
        "        return mx.array([value], dtype=mx.int32)\n",
        "the compiled step makes its write position and active length once per layer, as "
        "arrays MLX hands the device one by one (COMPILE-3)",
        (f"{STEP_OPS}::test_a_compiled_step_hands_mlx_one_position_and_length_for_all_layers",),
    ),
    Mutant(
        "mlx-planned-append-any-dtype",
        "accelerated/caches/planned.py",
        "            and k.dtype == self.dtype\n            and v.dtype == self.dtype\n",
        "",
        "a planned append takes keys and values of another dtype than the one checked (CACHE-2)",
        (f"{PLANNED}::test_an_append_the_plan_does_not_take_is_checked",),
    ),
    Mutant(
        "mlx-planned-append-any-layout",
        "accelerated/caches/planned.py",
        "            storage._layout is self.layout\n            and ",
        "            ",
        "a planned append takes its shapes into a storage restored with another layout (CACHE-2)",
        (f"{PLANNED}::test_an_append_the_plan_does_not_take_is_checked",),
    ),
    Mutant(
        "mlx-planned-append-kept-after-clearing",
        "accelerated/caches/planned.py",
        "            and self.generation == KERNELS_MADE.count\n",
        "",
        "a storage's planned append outlives a clearing of the kernels' caches: it launches an "
        "encode made before (another source's, other stand-ins')",
        (f"{PLANNED}::test_a_planned_append_launches_kernels_made_after_the_caches_are_cleared",),
    ),
    Mutant(
        "mlx-planned-append-never-taken",
        "accelerated/caches/reads.py",
        "        if planned is not None and planned.takes(self, k, v):\n",
        "        if planned is None and planned.takes(self, k, v):\n",
        "every append goes the checked path, planned again each time: the bits stay right "
        "and a decode step's host time goes back up (CACHE-2 on MLX)",
        (f"{PLANNED}::test_a_planned_append_launches_what_a_checked_append_launches",),
    ),
    Mutant(
        "mlx-planned-append-keeps-old-rank",
        "accelerated/caches/reads.py",
        "            if failure is not None:\n"
        "                fields = self._record_failure(fields, failure)\n",
        "",
        "a planned append drops the running rank its encode returns (DEFER-3)",
        (f"{PLANNED}::test_a_planned_append_launches_what_a_checked_append_launches",),
    ),
    Mutant(
        "mlx-step-scalars-reshaped-per-layer",
        "accelerated/caches/counting.py",
        "            value: table[value : value + 1]\n",
        "            value: table[value]\n",
        "the compiled step's write position and active length are int32 scalars, which its "
        "graph reshapes for the kernels once per layer (COMPILE-3)",
        (f"{STEP_OPS}::test_a_compiled_step_hands_its_kernels_the_inputs_as_given",),
    ),
    Mutant(
        "mlx-read-row-count-per-layer",
        "accelerated/caches/reads.py",
        "        return StoredRead(stored, launches, decoded, COUNTS.single(rows), order=order)\n",
        "        return StoredRead(stored, launches, decoded, mx.array([rows], dtype=mx.int32), "
        "order=order)\n",
        "an eager decode read makes its live row count once per layer, an array MLX hands the "
        "device for each (READ-7)",
        (f"{STEP_OPS}::test_an_eager_step_hands_mlx_one_live_row_count_for_all_layers",),
    ),
    Mutant(
        "mlx-count-from-host-data",
        "accelerated/caches/counting.py",
        "            value: table[value : value + 1]\n",
        "            value: mx.array([value], dtype=mx.int32)\n",
        "a decode step's counts are arrays of their own, made from host data, which MLX keeps "
        "in host memory: every read's blocks fetch them across the bus (READ-7)",
        (f"{COUNTING}::test_a_count_is_a_view_of_the_table_shared_by_its_callers",),
    ),
    Mutant(
        "ring-rows-through-a-field-view",
        "reference/caches/rotating.py",
        "        rows = self.length\n",
        "        rows = 0 if fields is None else fields[0].shape[2]\n",
        "a ring asks field 0 for its rows at every decode step: on MLX a record's field is a "
        "view to make, two ops of host time a layer and step (RING-2, COMPILE-2)",
        (f"{RECORDS}::{RECORDS_VIEWS}",),
    ),
    Mutant(
        "mlx-empty-record-encode-launches",
        "accelerated/turboquant.py",
        "    if k.size == 0:\n        _check_encode_layout(k, v, k_bits, v_bits)\n",
        "    if False:\n        _check_encode_layout(k, v, k_bits, v_bits)\n",
        "a record encode of no positions asks for a launch of no rows, which cannot be made: "
        "the encode fails where it should store nothing and keep the prior rank (TQ-10, "
        "DEFER-3)",
        (f"{EMPTY_ENCODES}::test_empty_turboquant_encodes_launch_nothing",),
    ),
    Mutant(
        "mlx-no-rows-launch-unrefused",
        "accelerated/turboquant_kernels.py",
        '    if rows == 0:\n        raise ValueError(f"an encode of shape',
        '    if rows < 0:\n        raise ValueError(f"an encode of shape',
        "a TurboQuant encode launch asked for no rows divides by zero instead of refusing "
        "with a clear error (TQ-10)",
        (f"{EMPTY_ENCODES}::test_a_launch_of_no_rows_is_refused",),
    ),
    Mutant(
        "mlx-counting-table-waited-for",
        "accelerated/caches/counting.py",
        "        mx.async_eval(*views.values())\n",
        "        mx.eval(*views.values())\n",
        "making a block of counts waits for the device, a synchronisation in the decode "
        "step every 64 steps (READ-7)",
        (f"{COUNTING}::test_making_counts_never_waits_for_the_device",),
    ),
    Mutant(
        "mlx-count-views-in-the-step",
        "accelerated/caches/counting.py",
        "        mx.async_eval(*views.values())\n",
        "",
        "the counts' views are left to the step that reads them: one more op in its graph "
        "(READ-7, COMPILE-3)",
        (
            f"{COUNTING}::test_counts_ahead_are_made_and_evaluated_with_the_first",
            f"{STEP_OPS}::test_a_decode_step_hands_mlx_its_budget_of_ops",
        ),
    ),
    Mutant(
        "mlx-read-launches-any-layout",
        "accelerated/caches/reads.py",
        "            layout is self._layout\n"
        "            and record_format is self._record_format\n",
        "            record_format is self._record_format\n",
        "a storage's kept read launches serve a storage restored with another layout of the "
        "same shape: its rows are read as the old dtype (READ-7)",
        (f"{READ_LAUNCHES}::test_a_ring_restored_in_another_dtype_reads_in_that_dtype",),
    ),
    Mutant(
        "mlx-read-launches-any-rows",
        "accelerated/caches/reads.py",
        "            and rows_shape == self._rows_shape\n",
        "",
        "a storage's kept read launches serve its buffers after they grow: the kernels are "
        "planned for the rows the buffers had (READ-7)",
        (f"{READ_LAUNCHES}::test_a_read_launches_what_its_stored_rows_plan",),
    ),
    Mutant(
        "mlx-read-launches-queries-unchecked",
        "accelerated/caches/reads.py",
        "        key = (queries.shape, queries.dtype, scale, tensor_cores, counted, slotted, "
        "ordered)\n",
        "        key = (scale, tensor_cores, counted, slotted, ordered)\n",
        "a read's launches are kept by everything but the queries: queries that do not fit "
        "the keys launch the kernels of those that did (READ-1)",
        (f"{READ_LAUNCHES}::test_queries_that_do_not_fit_raise_at_every_read",),
    ),
    Mutant(
        "mlx-read-launches-kept-off-cuda",
        "accelerated/caches/reads.py",
        "        if not attention_kernels.on_cuda():\n            return None\n",
        "",
        "a read's launches made on CUDA are launched after MLX's default device changed (READ-7)",
        (f"{READ_LAUNCHES}::test_a_read_off_cuda_launches_no_kernel",),
    ),
    Mutant(
        "mlx-read-launches-kept-after-clearing",
        "accelerated/caches/reads.py",
        "        if generation != self._generation:\n",
        "        if False:\n",
        "a storage's kept read launches outlive a clearing of the kernels' caches: a kernel A/B "
        "times its first source's kernels under every source's name",
        (
            f"{READ_LAUNCHES}::test_a_read_launches_kernels_made_after_the_caches_are_cleared",
            "tools/test_kernel_ab.py::test_each_sources_reads_launch_that_sources_kernels",
            "tools/test_launch_shapes.py::test_each_shape_launches_its_own_grid",
        ),
    ),
    Mutant(
        "mlx-kernel-constants-unnamed",
        "accelerated/cuda_source.py",
        '    return mx.fast.cuda_kernel(name=name + "".join(suffix), source=body, **options)\n',
        "    return mx.fast.cuda_kernel(name=name, source=body, **options)\n",
        "a kernel's constants are written into its source but not its name: kernels of other "
        "constants share one name, and MLX keeps one build per name",
        (f"{CUDA_SOURCE}::test_a_kernels_constants_are_written_as_mlx_writes_template_arguments",),
    ),
    Mutant(
        "mlx-affine-record-encodes-apart",
        "accelerated/caches/quantized.py",
        "        if not affine.record_encoder_takes(k, v):\n",
        "        if True:\n",
        "the MLX affine cache encodes its fields apart and packs them into its record: a "
        "concatenation and five more arrays every step on CUDA (QKV-1)",
        (f"{STEP_OPS}::test_a_decode_step_hands_mlx_its_budget_of_ops",),
    ),
    Mutant(
        "mlx-affine-record-head-dim-unchecked",
        "accelerated/caches/quantized.py",
        "            return None\n        self._check_head_dims(k, v)\n",
        "            return None\n",
        "the MLX affine cache's record encode launches on keys whose head_dim its group does "
        "not divide: its encoder trusts the cache's checks (QKV-1)",
        (f"{STEP_OPS}::test_the_cuda_path_rejects_what_its_encoders_cannot_take_before_a_launch",),
    ),
    Mutant(
        "mlx-tensor-core-lanes-across-groups",
        "accelerated/attention_kernels.py",
        "        return side.fmt == PLAIN or side.group_size % (side.dim // share) == 0\n",
        "        return True\n",
        "the tensor-core body takes rows whose lane shares cross a group of a coded format, "
        "reading one scale for two groups (READ-7)",
        (f"{DECODE}::test_tensor_core_fit_takes_the_head_dims_and_groups_it_was_tested_on",),
    ),
    Mutant(
        "mlx-affine-round-half-away",
        "accelerated/affine.py",
        "    steps = mx.round((groups - bias[..., None]) / scale[..., None])\n",
        "    steps = mx.floor((groups - bias[..., None]) / scale[..., None] + 0.5)\n",
        "the MLX affine encoder rounds half up (AFF-4)",
        (f"{AFFINE}::test_every_encoder_stores_reference_bits", EDGES),
    ),
    Mutant(
        "mlx-affine-constant-group",
        "accelerated/affine.py",
        "    scale = mx.maximum(span / n_bins, EPS.item())\n",
        "    scale = mx.maximum(span / n_bins, 1e-6)\n",
        "the MLX affine encoder's smallest scale is 1e-6, not 1e-7 (AFF-3, AFF-7)",
        (f"{AFFINE}::test_every_encoder_stores_reference_bits", EDGES),
    ),
    Mutant(
        "mlx-affine-decode-one-rounding",
        "accelerated/affine.py",
        "    return mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits)\n",
        "    wide = scales.astype(mx.float32), biases.astype(mx.float32)\n"
        "    read = mx.dequantize(wq, *wide, group_size=group_size, bits=bits)\n"
        "    return read.astype(scales.dtype)\n",
        "the MLX affine decode rounds once, not after the product and the sum (AFF-6, QKV-2)",
        (EDGES, f"{KV}::test_quantized_kv_cache_machine"),
    ),
    Mutant(
        "mlx-turboquant-key-round-half-away",
        "accelerated/turboquant.py",
        "    codes = mx.round(x / step[..., None] - zero[..., None])\n",
        "    quotient = x / step[..., None] - zero[..., None]\n"
        "    codes = mx.sign(quotient) * mx.floor(mx.abs(quotient) + 0.5)\n",
        "the MLX TurboQuant key codes round half away from zero (TQ-4)",
        (EDGES,),
    ),
    Mutant(
        "mlx-turboquant-value-boundary-tie",
        "accelerated/turboquant.py",
        "        below = mx.take(table, candidate - 1) < u\n",
        "        below = mx.take(table, candidate - 1) <= u\n",
        "the MLX value encoder puts a value on a boundary above it (TQ-7)",
        (EDGES,),
    ),
    Mutant(
        "mlx-attention-drops-a-key",
        "accelerated/caches/attention.py",
        "    return mx.fast.scaled_dot_product_attention(",
        "    if mask is None and keys.shape[2] > 1:\n"
        "        keys, values = keys[:, :, 1:], values[:, :, 1:]\n"
        "    return mx.fast.scaled_dot_product_attention(",
        "unmasked MLX reads drop the oldest key (READ-1, READ-2)",
        (f"{KV}::test_kv_cache_machine",),
    ),
    Mutant(
        "mlx-attention-scale",
        "accelerated/caches/attention.py",
        "scale=scale, mask=mask)",
        "scale=scale * 1.02, mask=mask)",
        "MLX reads scale the scores by 1.02 (READ-1)",
        (f"{KV}::test_kv_cache_machine",),
    ),
    Mutant(
        "mlx-ring-mask-index",
        "accelerated/caches/masks.py",
        "masks.rotating_make_mask(n, offset, max_size, keep, ring_index, window_size)",
        "masks.rotating_make_mask(n, offset, max_size, keep, ring_index + 1, window_size)",
        "the MLX ring mask takes the ring index one slot late (MASK-3)",
        (f"{RING}::test_rotating_kv_cache_machine", MASKS),
    ),
    # -- deferred checks and the decode read (DEFER, READ-7) ---------------------------
    Mutant(
        "defer-platform-nan",
        "reference/dtypes.py",
        '"float16": 0x7E00',
        '"float16": 0x7D00',
        "NaN groups store MLX's own float16 NaN, not the spec's quiet NaN (DEFER-1)",
        (GOLDEN,),
    ),
    Mutant(
        "defer-rank-reversed",
        "reference/deferred.py",
        "            return len(checks) - i\n",
        "            return i + 1\n",
        "the reference ranks the last check highest (DEFER-2)",
        (DECODE, GOLDEN),
    ),
    Mutant(
        "defer-value-codes-kept",
        "reference/turboquant.py",
        "np.where(value_failed[..., None], np.uint8(0), _grouped(indices))",
        "_grouped(indices)",
        "a failed value group keeps its codes (DEFER-1)",
        (DECODE, GOLDEN),
    ),
    Mutant(
        "mlx-running-rank-forgotten",
        "accelerated/caches/turboquant.py",
        "        prior = running(self)\n",
        "        prior = None\n",
        "a TurboQuant cache forgets an earlier failure at its next append (DEFER-3)",
        (f"{DECODE}::test_a_failure_is_kept_past_later_good_appends",),
    ),
    Mutant(
        "mlx-decode-read-drops-newest",
        "accelerated/caches/reads.py",
        "        rows = self._live_rows()\n",
        "        rows = self._live_rows() - 1\n",
        "the MLX decode read leaves out the position just appended (READ-2, READ-7)",
        (f"{KV}::test_kv_cache_machine", DECODE),
    ),
    # -- the compiled step's write slot (COMPILE-4) --------------------------------------
    Mutant(
        "slot-reads-stale-write-row",
        "reference/caches/compiled.py",
        "        return (rows < active_length) & (rows != position)\n",
        "        return rows < active_length\n",
        "the compiled step also reads the write row's old content (COMPILE-4)",
        (f"{COMPILED}::test_stale_rows_reach_no_output",),
    ),
    Mutant(
        "mlx-slot-values-unmasked",
        "accelerated/caches/reads.py",
        "            mx.where(hidden, mx.zeros((), field.dtype), field)\n",
        "            field\n",
        "the MLX write-slot read multiplies hidden rows' values by zero weights (COMPILE-4)",
        (f"{COMPILED}::test_stale_rows_reach_no_output",),
    ),
    # -- rows of their own lengths (ROWS-5 .. ROWS-10) ---------------------------------
    Mutant(
        "rows-padding-visible",
        "reference/caches/storage.py",
        "        if not self._left_padding:\n            return mask\n",
        "        if self._left_padding or not self._left_padding:\n            return mask\n",
        "reads of a padded batch show each row its padding (ROWS-6)",
        (f"{ROWS}::test_rows_of_their_own_lengths_machine",),
    ),
    Mutant(
        "rows-ring-positions-unwrapped",
        "reference/caches/rotating.py",
        "    wrapped = (rows >= ring_index) & (ring_index < offset)\n",
        "    wrapped = (rows >= ring_index) & (ring_index < 0)\n",
        "a wrapped ring's rows taken as in temporal order for padding and extract (ROWS-6, ROWS-8)",
        (
            f"{ROWS}::test_rows_of_their_own_lengths_machine",
            f"{ROWS}::test_ring_positions_names_the_position_each_row_holds",
        ),
    ),
    Mutant(
        "rows-trim-past-shortest",
        "reference/caches/storage.py",
        "        return min(n, self.offset - max(self._left_padding, default=0))\n",
        "        return min(n, self.offset)\n",
        "a padded batch trims past its shortest row (ROWS-7)",
        (f"{ROWS}::test_rows_of_their_own_lengths_machine", f"{ROWS}::test_padded_batch_edges"),
    ),
    Mutant(
        "rows-merge-pads-right",
        "reference/rows.py",
        "    return xp.concatenate([zeros, rows], axis=2)\n",
        "    return xp.concatenate([rows, zeros], axis=2)\n",
        "merge pads the shorter rows after their positions, not before (ROWS-9)",
        (f"{ROWS}::test_rows_of_their_own_lengths_machine",),
    ),
    Mutant(
        "rows-prepared-padding-ignored",
        "reference/caches/storage.py",
        "        if self._prepared_padding:\n            self._left_padding",
        "        if not self._prepared_padding:\n            self._left_padding",
        "a left-padded first append forgets its prepared padding (ROWS-11)",
        (f"{ROWS}::test_rows_of_their_own_lengths_machine",),
    ),
    Mutant(
        "rows-donor-starts-unpadded",
        "reference/caches/donor.py",
        "    starts = tuple(row_offset - min(T, row_offset) for row_offset in offsets)\n",
        "    starts = tuple(row_offset - T for row_offset in offsets)\n",
        "donor rows of a padded batch start every row T positions back (ROWS-10, DONOR-1)",
        (f"{ROWS}::test_rows_of_their_own_lengths_machine",),
    ),
    # -- mlx-lm's batched generation through the adapter (accelerated/mlx_lm) ----------
    Mutant(
        "mlx-lm-batch-offset-buffer",
        "accelerated/mlx_lm/cache.py",
        "        return mx.array(self.cache.row_offsets)\n",
        "        return mx.array([self.cache.offset] * self.cache.layout.batch)\n",
        "a batch gives RoPE the buffer offset, not each row's (ROWS-5)",
        (f"{MLX_LM_BATCH}::test_bf16_batch_equals_mlx_lm",),
    ),
    Mutant(
        "mlx-lm-batch-keeps-right-padding",
        "accelerated/mlx_lm/batch.py",
        "        k, v = keys[row : row + 1, :, :length], values[row : row + 1, :, :length]\n",
        "        k, v = keys[row : row + 1], values[row : row + 1]\n",
        "a right-padded chunk stores each row's padding as its positions",
        (f"{MLX_LM_BATCH}::test_bf16_batch_equals_mlx_lm",),
    ),
    Mutant(
        "mlx-lm-batch-filter-ignored",
        "accelerated/mlx_lm/cache.py",
        "            self.cache = rows.filter_rows(self.cache, indices)\n",
        "            self.cache = rows.filter_rows(self.cache, sorted(set(indices)))\n",
        "filter keeps its rows in their old order, a repeated row once (ROWS-8)",
        (f"{MLX_LM_BATCH}::test_batch_offsets_are_per_row",),
    ),
    Mutant(
        "mlx-lm-batch-switch-apart",
        "accelerated/mlx_lm/batch.py",
        "    if not any(switched) or all(switched):\n",
        "    if True:\n",
        "a row still plain joins a switched bf16-first batch unconverted (ROWS-7)",
        (f"{MLX_LM_BATCH}::test_bf16_first_batch_switches_as_one",),
    ),
    Mutant(
        "mlx-record-fields-8-aligned",
        "accelerated/records.py",
        "    while alignment < ROW_ALIGNMENT and row_bytes % (2 * alignment) == 0:\n",
        "    while alignment < 8 and row_bytes % (2 * alignment) == 0:\n",
        "a record's fields are aligned to 8 bytes at most: a kernel's 16-byte loads of a "
        "field may straddle (TQC-1)",
        (f"{RECORDS}::test_a_record_layout_aligns_each_field_to_its_loads_and_pads_the_row",),
    ),
    Mutant(
        "mlx-record-fields-in-slot-order",
        "accelerated/records.py",
        "    order = sorted(range(len(fields)), key=lambda i: -_alignment(sizes[i]))\n",
        "    order = list(range(len(fields)))\n",
        "a record's fields lie in slot order, with gaps where a wider alignment follows a "
        "narrower one (TQC-1)",
        (f"{RECORDS}::test_a_record_layout_aligns_each_field_to_its_loads_and_pads_the_row",),
    ),
    Mutant(
        "mlx-record-read-format-by-layout",
        "accelerated/caches/records.py",
        "        key = (type(self), signature, fields.layout)\n",
        "        key = (type(self), fields.layout)\n",
        "a record's read format is looked up by its layout alone, which two formats can share "
        "(READ-7)",
        (f"{RECORDS}::test_reads_of_one_record_layout_keep_their_own_formats",),
    ),
    Mutant(
        "mlx-record-growth-keeps-rows-past-offset",
        "accelerated/caches/records.py",
        "        kept = self._record if prev % STEP == 0 else self._record[:, :, :prev]\n",
        "        kept = self._record\n",
        "a record's growth off a step boundary keeps the rows past the offset (CACHE-3)",
        (
            f"{KV}::test_quantized_kv_cache_machine",
            f"{TQC}::test_turboquant_kv_cache_machine",
        ),
    ),
    Mutant(
        "mlx-record-row-unpadded",
        "accelerated/records.py",
        "    row_bytes = -(-end // ROW_ALIGNMENT) * ROW_ALIGNMENT\n",
        "    row_bytes = end\n",
        "a record row ends with its last field, so rows after the first start unaligned (TQC-1)",
        (f"{RECORDS}::test_a_record_layout_aligns_each_field_to_its_loads_and_pads_the_row",),
    ),
    Mutant(
        "mlx-record-padding-unset",
        "accelerated/records.py",
        "        parts.append(mx.zeros((*fields[0].shape[:3], padding), mx.uint8))\n",
        "        parts.append(mx.ones((*fields[0].shape[:3], padding), mx.uint8))\n",
        "the bytes past a record's last field are not zero (TQC-1)",
        (
            f"{RECORDS}::test_packed_rows_hold_each_field_at_its_offset_and_zeros_after",
            f"{RECORDS}::test_a_cache_stores_the_reference_fields_in_one_record",
        ),
    ),
    Mutant(
        "mlx-record-read-offset-of-the-next-field",
        "accelerated/caches/records.py",
        "            offsets = tuple(fields.layout.offsets[i] for i in stored)\n",
        "            offsets = tuple(fields.layout.offsets[min(i + 1, 4)] for i in stored)\n",
        "the kernels are told each field of a record lies where the next one does (READ-7)",
        (f"{RECORDS}::test_a_turboquant_read_names_each_field_at_its_record_offset",),
    ),
    Mutant(
        "mlx-slot-variant-unbounded",
        "accelerated/attention_kernels.py",
        '    if max(constants["DK"], constants["DV"]) > BOUNDED_DIM or constants["G"] > '
        "BOUNDED_GROUP:\n",
        "    if True:\n",
        "the compiled step's slot variant takes the registers the compiler gives it, three "
        "blocks an SM for affine 8-bit where the split counts on four (READ-7 on CUDA)",
        (
            f"{CUDA_SOURCE}::{HELD_TO_THE_BLOCKS}",
            "tools/test_cuda_build.py::"
            "test_every_attention_pass_fits_the_blocks_an_sm_its_split_counts_on[tensor-cores]",
        ),
    ),
    Mutant(
        "mlx-kernel-tables-rounded",
        "accelerated/cuda_source.py",
        'f"{float(value)!r}f"',
        'f"{float(value):.6g}f"',
        "the kernels' headers write TurboQuant's codebook and boundaries to six digits, not "
        "the float32 each is (TQ-2 on CUDA)",
        (f"{CUDA_SOURCE}::test_the_kernels_hold_turboquants_tables_bit_for_bit",),
    ),
    Mutant(
        "mlx-step-evaluated-after-the-commits",
        "accelerated/caches/compiled.py",
        "        mx.async_eval(outputs, step_outputs)\n",
        "        pass\n",
        "the compiled step's graph waits for the caller's evaluation, after every commit, "
        "instead of running while the host commits (COMPILE-6)",
        (f"{COMPILED}::test_the_device_starts_before_the_commits",),
    ),
    Mutant(
        "cuda-turbo-group-scores-one-scale",
        "accelerated/cuda/decode_attention.cuh",
        "fmaf(g0.scale(g), full0, s[0][0]);\n"
        "                            s[0][1] = fmaf(g1.scale(g), full1,",
        "fmaf(g0.scale(0), full0, s[0][0]);\n"
        "                            s[0][1] = fmaf(g1.scale(0), full1,",
        "TurboQuant's group scores on tensor cores apply group 0's scale to every group of a "
        "key (READ-7)",
        (FAR_ZERO_READS, EMULATED_FAR_ZERO),
    ),
    Mutant(
        "cuda-turbo-group-scores-pairs-swapped",
        "accelerated/cuda/decode_attention.cuh",
        "0x4140u);\n            k[2 * i + 1] = __byte_perm(biased, 0x64646464u, 0x4342u);",
        "0x4342u);\n            k[2 * i + 1] = __byte_perm(biased, 0x64646464u, 0x4140u);",
        "a k-step of TurboQuant's group scores takes a word's two pairs of codes in each "
        "other's place (READ-7)",
        (
            FAR_ZERO_READS,
            f"{COMPILED}::test_compiled_steps_store_the_eager_bits[turbo k8v4 dense-eager]",
            EMULATED_FAR_ZERO,
        ),
    ),
    Mutant(
        "cuda-turbo-group-scores-offset",
        "accelerated/cuda/decode_attention.cuh",
        "fmaf(g0.zero(g) - 1152.0f, sum, part[i][0]);\n"
        "                            const float full1 = fmaf(g1.zero(g) - 1152.0f,",
        "fmaf(g0.zero(g) - 1024.0f, sum, part[i][0]);\n"
        "                            const float full1 = fmaf(g1.zero(g) - 1024.0f,",
        "TurboQuant's group scores take the codes' float16 offset as 1024, not 1152 (READ-7)",
        (
            FAR_ZERO_READS,
            f"{COMPILED}::test_compiled_steps_store_the_eager_bits[turbo k8v4 dense-eager]",
            EMULATED_FAR_ZERO,
        ),
    ),
    Mutant(
        "cuda-splits-follow-the-buffer",
        "accelerated/cuda/decode_attention.cuh",
        "    const int live_splits =\n"
        "        min(splits, min(MOST_SPLITS, max(1, (T + MIN_SPLIT - 1) / MIN_SPLIT)));\n",
        "    const int live_splits = splits;\n",
        "pass 1 cuts the live rows into as many splits as its launch has room for, which follow "
        "the buffer's capacity and the batch: equal rows read apart (READ-7)",
        (
            f"{EMULATED}::test_equal_rows_read_alike_from_other_buffers[affine-4-64]",
            f"{EMULATED}::test_rows_of_a_batch_read_as_alone[turbo-k8v4-dense]",
        ),
    ),
    Mutant(
        "cuda-padded-rows-from-buffer-row-0",
        "accelerated/cuda/decode_attention.cuh",
        "    const int first = ordering.hidden;\n",
        "    const int first = 0;\n",
        "a padded batch's rows are read from buffer row 0, their padding with them (ROWS-6, "
        "READ-7)",
        (f"{EMULATED}::test_rows_of_a_padded_batch_read_as_alone[affine-4-64]",),
    ),
    Mutant(
        "cuda-ring-pointers-keep-their-run",
        "accelerated/cuda/decode_attention.cuh",
        "                    move_pointers(chunk_rows + shift - carried);\n",
        "                    move_pointers(chunk_rows);\n",
        "after a chunk that leaves its run of rows, a warp's pointers keep the run's shift: a "
        "ring's later chunks read the wrong rows (READ-7)",
        (f"{EMULATED}::test_a_ring_reads_oldest_first[ring-keep-0]",),
    ),
    Mutant(
        "cuda-ring-kept-rows-turned",
        "accelerated/cuda/decode_attention.cuh",
        "        if (u < keep) return 0;\n",
        "",
        "a ring's kept rows are read as if they turned with the others (READ-7)",
        (f"{EMULATED}::test_a_ring_reads_oldest_first[ring-keep-3]",),
    ),
    Mutant(
        "mlx-ring-read-in-buffer-order",
        "accelerated/caches/rotating.py",
        "        return self.keep, (self._index - self.keep) % (rows - self.keep)\n",
        "        return self.keep, 0\n",
        "a wrapped ring is read in buffer order, not oldest first: its reads follow the turn "
        "of its buffer, and a padded ring's rows hide the wrong positions (READ-7, ROWS-6)",
        (
            f"{ROW_ORDER}::test_the_kernels_read_each_rows_positions_oldest_first",
            f"{EMULATED}::test_a_ring_reads_oldest_first[affine-ring-6-64-keep-0]",
        ),
    ),
    Mutant(
        "cuda-ordered-rows-hide-their-whole-padding",
        "accelerated/cuda/decode_attention.cuh",
        "        const int hidden = min(rows, max(0, order[1 + b] - oldest[0]));\n",
        "        const int hidden = min(rows, max(0, order[1 + b]));\n",
        "a padded ring that wrapped hides as many rows as its padding, not the padding's "
        "positions it still holds (ROWS-6)",
        (f"{EMULATED}::test_rows_of_a_padded_batch_read_as_alone[ring-40]",),
    ),
    Mutant(
        "mlx-padded-ring-hides-from-position-0",
        "accelerated/caches/reads.py",
        "        oldest = self.offset - rows\n",
        "        oldest = 0\n",
        "a padded ring that wrapped hides each row's padding as if its oldest row held "
        "position 0 (ROWS-6)",
        (
            f"{ROW_ORDER}::test_the_kernels_read_each_rows_positions_oldest_first",
            f"{EMULATED}::test_rows_of_a_padded_batch_read_as_alone[affine-ring-6-64]",
        ),
    ),
    Mutant(
        "cuda-slot-ring-turned-at-the-write-row",
        "accelerated/cuda/decode_attention.cuh",
        "        return RowOrder{keep, span > 0 ? (written + 1 - keep) % span : 0, rows, 0};\n",
        "        return RowOrder{keep, span > 0 ? (written - keep) % span : 0, rows, 0};\n",
        "the compiled step reads a ring from its write row on, the newest position first, "
        "not the oldest (READ-7, COMPILE-4)",
        (f"{EMULATED}::test_a_compiled_ring_reads_as_the_eager_ring[ring-keep-3]",),
    ),
    Mutant(
        "cuda-slot-ordered-new-position-at-its-buffer-row",
        "accelerated/cuda/decode_attention.cuh",
        "    const int written = !SLOT ? -1 : ORDERED ? T - 1 : slot;\n",
        "    const int written = SLOT ? slot : -1;\n",
        "an ordered slot read takes the new position at the live row of the write row's "
        "number, not at its last live row: a wrapped ring reads a stale row and the new "
        "position in its place (COMPILE-4)",
        (f"{EMULATED}::test_a_compiled_ring_reads_as_the_eager_ring[ring-keep-0]",),
    ),
    Mutant(
        "cuda-slot-softmax-sum-unfused",
        "accelerated/cuda/decode_attention.cuh",
        "            l = l * alpha + (p0 + p1);\n",
        "            l = SLOT ? __fadd_rn(__fmul_rn(l, alpha), p0 + p1) : l * alpha + (p0 + p1);\n",
        "the slot variant rounds the softmax sum's product apart where the others fuse it: a "
        "compiled read parts from the eager read on a GPU alone, not on the emulator, which "
        "fuses nothing (READ-7, COMPILE-4)",
        ("tools/test_cuda_build.py::test_the_variants_of_a_read_compute_alike[tensor-cores]",),
    ),
    Mutant(
        "mlx-kernels-on-any-gpu",
        "accelerated/attention_kernels.py",
        "    return mx.default_device() == mx.gpu and cuda_available()\n",
        "    return mx.default_device() == mx.gpu or cuda_available()\n",
        "the CUDA kernels are asked to answer reads on a GPU that is not CUDA's (Metal) (READ-7)",
        (f"{READ_LAUNCHES}::test_the_kernels_read_on_a_cuda_device_alone",),
    ),
    Mutant(
        "mlx-splits-past-the-most",
        "accelerated/attention_kernels.py",
        "    return max(1, min(_most_splits(kv_heads), math.ceil(T / MIN_SPLIT)))\n",
        "    return max(1, max(_most_splits(kv_heads), math.ceil(T / MIN_SPLIT)))\n",
        "a read is cut into more splits than READ-7's S_max, which sets the order of its "
        "sums (READ-7)",
        (f"{READ_LAUNCHES}::test_a_read_is_split_as_the_spec_says",),
    ),
    Mutant(
        "mlx-scaled-weights-edge-excluded",
        "accelerated/attention_kernels.py",
        "and group * values.dim <= 8 * values.group_size",
        "and group * values.dim < 8 * values.group_size",
        "affine values at G D = 8 group_size (4-bit g64 at D = 128, G = 4) are read without "
        "scaled weights, which the spec gives them (READ-7)",
        (f"{READ_LAUNCHES}::test_the_body_a_read_takes_is_the_specs",),
    ),
    Mutant(
        "mlx-ordered-cuda-core-variant-unbounded",
        "accelerated/attention_kernels.py",
        "    return slot or (ordered and not mma)\n",
        "    return slot\n",
        "the CUDA-core body's ordered variant compiles to more registers than four blocks an SM "
        "leave a thread, so a padded or wrapped read runs a block an SM fewer than its split "
        "counts on (READ-7)",
        (
            f"{CUDA_SOURCE}::{HELD_TO_THE_BLOCKS}",
            "tools/test_cuda_build.py::"
            "test_every_attention_pass_fits_the_blocks_an_sm_its_split_counts_on[cuda-cores]",
        ),
    ),
    Mutant(
        "mlx-record-write-holds-the-record-before",
        "accelerated/caches/records.py",
        "        self._record_fields = None\n",
        "",
        "a record storage's write keeps the RecordFields of the record before it, so that MLX "
        "copies the whole record to write one row where a compiled step's write is evaluated",
        (
            f"{RECORDS}::test_a_decode_write_takes_the_record_over_in_place"
            "[affine 4-bit g64-compiled]",
        ),
    ),
    Mutant(
        "mlx-compiled-ring-read-in-buffer-order",
        "accelerated/caches/rotating.py",
        "        return attention_kernels.padding_order(self.keep, (0,) * layout.batch)\n",
        "        return None  # type: ignore[return-value]\n",
        "the compiled step reads a wrapped ring in buffer order, apart from its eager read "
        "(READ-7, COMPILE-4)",
        (f"{EMULATED}::test_a_compiled_ring_reads_as_the_eager_ring[affine-ring-6-64-keep-0]",),
    ),
    Mutant(
        "cuda-rotated-merge-barrier-missing",
        "accelerated/cuda/decode_attention.cuh",
        "            if (part == 0) lane[turn][d] = value;\n            __syncthreads();\n",
        "            if (part == 0) lane[turn][d] = value;\n",
        "the rotated merge's butterflies across warps read their partner before it is written: "
        "a race no barrier orders (TQ-8, READ-7)",
        (f"{EMULATED}::test_steps_do_not_race[eager-turbo-k8v4-dense]",),
    ),
    Mutant(
        "cuda-affine-scaled-weights-bias-unrescaled",
        "accelerated/cuda/decode_attention.cuh",
        "                if constexpr (SCALED_VALUES) bias_sum *= alpha;\n",
        "",
        "scaled weights' bias sums are not rescaled when a head's maximum moves (READ-7)",
        (
            SCALED_READS,
            f"{DECODE}::test_a_read_whose_maxima_rise_at_every_chunk_is_within_bound[affine-4-64]",
            EMULATED_SCALED_READS,
            f"{EMULATED}::test_reads_whose_maxima_rise_are_within_bound[affine-4-64]",
        ),
    ),
    Mutant(
        "cuda-affine-key-pairs-reversed",
        "accelerated/cuda/decode_attention.cuh",
        "pairs[word * (PER_PAIR_WORD / 2) + i] = bits;",
        "pairs[word * (PER_PAIR_WORD / 2) + (PER_PAIR_WORD / 2 - 1 - i)] = bits;",
        "affine keys' decoded pairs go to the 16-bit MMAs in reverse order within each word, "
        "scored against other query elements (READ-7)",
        (
            f"{DECODE}::test_a_read_of_a_few_one_hot_rows_is_within_bound[4-affine-4-64]",
            f"{EMULATED}::test_reads_of_a_few_one_hot_rows_are_within_bound[affine-4-64]",
        ),
    ),
    Mutant(
        "cuda-affine-8-bit-pair-wrong-byte",
        "accelerated/cuda/decode_attention.cuh",
        "byte(0x7652u + i)",
        "byte(0x7651u + i)",
        "an 8-bit affine pair of bfloat16 scales takes its high code from the byte after its "
        "low one, not two after (AFF-6, READ-7)",
        (
            f"{DECODE}::test_a_read_of_a_few_one_hot_rows_is_within_bound[4-affine-8-32]",
            f"{DECODE}::test_a_decode_read_of_one_row_returns_its_values_as_decoded[default-affine-8-32]",
            f"{EMULATED}::test_reads_of_a_few_one_hot_rows_are_within_bound[affine-8-32]",
        ),
    ),
    Mutant(
        "cuda-affine-scaled-weights-half-offset",
        "accelerated/cuda/decode_attention.cuh",
        "constexpr float OFFSET = 1 << VBITS;",
        "constexpr float OFFSET = 1 << (VBITS - 1);",
        "scaled weights take the codes' offset as 2^(bits - 1), not 2^bits (READ-7)",
        (
            SCALED_READS,
            f"{DECODE}::test_a_decode_read_of_one_row_returns_its_values_as_decoded[default-affine-4-64]",
            EMULATED_SCALED_READS,
            f"{EMULATED}::test_one_row_reads_return_its_values[affine-4-64]",
        ),
    ),
)


def copy_project(root: Path) -> tuple[Path, Path]:
    """The project under root/project, and root/path/kvspec linking its packages."""
    project, path = root / "project", root / "path"
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.egg-info")
    for name in COPIED:
        source = PROJECT / name
        if source.is_dir():
            shutil.copytree(source, project / name, ignore=ignore)
        else:
            project.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, project / name)
    (path / "kvspec").mkdir(parents=True)
    for package in PACKAGES:
        (path / "kvspec" / package).symlink_to(project / package)
    return project, path


def apply(mutant: Mutant, project: Path) -> None:
    """Replace the mutant's text; ValueError unless it occurs exactly once."""
    target = project / mutant.path
    text = target.read_text()
    count = text.count(mutant.before)
    if count != 1:
        raise ValueError(f"{mutant.name}: its text occurs {count} times in {mutant.path}")
    target.write_text(text.replace(mutant.before, mutant.after))


def copy_environment(path: Path, profile: str) -> dict[str, str]:
    """The environment of a run on a copy linked at `path`: the copy first on the import
    path, then what the environment already puts there (where MLX itself may live, as on a
    machine that unpacks it apart)."""
    search = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": search, "HYPOTHESIS_PROFILE": profile}


def run_tests(mutant: Mutant, profile: str, timeout: float) -> tuple[str, float]:
    """('caught' | 'missed' | 'error: ...', seconds) of one run on a fresh copy."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        project, path = copy_project(Path(tmp))
        try:
            apply(mutant, project)
        except ValueError as error:
            return f"error: {error}", 0.0
        env = copy_environment(path, profile)
        # The tests' own imports, MLX's among them: a test that cannot import is no catch.
        probe = "import mlx.core, kvspec.reference.caches as c; print(c.__file__)"
        where = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False
        )
        if not where.stdout.startswith(str(path)):
            said = (where.stdout + where.stderr).strip().splitlines()[-1:]
            return f"error: the copy is not what imports ({' '.join(said)})", 0.0
        command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
        began = time.monotonic()
        try:
            result = subprocess.run(
                [*command, *mutant.tests],
                cwd=project,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return "error: timed out", time.monotonic() - began
        seconds = time.monotonic() - began
    if result.returncode == 1:
        return "caught", seconds
    if result.returncode == 0:
        return "missed", seconds
    tail = (result.stdout + result.stderr).strip().splitlines()[-1:]
    return f"error: exit {result.returncode} {' '.join(tail)}", seconds


def table(rows: Sequence[tuple[Mutant, list[str], float]]) -> str:
    lines = ["| mutant | file | fault | tests | result | seconds |", "|---|---|---|---|---|---|"]
    for mutant, results, seconds in rows:
        tests = "<br>".join(test.removeprefix("conformance/") for test in mutant.tests)
        lines.append(
            f"| {mutant.name} | {mutant.path} | {mutant.fault} | {tests} | "
            f"{', '.join(results)} | {seconds:.0f} |"
        )
    return "\n".join(lines)


def select(names: Sequence[str]) -> list[Mutant]:
    if not names:
        return list(CATALOGUE)
    by_name = {mutant.name: mutant for mutant in CATALOGUE}
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise SystemExit(f"unknown mutants: {', '.join(unknown)} (--list shows them)")
    return [by_name[name] for name in names]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutants", nargs="*", help="names from the catalogue (default: all)")
    parser.add_argument("--list", action="store_true", help="print the catalogue and exit")
    parser.add_argument("--runs", type=int, default=1, help="runs of each mutant (default 1)")
    parser.add_argument(
        "--profile",
        default="mutants",
        help="hypothesis profile (default mutants: ci's examples, no shrinking)",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per run")
    args = parser.parse_args(argv)
    chosen = select(args.mutants)
    if args.list:
        for mutant in chosen:
            print(f"{mutant.name}: {mutant.path}: {mutant.fault}")
        return 0
    rows = []
    for mutant in chosen:
        results, total = [], 0.0
        for _ in range(args.runs):
            result, seconds = run_tests(mutant, args.profile, args.timeout)
            results.append(result)
            total += seconds
        print(f"{mutant.name}: {', '.join(results)} ({total:.0f} s)", file=sys.stderr)
        rows.append((mutant, results, total / args.runs))
    print(table(rows))
    return 0 if all(result == "caught" for _, results, _ in rows for result in results) else 1


if __name__ == "__main__":
    sys.exit(main())
