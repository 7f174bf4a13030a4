"""One window of every module of a heterogeneous world (each module its own DP size) on emulated
ranks: threads of this process with real rendezvous (`reorder.exchange.collectives.run_emulated`).
The demo's `--emulated` mode and the tests use it; it needs nothing outside the installed package."""

from __future__ import annotations

from dataclasses import dataclass

from reorder.cli import synthetic as syn
from reorder.cli.synthetic import module_fields
from reorder.exchange.collectives import run_emulated
from reorder.exchange.exchanger import WindowExchanger
from reorder.integrations.megatron import select_fields
from reorder.plan.cost import CostModel
from reorder.plan.grid import Grid, canonical_grid


@dataclass
class ModuleResult:
    dp: int
    outputs: list  # [rank][slot] reordered micro-batches
    reports: list  # [rank] WindowReport


def run_window(global_batches, dp_by_module: dict, *, cost: CostModel, balancer: str = "lpt",
               window_size: int | None = None, batch_dims=None, exchanger_kwargs: dict | None = None) -> dict:
    """Exchange one window for every module (fields per MODULE_FIELDS, or all fields);
    exchanger_kwargs: more WindowExchanger arguments (device, early_copy, ...)."""
    groups = canonical_grid(list(dp_by_module.values()))
    B = global_batches[0]["input_ids"].shape[0]
    out = {}
    for name, dp in dp_by_module.items():
        fields = module_fields(name, cost)

        def rank_fn(r, coll, dp=dp, fields=fields):
            ex = WindowExchanger(grid=Grid(size=groups, dp=dp, rank=r), micro_batch_size=B, cost=cost,
                                 balancer=balancer, window_size=window_size or len(global_batches),
                                 collectives=coll if dp > 1 else None, batch_dims=batch_dims,
                                 **(exchanger_kwargs or {}))
            mine = [syn.rank_share(g, dp, r) for g in global_batches]
            return ex.exchange([select_fields(mine_s, fields) for mine_s in mine])

        res = run_emulated(dp, rank_fn)
        out[name] = ModuleResult(dp, [o for o, _ in res], [rep for _, rep in res])
    return out
