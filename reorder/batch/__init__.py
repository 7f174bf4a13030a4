"""Micro-batches as data (torch, no collectives): the batch layout, per-sample counts for the cost,
and byte-exact packing of samples."""
