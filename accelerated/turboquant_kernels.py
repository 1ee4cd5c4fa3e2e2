"""TurboQuant's decode and encode as one CUDA kernel each (spec TQ-3 .. TQ-10), for MLX's
CUDA backend. The code is accelerated/cuda/turboquant.cuh (decode_row, encode_rows); the
kernels handed to MLX include it and call into it (cuda_source.included).

Decode: one thread block per stored vector, one thread per coordinate. Each thread
unpacks its key code and value code straight from the packed bytes, decodes the key as
(code + zero) * scale and the value as centroid[code] * scale, and, unless the values
stay rotated, the block unrotates them: butterflies at strides 1, 2, ..., D/2 (within a
warp by shuffles, across warps through shared memory), one multiply by f32(1/sqrt(D)),
then the signs. Encode: one thread per ELEMENTS_PER_THREAD coordinates; a decode step's
vectors (up to 4096 coordinates) take one block, more take blocks of at most 1024
coordinates and 256 threads (at least one vector); each runs TQ-4's key groups, TQ-6's
rotation, TQ-7's rms and boundary search and TQ-9's packing, with DEFER-1's stored
failures and DEFER-2's rank, and writes each position's fields as one record
(accelerated/records.py).
Every float step is an explicitly rounded IEEE intrinsic (`__fadd_rn`, `__fsub_rn`,
`__fmul_rn`, `__fdiv_rn`), so neither compiler flags nor FMA contraction can change a
bit: the result equals the plain MLX path (and the reference) bit for bit.
"""

from __future__ import annotations

from functools import cache, lru_cache

import mlx.core as mx

from kvspec.accelerated.affine_kernels import EncodeLaunch
from kvspec.accelerated.cuda_source import KERNELS_MADE, cuda_kernel, device_array, included
from kvspec.accelerated.records import RecordLayout
from kvspec.reference import turboquant as reference
from kvspec.reference.turboquant import DEFERRED_CHECKS
from kvspec.reference.turboquant_tables import INV_SQRT_BITS

#: Elements of a row each encode thread takes (encode_rows' P: 1, 2, 4 or 8). The
#: coordinates an encode takes in one block (a decode step's of up to 32 heads of 128: its
#: shared buffers then take 40 KiB of the 48 a block holds statically, and its ranks need no
#: fold); and, where one block would need more, the coordinates and threads of each of the
#: encode's blocks (shared buffers of 10 KiB, so that several blocks fit an SM).
ELEMENTS_PER_THREAD = 8
_ONE_BLOCK_MOST = 4096
_BLOCK_ELEMENTS = 1024
_BLOCK_THREADS = 256

#: The kernels' code (cuda_source.included): the source MLX builds at every call is a call.
_INCLUDE = included("turboquant.cuh")

#: The arrays of TurboQuant's constants that a kernel's header holds (`constants_header`):
#: the value codebook and its boundaries (TQ-2), the sign vector of the head dim (TQ-1).
CODEBOOK = "kvspec_codebook"
BOUNDARIES = "kvspec_boundaries"
SIGNS = "kvspec_signs"


def constants_header(codebook_bits: int = 0, boundary_bits: int = 0, signs_dim: int = 0) -> str:
    """Header lines declaring the codebook of `codebook_bits`, the boundaries of
    `boundary_bits` and the signs of `signs_dim` (none for 0): the reference's tables, held
    by the kernels that read them instead of taken as inputs, arrays that MLX would hand a
    launch at every step. The bits and the head dim are in each kernel's name (its
    constants), so one name holds one set of tables."""
    lines = ""
    if codebook_bits:
        lines += device_array(CODEBOOK, reference.centroids(codebook_bits))
    if boundary_bits:
        lines += device_array(BOUNDARIES, reference.boundaries(boundary_bits))
    if signs_dim:
        lines += device_array(SIGNS, reference.signs(signs_dim))
    return lines


_DECODE_CALL = (
    "kvspec_tq::decode_row<D, KBITS, VBITS, DEFER, INV_SQRT_BITS>(k_idx, k_scales, k_zeros, "
    "v_packed, v_scales, centroids, signs, keys, values);"
)
_ENCODE_CALL = (
    "kvspec_tq::encode_rows<T, D, P, CAP, KBITS, VBITS, INV_SQRT_BITS, CHECKS, ROW_BYTES, "
    f"OFF_KI, OFF_KS, OFF_KZ, OFF_VP, OFF_VS>(k, k_shape, v, {BOUNDARIES}, {SIGNS}, prior, "
    "record, total);"
)


@cache
def _kernel(head_dim: int, k_bits: int, v_bits: int, defer_v: bool) -> object:
    constants = (
        ("D", head_dim),
        ("KBITS", k_bits),
        ("VBITS", v_bits),
        ("DEFER", defer_v),
        ("INV_SQRT_BITS", INV_SQRT_BITS[head_dim]),
    )
    return cuda_kernel(
        "kvspec_turboquant_decode",
        _DECODE_CALL,
        constants,
        input_names=["k_idx", "k_scales", "k_zeros", "v_packed", "v_scales", "centroids", "signs"],
        output_names=["keys", "values"],
        header=_INCLUDE,
    )


