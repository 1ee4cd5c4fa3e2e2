"""Donor reads on MLX (spec DONOR-1, DONOR-2): the reference's, over the MLX caches' own
decoding and reads."""

from kvspec.reference.caches.donor import DonorRows, capture_donor_attention, capture_donor_rows

__all__ = ["DonorRows", "capture_donor_attention", "capture_donor_rows"]
