"""Plan a window: from every rank's counts, the canonical orders and everything they imply.

`plan_window` is pure (numpy in, a frozen `WindowPlan` out; no torch, no collectives), and every
rank of every module computes the same plan from the same gathered counts. A module of DP size 1,
a window the cost-benefit gate keeps natural, shadow mode and cross-slot balancing are cases of the
same plan, not separate code paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from reorder.plan.balancers import get_balancer
from reorder.plan.cost import CostModel
from reorder.plan.counts import SampleCounts
from reorder.plan.grid import Grid
from reorder.plan.orders import plan_gated_orders, rank_loads


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanSettings:
    """How a window is planned (identical on every rank; checked once through the config frame).

    balancer: a name of `BALANCERS`; min_gain / min_saving: the cost-benefit gate (a slot keeps its
    natural order unless the relative gain exceeds min_gain and the saving, in cost units, exceeds
    min_saving; None: that test is off); cross_slot: one assignment over the window's W x G
    (slot, group) cells, so samples may change micro-batch (only when the optimizer steps once per
    window and the loss is normalized over it); shadow: plan and report, move nothing; given_costs:
    the costs are the caller's per-sample values (the cost_bits column), not the cost model's."""

    balancer: str = "balanced"
    min_gain: float | None = None
    min_saving: float | None = None
    cross_slot: bool = False
    shadow: bool = False
    given_costs: bool = False

    def __post_init__(self):
        get_balancer(self.balancer)  # raises with the list of names
        if self.min_gain is not None and (isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float))
                                          or not 0 <= self.min_gain < 1):
            raise ValueError(f"min_gain={self.min_gain!r} is invalid: the relative gain threshold must be in [0, 1)")
        if self.min_saving is not None and (isinstance(self.min_saving, bool)
                                            or not isinstance(self.min_saving, (int, float))
                                            or not math.isfinite(self.min_saving) or self.min_saving < 0):
            raise ValueError(f"min_saving={self.min_saving!r} is invalid: the saving threshold (cost units) must be "
                             "a finite number >= 0")

    @property
    def gated(self) -> bool:
        return self.min_gain is not None or self.min_saving is not None


class LoadFigures:
    """Figures of a window's per-rank loads `loads_before` / `loads_after` [W, dp] (natural vs
    planned), shared by the plan and the driver's report."""

    __slots__ = ()

    @property
    def max_before(self) -> float:
        """Sum over slots of the max per-rank load, natural assignment."""
        return float(self.loads_before.max(axis=1).sum())

    @property
    def max_after(self) -> float:
        """Sum over slots of the max per-rank load, planned assignment."""
        return float(self.loads_after.max(axis=1).sum())

    @property
    def spread_before(self) -> float:
        return spread(self.loads_before)

    @property
    def spread_after(self) -> float:
        return spread(self.loads_after)


