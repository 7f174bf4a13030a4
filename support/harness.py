"""Run a heterogeneous window exchange (several modules, each with its own DP size) on emulated
ranks in one process, and check every invariant of the spec on the result."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from support import checks
from reorder.cli import synthetic as syn
from reorder.cli.synthetic import MODULE_FIELDS, module_fields  # noqa: F401 - the harness's callers use them
from reorder.exchange.collectives import run_emulated
from reorder.exchange.exchanger import WindowExchanger
from reorder.integrations.megatron import select_fields
from reorder.plan.cost import CostModel
from reorder.plan.grid import Grid, canonical_grid

def module_costs(global_batches, name: str, cost: CostModel) -> np.ndarray:
    """float64 [W, B]: the costs of the natural global micro-batches, computed from the fields module
    `name`'s ranks load (I1 compares them across modules; a module without its own list loads all)."""
    fields = module_fields(name, cost) or ("input_ids", "attention_mask")
    rows = []
    for g in global_batches:
        counts = cost.token_counts(g["input_ids"], g["attention_mask"] if "attention_mask" in fields else None)
        sq = cost.square_patches(g["input_ids"]).numpy() if cost.encoder_quadratic_weight else None
        rows.append(cost.costs(counts[0].numpy(), counts[1].numpy(), sq, counts[2].numpy()))
    return np.stack(rows)


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
            ex = WindowExchanger(grid=Grid(groups=groups, dp=dp, rank=r), micro_batch_size=B, cost=cost,
                                 balancer=balancer, window_size=window_size or len(global_batches),
                                 collectives=coll if dp > 1 else None, batch_dims=batch_dims,
                                 **(exchanger_kwargs or {}))
            mine = [syn.rank_share(g, dp, r) for g in global_batches]
            return ex.exchange([select_fields(mine_s, fields) for mine_s in mine])

        res = run_emulated(dp, rank_fn)
        out[name] = ModuleResult(dp, [o for o, _ in res], [rep for _, rep in res])
    return out


def check_window(global_batches, results: dict, *, cost: CostModel, balancer: str, vision_start_token_id: int):
    """All of I1-I8 on one exchanged window; raises InvariantViolation."""
    dps = {m: r.dp for m, r in results.items()}
    groups = canonical_grid(list(dps.values()))
    for name, res in results.items():
        checks.check_module(global_batches, res.outputs, res.reports[0].orders, res.dp, groups=groups,
                            vision_start_token_id=vision_start_token_id, fields=module_fields(name, cost))
    held = {m: [[checks.ids_of(res.outputs[r][s]) for s in range(len(global_batches))] for r in range(res.dp)]
            for m, res in results.items()}
    costs = {name: module_costs(global_batches, name, cost) for name in results}
    checks.check_modules(global_batches, held, {m: [rep.orders for rep in res.reports] for m, res in results.items()},
                         costs, dps, groups=groups, balancer=balancer)
