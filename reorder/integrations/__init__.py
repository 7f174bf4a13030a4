"""Glue to training frameworks: config fields and flags, the canonical sampler, Megatron-Core wiring,
cost calibration. Framework packages are imported lazily, inside functions."""
