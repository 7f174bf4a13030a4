"""The window plan against the spec, field by field: orders (equal-count LPT, the gate, cross-slot),
where every sample goes, the loads before and after, which samples move and their bytes, each
computed here with plain Python loops over the spec's reference functions, not with the code under
test."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reorder.plan.cost import CostModel
from reorder.plan.counts import SampleCounts
from reorder.plan.grid import Grid
from reorder.plan.window import PlanSettings, inverse, plan_window, spread, spreads
from spec import reference as ref

COST = CostModel(image_token_id=7, vision_start_token_id=6, spatial_merge_size=2, encoder_weight=1.0,
                 language_weight=0.25, encoder_image_weight=3.0)


@st.composite
def windows(draw):
    dp = draw(st.sampled_from([1, 2, 4]))
    groups = dp * draw(st.sampled_from([1, 2]))
    batch = groups * draw(st.integers(1, 3))
    w = draw(st.integers(1, 3))
    ints = lambda hi: np.array(draw(st.lists(st.integers(0, hi), min_size=w * batch, max_size=w * batch)),
                               dtype=np.int64).reshape(w, batch)
    counts = SampleCounts.of(placeholders=ints(40), real_tokens=ints(200), images=ints(3), rows=ints(90),
                             list_bytes=ints(30))
    return Grid(size=groups, dp=dp, rank=0), counts


def spec_costs(counts):
    """Per slot, per sample: the cost model's formula, written out (docs/design.md, Cost)."""
    return [[1.0 * float(p * 4) + 3.0 * float(i) + 0.25 * float(r)
             for p, r, i in zip(*(counts.table[s, :, k].tolist() for k in (0, 1, 2)))]
            for s in range(counts.shape[0])]


def rank_loads_of(row, order, dp):
    return ref.group_loads(row, order, dp)


@given(windows(), st.sampled_from([None, 0.0, 0.2]), st.sampled_from([None, 0.0, 25.0]), st.booleans())
def test_plan_is_the_spec_plan_slot_by_slot(case, min_gain, min_saving, shadow):
    grid, counts = case
    unit = (40, 12, 5)
    plan = plan_window(counts, COST, grid, PlanSettings(balancer="lpt", min_gain=min_gain, min_saving=min_saving,
                                                        shadow=shadow), unit)
    costs = spec_costs(counts)
    w, batch = counts.shape
    b = batch // grid.dp
    planned = [ref.lpt_order(row, grid.size) for row in costs]
    orders, gated = ref.gated_orders(costs, planned, grid.size, min_gain, min_saving)
    assert plan.orders.tolist() == orders
    assert plan.gated.tolist() == gated
    assert plan.fully_gated == all(gated)
    assert plan.costs.tolist() == costs
    assert (plan.dp, plan.slots, plan.micro_batch_size, plan.shadow, plan.cross_slot) == (grid.dp, w, batch, shadow,
                                                                                            False)
    moved_bytes, any_moved = 0, False
    for s in range(w):
        pos = ref.canonical_position(orders[s])
        natural = list(range(batch))
        assert plan.loads_before[s].tolist() == rank_loads_of(costs[s], natural, grid.dp)
        assert plan.loads_after[s].tolist() == rank_loads_of(costs[s], orders[s], grid.dp)
        for j in range(batch):
            g = s * batch + j
            assert (plan.dest_slot[g], plan.dest_pos[g]) == (s, pos[j])
            moved = pos[j] // b != j // b
            assert plan.moved[s, j] == moved
            if moved:
                any_moved = True
                moved_bytes += 40 + 12 * int(counts.rows[s, j]) + 5 * int(counts.images[s, j]) + \
                    int(counts.list_bytes[s, j])
    assert plan.moved_bytes == moved_bytes
    assert plan.moves_anything == any_moved
    assert plan.max_before == sum(max(rank_loads_of(c, list(range(batch)), grid.dp)) for c in costs)
    assert plan.max_after == sum(max(rank_loads_of(c, o, grid.dp)) for c, o in zip(costs, orders))


