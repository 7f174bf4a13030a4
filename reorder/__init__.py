"""reorder: rebalance multimodal micro-batches across data-parallel ranks (Megatron-Core MIMO).

Core pieces: `canonical_grid` / `Grid` (where samples belong), `CostModel` (per-sample cost from
input_ids / attention_mask), `plan_orders` + balancers (who goes where), `WindowExchanger` (one
rank's window exchange over any `Collectives`), `ReorderingBuffer` (the iterator a training loop
uses), `ReorderConfig` / `CanonicalBatchSampler` (Megatron fields, scalable reads), `ReorderError`
(raised on every rank together). Megatron-Core glue: `reorder.integrations.megatron` (imported lazily).
"""

from reorder.plan.balancers import BALANCERS, get_balancer
from reorder.runtime.buffer import ReorderingBuffer
from reorder.exchange.collectives import CollectiveError, EmulatedGroup, run_emulated
from reorder.integrations.config import ReorderConfig
from reorder.plan.cost import CostModel
from reorder.exchange.exchanger import ReorderError, WindowExchanger, WindowReport
from reorder.plan.grid import Grid, canonical_grid, check_global_batch, check_micro_batch_size
from reorder.batch.layout import LayoutError
from reorder.plan.orders import plan_orders, rank_loads
from reorder.integrations.sampler import CanonicalBatchSampler

__all__ = [
    "BALANCERS", "CanonicalBatchSampler", "CollectiveError", "CostModel", "EmulatedGroup", "Grid", "LayoutError",
    "ReorderConfig", "ReorderError", "ReorderingBuffer", "WindowExchanger", "WindowReport", "canonical_grid", "check_global_batch",
    "check_micro_batch_size", "get_balancer", "plan_orders",
    "rank_loads", "run_emulated",
]
