"""Micro-batches as data (torch, no collectives): the batch layout, per-sample counts for the cost,
and byte-exact packing of samples."""

from reorder.batch.counting import count_samples, square_patches, token_counts
from reorder.batch.layout import BatchLayout, LayoutError, describe, rebuild

__all__ = ["BatchLayout", "LayoutError", "count_samples", "describe", "rebuild", "square_patches", "token_counts"]
