"""reorder: rebalance multimodal micro-batches across data-parallel ranks (Megatron-Core MIMO).

Core pieces: `canonical_grid` / `Grid` (where samples belong), `CostModel` (per-sample cost from
input_ids / attention_mask), `plan_orders` + balancers (who goes where), `WindowExchanger` (one
rank's window exchange over any `Collectives`), `ReorderingBuffer` (the iterator a training loop
uses), `ReorderConfig` / `CanonicalBatchSampler` (Megatron fields, scalable reads), `ReorderError`
(raised on every rank together). Megatron-Core glue: `reorder.megatron` (imported lazily).
"""

from reorder.balancers import BALANCERS, get_balancer
from reorder.buffer import ReorderingBuffer
from reorder.collectives import CollectiveError, EmulatedGroup, run_emulated
from reorder.config import ReorderConfig
from reorder.cost import CostModel
from reorder.exchange import ReorderError, WindowExchanger, WindowReport
from reorder.grid import Grid, canonical_grid, check_global_batch
from reorder.layout import LayoutError
from reorder.plan import plan_orders, rank_loads
from reorder.sampler import CanonicalBatchSampler

__all__ = [
    "BALANCERS", "CanonicalBatchSampler", "CollectiveError", "CostModel", "EmulatedGroup", "Grid", "LayoutError",
    "ReorderConfig", "ReorderError", "ReorderingBuffer", "WindowExchanger", "WindowReport", "canonical_grid", "check_global_batch", "get_balancer", "plan_orders",
    "rank_loads", "run_emulated",
]
