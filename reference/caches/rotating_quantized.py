"""`RotatingQuantizedKVCache`: the ring of RING-1 in the affine format (spec QRING-1,
QRING-2)."""

from __future__ import annotations

from kvspec.reference.caches.quantized import AffineFields, check_affine_parameters
from kvspec.reference.caches.rotating import RingStorage


class RotatingQuantizedKVCache(AffineFields, RingStorage):
    """An affine ring (QRING-1): RotatingKVCache's state machine over the six affine
    fields. Every written ring position equals quantizing the bf16 ring at the same
    position, bit for bit, because positions are encoded one by one and moved as wholes.

    Slot order (RING-6): k_words, k_scales, k_biases, v_words, v_scales, v_biases, each
    [B, H, T, *] in ring order.
    """

    def __init__(
        self,
        max_size: int,
        group_size: int = 64,
        bits: int = 8,
        keep: int = 0,
        checks: str = "eager",
    ) -> None:
        check_affine_parameters(group_size, bits)
        super().__init__(max_size, keep, checks)
        self.group_size = group_size
        self.bits = bits

    def signature(self) -> str:
        return f"kv:rotating-affine:{self.max_size}:{self.keep}:{self.bits}:{self.group_size}"