@given(windows())
def test_cross_slot_plan_is_one_spec_plan_over_the_window(case):
    grid, counts = case
    w, batch = counts.shape
    plan = plan_window(counts, COST, grid, PlanSettings(balancer="lpt", cross_slot=True))
    costs = spec_costs(counts)
    if w == 1:  # one slot: nothing to balance across, the per-slot plan
        assert not plan.cross_slot
        assert plan.orders.tolist() == [ref.lpt_order(costs[0], grid.size)]
        return
    flat = [c for row in costs for c in row]
    order = ref.lpt_order(flat, grid.size * w)
    assert plan.cross_slot
    assert plan.orders.reshape(-1).tolist() == order
    pos = ref.canonical_position(order)
    b = batch // grid.dp
    assert plan.dest_slot.tolist() == [p // batch for p in pos]
    assert plan.dest_pos.tolist() == [p % batch for p in pos]
    assert plan.moved.reshape(-1).tolist() == [p // batch != g // batch or (p % batch) // b != (g % batch) // b
                                               for g, p in enumerate(pos)]
    assert plan.loads_after.tolist() == [rank_loads_of(flat, order[s * batch:(s + 1) * batch], grid.dp)
                                         for s in range(w)]


def test_cross_slot_with_the_gate_keeps_the_window_natural_when_it_does_not_pay():
    counts = SampleCounts.of(placeholders=np.array([[10, 0], [0, 10]]), real_tokens=np.zeros((2, 2), np.int64))
    plan = plan_window(counts, COST, Grid(size=2, dp=2, rank=0), PlanSettings(cross_slot=True, min_gain=0.5))
    assert plan.gated.tolist() == [True, True] and plan.orders.tolist() == [[0, 1], [2, 3]]  # flat ids
    assert not plan.moves_anything and plan.moved_bytes == 0


@given(windows(), st.sampled_from(["lpt", "balanced", "identity"]), st.booleans())
def test_natural_means_every_sample_keeps_its_slot_and_position(window, balancer, cross):
    """`natural`: every slot's canonical order is its natural one (with cross_slot: the flat ids of
    the slot itself), so every rank keeps its micro-batches as read."""
    grid, counts = window
    plan = plan_window(counts, COST, grid, PlanSettings(balancer=balancer, cross_slot=cross))
    w, batch = plan.orders.shape
    natural = [[s * batch + j for j in range(batch)] for s in range(w)] if plan.cross_slot else \
        [list(range(batch))] * w
    assert plan.natural == (plan.orders.tolist() == natural)
    assert plan.natural or balancer != "identity"


def test_a_cross_slot_exchange_of_slots_is_not_natural():
    ph = np.array([[10, 10, 0, 0], [10, 10, 0, 0]])  # rank 0 holds both large samples of either slot
    counts = SampleCounts.of(placeholders=ph, real_tokens=np.zeros_like(ph))
    plan = plan_window(counts, COST, Grid(size=2, dp=2, rank=0), PlanSettings(cross_slot=True))
    assert not plan.natural and plan.moves_anything
    gated = plan_window(counts, COST, Grid(size=2, dp=2, rank=0), PlanSettings(cross_slot=True, min_gain=0.99))
    assert gated.natural and gated.fully_gated


def test_given_costs_replace_the_cost_model():
    given = np.array([[5.0, 1.0, 1.0, 1.0]])
    counts = SampleCounts.of(placeholders=np.array([[0, 0, 0, 90]]), cost_bits=given.view(np.int64))
    plan = plan_window(counts, COST, Grid(size=2, dp=2, rank=0), PlanSettings(balancer="lpt", given_costs=True))
    assert plan.costs.tolist() == given.tolist()
    assert plan.orders.tolist() == [ref.lpt_order([5.0, 1.0, 1.0, 1.0], 2)]
    model = plan_window(counts, COST, Grid(size=2, dp=2, rank=0), PlanSettings(balancer="lpt"))
    assert model.costs.tolist() == spec_costs(counts)


def test_inverse_and_spreads_by_hand():
    assert inverse(np.array([[2, 0, 1], [0, 1, 2]])).tolist() == [[1, 2, 0], [0, 1, 2]]
    loads = np.array([[3.0, 1.0], [0.0, 0.0], [2.0, 2.0]])
    assert spreads(loads).tolist() == [1.5, 1.0, 1.0]
    assert spread(loads) == 1.25  # the slot with no load is left out
    assert spread(np.zeros((2, 3))) == 1.0
    small = [[0.5, 0.25], [0, 0]]  # loads below 1 (costs in ms or seconds): still loads
    assert spreads(small).tolist() == [0.5 / 0.375, 1.0]
    assert spread(small) == 0.5 / 0.375
    assert spreads([[3, 1]]).tolist() == [1.5]  # integer loads


def test_quadratic_cost_reaches_the_plan():
    quad = CostModel(image_token_id=7, vision_start_token_id=6, encoder_weight=1.0, encoder_quadratic_weight=0.5)
    counts = SampleCounts.of(placeholders=np.array([[2, 2, 0, 0]]), square_patches=np.array([[64, 4, 0, 0]]),
                             real_tokens=np.zeros((1, 4), np.int64))
    plan = plan_window(counts, quad, Grid(size=2, dp=2, rank=0), PlanSettings(balancer="lpt"))
    assert plan.costs.tolist() == [[8.0 + 32.0, 8.0 + 2.0, 0.0, 0.0]]  # patches = 2 x merge 2 squared


@pytest.mark.parametrize("gate", [dict(min_saving=1.0), dict(min_gain=0.1), dict(min_gain=0.1, min_saving=1e9)])
def test_cross_slot_gate_uses_every_threshold(gate):
    """Slots of costs [20, 20] and [0, 0] at G = 1: naturally one cell holds 40, planned across
    slots each holds 20 (gain 0.5, saving 20); the gate decides on the flat window by every
    threshold set (the third case fails on the saving alone), as the spec's gate does."""
    counts = SampleCounts.of(placeholders=np.array([[5, 5], [0, 0]]), real_tokens=np.zeros((2, 2), np.int64))
    plan = plan_window(counts, COST, Grid(size=1, dp=1, rank=0), PlanSettings(balancer="lpt", cross_slot=True, **gate))
    flat = [c for row in spec_costs(counts) for c in row]
    orders, gated = ref.gated_orders([flat], [ref.lpt_order(flat, 2)], 2, gate.get("min_gain"), gate.get("min_saving"))
    assert plan.orders.reshape(-1).tolist() == orders[0]
    assert plan.gated.tolist() == gated * 2


@pytest.mark.parametrize("field,value,message", [
    ("balancer", "nope", "balancer"),
    ("min_gain", 1.0, "min_gain=1.0 is invalid: the relative gain threshold must be in [0, 1)"),
    ("min_gain", -0.1, "min_gain=-0.1 is invalid"),
    ("min_gain", True, "min_gain=True is invalid"),
    ("min_saving", -1.0, "min_saving=-1.0 is invalid: the saving threshold (cost units) must be a finite number >= 0"),
    ("min_saving", float("inf"), "min_saving=inf is invalid"),
    ("min_saving", False, "min_saving=False is invalid"),
    ("min_saving", "1", "min_saving='1' is invalid"),
    ("min_gain", "0.1", "min_gain='0.1' is invalid"),
])
def test_settings_name_the_bad_field_and_value(field, value, message):
    with pytest.raises(ValueError, match=__import__("re").escape(message)):
        PlanSettings(**{field: value})


def test_settings_edges_are_accepted():
    assert PlanSettings(min_gain=0.0, min_saving=0.0).gated
    assert PlanSettings(min_gain=0, min_saving=0).gated
    assert PlanSettings(min_saving=0.0).gated and PlanSettings(min_gain=0.5).gated
    assert not PlanSettings().gated
