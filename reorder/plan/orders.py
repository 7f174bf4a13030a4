"""Plan a window: per-slot canonical orders from per-slot costs, and the loads that judge them."""

from __future__ import annotations

import numpy as np

from reorder.plan.balancers import check_costs, get_balancer, lower_bound, quick_lower_bound


def plan_orders(costs: np.ndarray, groups: int, balancer: str = "lpt") -> np.ndarray:
    """int64 [W, B] canonical orders for float64 costs [W, B]; each slot is planned on its own (I7).
    Bad costs or groups raise the balancers' ValueError (`check_costs`), naming the slot and sample."""
    costs = check_costs(costs, groups, slots=True)
    fn = get_balancer(balancer)
    out = np.empty(costs.shape, dtype=np.int64)
    for s in range(costs.shape[0]):
        out[s] = fn(costs[s], groups)
    return out


def rank_loads(costs: np.ndarray, orders: np.ndarray | None, dp: int) -> np.ndarray:
    """float64 [W, dp] summed cost per rank; natural assignment when `orders` is None."""
    costs = np.asarray(costs, dtype=np.float64)
    if orders is not None:
        costs = costs[np.arange(len(costs))[:, None], orders]
    w, b = costs.shape
    return costs.reshape(w, dp, b // dp).sum(axis=2)


def _does_not_pay(before, after, min_gain, min_saving) -> np.ndarray:
    """bool [W]: the gate's test, max loads `before` -> `after` per slot (either threshold may be None)."""
    fails = np.zeros(len(before), dtype=bool)
    if min_gain is not None:
        with np.errstate(divide="ignore", invalid="ignore"):
            fails |= np.where(before > 0, 1 - after / before, 0.0) <= min_gain
    if min_saving is not None:
        fails |= before - after <= min_saving
    return fails


def _keep_natural(orders, gated):
    out = np.array(orders, dtype=np.int64, copy=True)
    out[gated] = np.arange(out.shape[1], dtype=np.int64)
    return out, gated


def plan_gated_orders(costs: np.ndarray, groups: int, balancer: str, min_gain: float | None = None,
                      min_saving: float | None = None):
    """plan_orders, then the cost-benefit gate: keep the natural assignment for every slot whose plan
    does not pay. With max_before / max_after the max group load of the natural / planned
    assignment, a slot is gated when its relative gain 1 - max_after / max_before is <= `min_gain`,
    or its saving max_before - max_after (cost units: ms when the cost weights are calibrated in ms)
    is <= `min_saving` (None: that test is off). Depends only on costs, G and the two thresholds, so
    every rank of every module takes the same decision. Slots that cannot pay are not planned:
    a plan's saving is at most max_before - (a proven lower bound on the optimal max load), so a
    slot whose bound already fails the gate keeps its natural order unplanned (a gated window costs
    almost nothing). The bound is a float sum like the loads (exact for integer costs), and every
    rank computes the same one. Returns (orders [W, B], bool [W] gated)."""
    costs = np.asarray(costs, dtype=np.float64)
    w, batch = costs.shape
    if min_gain is None and min_saving is None:
        return plan_orders(costs, groups, balancer), np.zeros(w, dtype=bool)
    before = rank_loads(costs, None, groups).max(axis=1)
    # the cheap bound first; the tighter one only where the cheap one leaves the slot open
    hopeless = _does_not_pay(before, np.array([quick_lower_bound(c, groups) for c in costs]), min_gain, min_saving)
    open_ = np.flatnonzero(~hopeless)
    hopeless[open_] = _does_not_pay(before[open_], np.array([lower_bound(costs[s], groups) for s in open_]),
                                    min_gain, min_saving)
    orders = np.tile(np.arange(batch, dtype=np.int64), (w, 1))
    if hopeless.all():  # natural everywhere: saving 0 fails either test, so every slot is gated
        return orders, hopeless
    orders[~hopeless] = plan_orders(costs[~hopeless], groups, balancer)
    after = rank_loads(costs, orders, groups).max(axis=1)
    return _keep_natural(orders, _does_not_pay(before, after, min_gain, min_saving))
