"""Planning, pure numpy (numbers in, numbers out; no torch, no collectives): the canonical grid,
balancers, per-slot orders and the cost-benefit gate, and one rank's routes for a window."""
