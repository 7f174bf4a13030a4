"""The exchange: the collectives interface (emulated and torch.distributed) and the window driver,
the only code that calls collectives."""
