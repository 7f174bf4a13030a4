"""Planning, pure numpy (numbers in, numbers out; no torch, no collectives): the canonical grid,
balancers, the cost model, per-slot orders and the cost-benefit gate, the window plan, the metadata
wire format, and one rank's move list (segment tables) for a window."""
