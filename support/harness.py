"""Run a heterogeneous window exchange (several modules, each with its own DP size) on emulated
ranks in one process, and check every invariant of the spec on the result."""

from __future__ import annotations

import numpy as np

from support import checks
from reorder.batch.counting import square_patches, token_counts
from reorder.cli.emulated import ModuleResult, run_window  # noqa: F401 - the harness's callers use them
from reorder.cli.synthetic import MODULE_FIELDS, module_fields  # noqa: F401 - the harness's callers use them
from reorder.plan.cost import CostModel
from reorder.plan.grid import canonical_grid

def module_costs(global_batches, name: str, cost: CostModel) -> np.ndarray:
    """float64 [W, B]: the costs of the natural global micro-batches, computed from the fields module
    `name`'s ranks load (I1 compares them across modules; a module without its own list loads all)."""
    fields = module_fields(name, cost) or ("input_ids", "attention_mask")
    rows = []
    for g in global_batches:
        counts = token_counts(cost, g["input_ids"], g["attention_mask"] if "attention_mask" in fields else None)
        sq = square_patches(cost, g["input_ids"]).numpy() if cost.encoder_quadratic_weight else None
        rows.append(cost.costs(counts[0].numpy(), counts[1].numpy(), sq, counts[2].numpy()))
    return np.stack(rows)


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
