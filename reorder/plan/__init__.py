"""Planning, pure numpy (numbers in, numbers out; no torch, no collectives): the canonical grid,
balancers, the cost model, per-slot orders and the cost-benefit gate, the window plan, the metadata
wire format, and one rank's move list (segment tables) for a window."""

from reorder.plan.backoff import Backoff
from reorder.plan.balancers import BALANCERS, get_balancer
from reorder.plan.cost import CostModel
from reorder.plan.counts import COLUMNS, SampleCounts
from reorder.plan.grid import Grid, canonical_grid, check_micro_batch_size
from reorder.plan.moves import MoveList, build_moves
from reorder.plan.orders import plan_orders, rank_loads
from reorder.plan.segments import Segments
from reorder.plan.window import PlanSettings, WindowPlan, plan_window

__all__ = ["BALANCERS", "COLUMNS", "Backoff", "CostModel", "Grid", "MoveList", "PlanSettings", "SampleCounts",
           "Segments", "WindowPlan", "build_moves", "canonical_grid", "check_micro_batch_size", "get_balancer",
           "plan_orders", "plan_window", "rank_loads"]
