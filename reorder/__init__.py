"""reorder: rebalance multimodal micro-batches across data-parallel ranks (Megatron-Core MIMO).

Core pieces: `canonical_grid` / `Grid` (where samples belong), `CostModel` (per-sample cost from
input_ids / attention_mask), `plan_orders` + balancers (who goes where), `WindowExchanger` (one
rank's window exchange over any `Collectives`), `ReorderError` (raised on every rank together).
"""

from reorder.balancers import BALANCERS, get_balancer
from reorder.collectives import CollectiveError, EmulatedGroup, run_emulated
from reorder.cost import CostModel
from reorder.exchange import ReorderError, WindowExchanger, WindowReport
from reorder.grid import Grid, canonical_grid, check_global_batch
from reorder.layout import LayoutError
from reorder.plan import plan_orders, rank_loads

__all__ = [
    "BALANCERS", "CollectiveError", "CostModel", "EmulatedGroup", "Grid", "LayoutError", "ReorderError",
    "WindowExchanger", "WindowReport", "canonical_grid", "check_global_batch", "get_balancer", "plan_orders",
    "rank_loads", "run_emulated",
]