def fused_decode(
    k_idx: mx.array,
    k_scales: mx.array,
    k_zeros: mx.array,
    v_packed: mx.array,
    v_scales: mx.array,
    centroids: mx.array,
    signs: mx.array,
    k_bits: int,
    v_bits: int,
    head_dim: int,
    defer_v: bool,
) -> tuple[mx.array, mx.array]:
    """float32 keys and values [B, H, L, head_dim] of the stored fields, in one launch.

    The fields are validated by the caller (turboquant.decode) and cut to the positions
    to read; `centroids` is the value codebook and `signs` the head_dim's sign vector.
    """
    B, H, L, _ = k_scales.shape
    shape = (B, H, L, head_dim)
    rows = B * H * L
    if rows == 0:
        return mx.zeros(shape, mx.float32), mx.zeros(shape, mx.float32)
    keys, values = _kernel(head_dim, k_bits, v_bits, defer_v)(
        inputs=[k_idx, k_scales, k_zeros, v_packed, v_scales, centroids, signs],
        grid=(rows * head_dim, 1, 1),
        threadgroup=(head_dim, 1, 1),
        output_shapes=[shape, shape],
        output_dtypes=[mx.float32, mx.float32],
    )
    return keys, values


@cache
def _encode_kernel(
    dtype: mx.Dtype,
    D: int,
    elements: int,
    capacity: int,
    k_bits: int,
    v_bits: int,
    layout: RecordLayout,
) -> object:
    offsets = zip(("OFF_KI", "OFF_KS", "OFF_KZ", "OFF_VP", "OFF_VS"), layout.offsets, strict=True)
    constants = (
        ("T", dtype),  # names the instance: NVRTC compiles one per input dtype
        ("D", D),
        ("P", elements),
        ("CAP", capacity),
        ("KBITS", k_bits),
        ("VBITS", v_bits),
        ("INV_SQRT_BITS", INV_SQRT_BITS[D]),
        ("CHECKS", len(DEFERRED_CHECKS)),
        ("ROW_BYTES", layout.row_bytes),
        *offsets,
    )
    return cuda_kernel(
        "kvspec_turboquant_encode",
        _ENCODE_CALL,
        constants,
        input_names=["k", "v", "prior"],
        output_names=["record", "total"],
        header=_INCLUDE + constants_header(boundary_bits=v_bits, signs_dim=D),
    )


@lru_cache(maxsize=64)
def encode_launch(
    shape: tuple[int, ...], dtype: mx.Dtype, k_bits: int, v_bits: int, layout: RecordLayout
) -> EncodeLaunch:
    """The five stored fields of k, v of `shape` and `dtype` [B, H, L, D] (TQ-10) as one
    record uint8 [B, H, L, row_bytes] of `layout` (accelerated/records.py), and the failure
    (uint32 [1]): the largest DEFER-2 rank of any row and of the prior (uint32 [1]), in one
    launch, made once per shape (a decode step encodes the same shape at every layer and
    step). Called with (k, v, prior=), unchecked: shapes, dtypes and widths are validated by
    the caller (turboquant.record_encoder). Groups that fail are stored as DEFER-1 says.
    Rows of 4096 coordinates or fewer (a decode step's) take one block; more take blocks of
    at most 1024 coordinates and 256 threads, at least one row, whose ranks are folded by
    one more op. A shape of no rows is refused (ValueError): there is no launch of nothing."""
    B, H, L, D = shape
    rows = B * H * L
    if rows == 0:
        raise ValueError(f"an encode of shape {shape} has no rows: nothing to launch")
    threads = D // ELEMENTS_PER_THREAD
    one_block = rows * D <= _ONE_BLOCK_MOST
    # Shared buffers of the blocks' size wherever the rows fit them: most decode steps then
    # share the prefill's kernel instance.
    wide = one_block and rows * D > _BLOCK_ELEMENTS
    capacity = _ONE_BLOCK_MOST if wide else _BLOCK_ELEMENTS
    # A block's rows fill its shared buffers at most.
    per_block = rows if one_block else max(1, min(_BLOCK_THREADS // threads, capacity // D))
    blocks = -(-rows // per_block)
    options = {
        "grid": (blocks * threads, per_block, 1),
        "threadgroup": (threads, per_block, 1),
        "output_shapes": [(B, H, L, layout.row_bytes), (blocks,)],
        "output_dtypes": [mx.uint8, mx.uint32],
    }
    kernel = _encode_kernel(dtype, D, ELEMENTS_PER_THREAD, capacity, k_bits, v_bits, layout)
    return EncodeLaunch(kernel, options, blocks > 1)


#: The kernel objects this module keeps made (as attention_kernels.KERNEL_CACHES).
KERNEL_CACHES = (_kernel, _encode_kernel, encode_launch, KERNELS_MADE)