@dataclass(frozen=True, kw_only=True)
class WindowPlan(LoadFigures):
    """One window's plan, from every rank's view alike.

    orders [W, B]: slot s's canonical order (natural indices); with cross_slot, row s lists the
    window's flat natural ids (slot * B + j) that make up output slot s. dest_slot / dest_pos
    [W * B]: where each natural sample (flat id) goes. gated [W]: slots the gate kept natural.
    costs [W, B]; loads_before / loads_after [W, dp]: per-rank cost, natural vs planned. moved
    [W, B]: samples that change rank (with cross_slot: change (slot, rank)). moved_bytes: their
    payload (0 when the layout's byte sizes were not given)."""

    dp: int
    orders: np.ndarray
    dest_slot: np.ndarray
    dest_pos: np.ndarray
    gated: np.ndarray
    costs: np.ndarray
    loads_before: np.ndarray
    loads_after: np.ndarray
    moved: np.ndarray
    moved_bytes: int
    cross_slot: bool = False
    shadow: bool = False

    @property
    def slots(self) -> int:
        return self.orders.shape[0]

    @property
    def micro_batch_size(self) -> int:
        return self.orders.shape[1]

    @property
    def moves_anything(self) -> bool:
        """Any sample changes rank: the same answer on every rank, so all skip the all_to_all together."""
        return bool(self.moved.any())

    @property
    def fully_gated(self) -> bool:
        return bool(self.gated.all())

    @property
    def natural(self) -> bool:
        """Every sample keeps its slot and position: every rank's micro-batches stay as it read
        them (a fully gated window, or one already balanced), the same answer on every rank."""
        ids = np.arange(self.dest_pos.size)
        b = self.micro_batch_size
        return bool((self.dest_pos == ids % b).all() and (self.dest_slot == ids // b).all())


def spreads(loads: np.ndarray) -> np.ndarray:
    """float64 [W]: max / mean per-rank load of every slot of loads [W, dp] (1.0 where a slot has no load)."""
    loads = np.asarray(loads)
    mean = loads.mean(axis=1)
    return np.divide(loads.max(axis=1), mean, out=np.ones(len(mean)), where=mean > 0)


def spread(loads: np.ndarray) -> float:
    """Mean over slots of max / mean per-rank load (slots with no load left out; 1.0 when none has)."""
    loads = np.asarray(loads)
    ok = loads.mean(axis=1) > 0
    return float(spreads(loads)[ok].mean()) if ok.any() else 1.0


def inverse(orders: np.ndarray) -> np.ndarray:
    """Canonical position of every natural index, per slot: pos[s, order[s, p]] = p."""
    orders = np.asarray(orders)
    pos = np.empty_like(orders)
    pos[np.arange(orders.shape[0])[:, None], orders] = np.arange(orders.shape[1])[None, :]
    return pos


def window_costs(counts: SampleCounts, cost: CostModel, given: bool) -> np.ndarray:
    """float64 [W, B]: the cost of every sample of the window (`given`: the caller's, carried in counts)."""
    if given:
        return counts.given_costs
    return cost.costs(counts.placeholders, counts.real_tokens, counts.square_patches, counts.images)


def plan_window(counts: SampleCounts, cost: CostModel, grid: Grid, settings: PlanSettings,
                unit_bytes: tuple = (0, 0, 0)) -> WindowPlan:
    """The plan of a window whose gathered counts are [W, B] (natural order per slot).

    unit_bytes: (bytes of one sample's dense fields, of one vision patch row, of one image's
    per-image fields), for `moved_bytes`."""
    costs = window_costs(counts, cost, settings.given_costs)
    w, batch = costs.shape
    ids = np.arange(w * batch)  # flat natural ids
    src_slot = ids // batch
    cross = settings.cross_slot and w > 1
    if cross:  # one assignment over W x G cells: the window is one batch of W*B samples
        order, gated = plan_gated_orders(costs.reshape(1, costs.size), grid.size * w, settings.balancer,
                                         settings.min_gain, settings.min_saving)
        orders, gated = order.reshape(w, batch), np.repeat(gated, w)
        flat_pos = inverse(order)[0]  # canonical position in the window's one order
        dest_slot, dest_pos = flat_pos // batch, flat_pos % batch
        after = costs.ravel()[order[0]].reshape(w, grid.dp, batch // grid.dp).sum(axis=2)
    else:
        orders, gated = plan_gated_orders(costs, grid.size, settings.balancer, settings.min_gain,
                                          settings.min_saving)
        dest_slot = src_slot
        dest_pos = inverse(orders).ravel()
        after = rank_loads(costs, orders, grid.dp)
    b = batch // grid.dp
    moved = ((dest_pos // b != ids % batch // b) | (dest_slot != src_slot)).reshape(w, batch)
    moved_bytes = 0
    if moved.any():
        d, r, i = unit_bytes
        moved_bytes = int((d + counts.rows * r + counts.images * i + counts.list_bytes)[moved].sum())
    return WindowPlan(dp=grid.dp, orders=orders, dest_slot=dest_slot, dest_pos=dest_pos, gated=gated, costs=costs,
                      loads_before=rank_loads(costs, None, grid.dp), loads_after=after, moved=moved,
                      moved_bytes=moved_bytes, cross_slot=cross, shadow=settings.shadow)
