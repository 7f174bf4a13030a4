"""Glue to training frameworks: config fields and flags, the canonical sampler, Megatron-Core wiring,
cost calibration. Framework packages are imported lazily, inside functions."""

from reorder.integrations.config import ReorderConfig, add_reorder_args
from reorder.integrations.sampler import CanonicalBatchSampler

__all__ = ["CanonicalBatchSampler", "ReorderConfig", "add_reorder_args"]
