"""The cost-benefit gate (`plan_gated_orders`) against the spec's rule (`spec.reference.gate_keeps_natural`,
`gated_orders`), never against another function of `reorder`: random windows, the examples where
only one of the two thresholds fails, thresholds met exactly, all-zero slots, and plans whose gain
the lower bound promises but the balancer cannot reach. Which slots get planned at all is checked
against the spec's lower bounds with a spy balancer. Integer costs: every load and bound is exact."""

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from reorder.plan import balancers
from reorder.plan.orders import plan_gated_orders, plan_orders, rank_loads
from spec import reference as ref

# G=2, m=3: natural max 51, the optimum 47, lower bound 46 (gain 0.078 reachable, 0.098 promised)
UNREACHABLE = [15.0, 19, 7, 18, 22, 11]
# G=3, m=3: natural max 56, optimum 52, lower_bound 49.5, quick_lower_bound 48.33
TWO_BOUNDS = [19.0, 29, 8, 4, 21, 20, 6, 29, 9]
# G=2, m=2: natural loads 10 / 4, the optimum 9 / 5: gain exactly 0.1 in reals, saving 1
SMALL = [5.0, 5, 4, 0]
# G=2, m=2: natural loads 8 / 2, the optimum 6 / 4: gain exactly 0.25, saving exactly 2
QUARTER = [6.0, 2, 0, 2]


def oracle(costs, groups, min_gain, min_saving):
    planned = plan_orders(costs, groups, "balanced").tolist()
    return ref.gated_orders(costs.tolist(), planned, groups, min_gain, min_saving)


def check(costs, groups, min_gain=None, min_saving=None):
    costs = np.asarray(costs, dtype=np.float64)
    costs = costs[None, :] if costs.ndim == 1 else costs
    orders, gated = plan_gated_orders(costs, groups, "balanced", min_gain, min_saving)
    want_orders, want_gated = oracle(costs, groups, min_gain, min_saving)
    assert orders.dtype == np.int64 and orders.shape == costs.shape
    assert gated.dtype == np.bool_ and gated.shape == (len(costs),)
    assert orders.tolist() == want_orders
    assert gated.tolist() == want_gated
    return orders, gated


thresholds = st.one_of(st.none(), st.sampled_from([0.0, 0.05, 0.1, 0.25, 0.5]), st.floats(-0.1, 0.6))
savings = st.one_of(st.none(), st.sampled_from([0.0, 1.0, 2.0, 4.0]), st.floats(-1, 40))


@given(st.integers(1, 3), st.sampled_from([(2, 2), (2, 3), (3, 2), (3, 3), (2, 4), (4, 2)]), thresholds, savings,
       st.data())
@example(1, (2, 3), 0.09, 0.5, None)
@example(1, (2, 3), 0.05, 4.5, None)
def test_gate_matches_the_spec_rule(w, shape, min_gain, min_saving, data):
    groups, m = shape
    if data is None:
        costs = np.array([UNREACHABLE])
    else:
        costs = np.array(data.draw(st.lists(st.lists(st.integers(0, 30) | st.sampled_from([0, 0, 100]),
                                                     min_size=groups * m, max_size=groups * m),
                                            min_size=w, max_size=w)), dtype=np.float64)
    check(costs, groups, min_gain, min_saving)


@pytest.mark.parametrize("min_gain, min_saving, gated", [
    (0.2, 0.5, True),      # gain 0.1 fails, saving 1 passes: either failing test gates the slot
    (0.05, 2.0, True),     # gain passes, saving fails
    (0.05, 0.5, False),    # both pass
    (0.2, None, True),
    (None, 0.5, False),
    (None, 1.0, True),     # saving == min_saving does not pay
    (0.05, None, False),
])
def test_each_threshold_gates_on_its_own(min_gain, min_saving, gated):
    orders, g = check(SMALL, 2, min_gain, min_saving)
    assert g.tolist() == [gated]
    assert (orders.tolist() == [[0, 1, 2, 3]]) == gated


@pytest.mark.parametrize("min_gain, min_saving, gated", [
    (0.25, None, True), (0.2499, None, False), (None, 2.0, True), (None, 1.999, False),
    (0.25, 1.0, True), (0.2, 2.0, True), (0.2, 1.0, False)])
def test_a_threshold_met_exactly_does_not_pay(min_gain, min_saving, gated):
    _, g = check(QUARTER, 2, min_gain, min_saving)
    assert g.tolist() == [gated]


@pytest.mark.parametrize("min_gain, min_saving, gated", [
    (0.0, None, True), (0.5, None, True), (-0.5, None, False), (None, 0.0, True), (None, -1.0, False),
    (-0.5, -1.0, False), (0.0, -1.0, True)])
def test_all_zero_slot_has_gain_zero(min_gain, min_saving, gated):
    """max_before = 0: the gain is 0 (not 0/0), so it pays only for a negative min_gain."""
    orders, g = check(np.zeros((2, 4)), 2, min_gain, min_saving)
    assert g.tolist() == [gated, gated]
    assert orders.tolist() == [[0, 1, 2, 3]] * 2


@pytest.mark.parametrize("min_gain, min_saving", [(0.09, None), (None, 4.5), (0.09, 0.0), (0.0, 4.5)])
def test_bound_promises_a_gain_the_plan_cannot_reach(min_gain, min_saving):
    """The lower bound (46) passes the gate, the optimal plan (47) does not: the final test gates."""
    assert balancers.lower_bound(UNREACHABLE, 2) == 46.0
    orders, g = check(UNREACHABLE, 2, min_gain, min_saving)
    assert g.tolist() == [True] and orders.tolist() == [list(range(6))]


def test_gate_over_a_window_decides_per_slot():
    costs = np.array([SMALL, QUARTER, [0.0] * 4, [1.0, 1, 1, 1], [9.0, 0, 0, 0], [0.0, 0, 9, 9]])
    orders, g = check(costs, 2, 0.2, 1.5)
    assert g.tolist() == [True, False, True, True, True, False]
    assert orders[1].tolist() != [0, 1, 2, 3] and orders[5].tolist() != [0, 1, 2, 3]


def test_without_thresholds_every_slot_is_planned():
    costs = np.array([SMALL, QUARTER, [0.0] * 4])
    orders, g = plan_gated_orders(costs, 2, "balanced")
    assert g.dtype == np.bool_ and g.tolist() == [False] * 3
    assert orders.tolist() == plan_orders(costs, 2, "balanced").tolist()
    orders, g = plan_gated_orders(costs, 2, "lpt", None, None)
    assert g.tolist() == [False] * 3 and orders.tolist() == [ref.lpt_order(r, 2) for r in costs.tolist()]


def spec_bound(row, groups):
    return max(ref.lower_bound_families(row, groups).values())


@pytest.mark.parametrize("min_saving", [8.0, 7.0, 6.0, 3.0, None])
@pytest.mark.parametrize("min_gain", [None, 0.2, 0.12, 0.1, 0.05])
def test_only_slots_the_bound_leaves_open_are_planned(monkeypatch, min_gain, min_saving):
    """A slot is planned only when its lower bound passes the gate (spec bound): the spy balancer
    sees exactly those slots, in order, and nothing else changes."""
    rows = [TWO_BOUNDS, UNREACHABLE + [0.0] * 3, [0.0] * 9, [3.0] * 9, [30.0] + [0.0] * 8, [9.0] * 3 + [0.0] * 6]
    costs = np.array(rows)
    seen = []

    def spy(c, groups):
        seen.append(np.asarray(c).tolist())
        return balancers.balanced(c, groups)

    monkeypatch.setitem(balancers.BALANCERS, "spy", spy)
    if min_gain is None and min_saving is None:
        want = rows
    else:
        want = [r for r in rows if not ref.gate_keeps_natural(max(ref.group_loads(r, list(range(9)), 3)),
                                                              spec_bound(r, 3), min_gain, min_saving)]
    orders, gated = plan_gated_orders(costs, 3, "spy", min_gain, min_saving)
    assert seen == want
    want_orders, want_gated = oracle(costs, 3, min_gain, min_saving)
    assert orders.tolist() == want_orders and gated.tolist() == want_gated


def test_two_bounds_example_is_what_it_claims():
    assert max(ref.group_loads(TWO_BOUNDS, list(range(9)), 3)) == 56.0
    assert spec_bound(TWO_BOUNDS, 3) == 49.5 == balancers.lower_bound(TWO_BOUNDS, 3)
    assert balancers.quick_lower_bound(TWO_BOUNDS, 3) == pytest.approx(48.3333333333)
    assert ref.equal_count_optimum(TWO_BOUNDS, 3)[0] == 52.0


@given(st.integers(1, 4), st.sampled_from([1, 2, 3, 4, 6]), st.integers(1, 4), st.data())
def test_rank_loads_are_the_spec_group_loads(w, dp, per, data):
    batch = dp * per
    costs = np.array(data.draw(st.lists(st.lists(st.integers(0, 1000), min_size=batch, max_size=batch),
                                        min_size=w, max_size=w)), dtype=np.float64)
    orders = np.array([data.draw(st.permutations(range(batch))) for _ in range(w)], dtype=np.int64)
    natural = rank_loads(costs, None, dp)
    planned = rank_loads(costs, orders, dp)
    assert natural.shape == planned.shape == (w, dp)
    for s in range(w):
        assert natural[s].tolist() == ref.group_loads(costs[s].tolist(), list(range(batch)), dp)
        assert planned[s].tolist() == ref.group_loads(costs[s].tolist(), orders[s].tolist(), dp)


def test_gate_on_loads_at_or_below_one():
    """The gain is relative for any positive max load, also one of 1 or less (costs in hours, say)."""
    scaled = [c / 8 for c in QUARTER]                       # natural loads 1.0 / 0.25, the optimum 0.75
    for min_gain, gated in ((0.2, False), (0.25, True), (0.3, True)):
        _, g = check(scaled, 2, min_gain)
        assert g.tolist() == [gated]
    _, g = check([c / 16 for c in QUARTER], 2, 0.2)         # max load 0.5
    assert g.tolist() == [False]


def test_all_zero_costs_raise_no_floating_point_warning():
    """max_before = 0 divides 0 by 0 inside the gate: the warning is silenced, never raised."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for min_gain, min_saving in ((0.0, None), (0.1, 1.0), (-0.5, None)):
            plan_gated_orders(np.zeros((3, 6)), 3, "balanced", min_gain, min_saving)


@pytest.mark.parametrize("min_gain, min_saving", [(0.2, None), (None, 7.0), (0.12, 7.0), (0.05, 8.5), (0.1, 6.0)])
def test_the_tight_bound_is_computed_only_where_the_cheap_one_leaves_the_slot_open(monkeypatch, min_gain, min_saving):
    """The cheap bound (`quick_lower_bound`) screens every slot first; `lower_bound` runs only on the
    slots it leaves open (per the spec's bounds and rule)."""
    from reorder.plan import orders as orders_module
    rows = [TWO_BOUNDS, [9.0] * 3 + [0.0] * 6, [1.0] * 9, [30.0] + [0.0] * 8, UNREACHABLE + [0.0] * 3]
    tight = []

    def spy(c, groups):
        tight.append(np.asarray(c).tolist())
        return balancers.lower_bound(c, groups)

    monkeypatch.setattr(orders_module, "lower_bound", spy)
    plan_gated_orders(np.array(rows), 3, "balanced", min_gain, min_saving)
    f = [ref.lower_bound_families(r, 3) for r in rows]
    quick = [max(x["mean"], x["pigeon"]) for x in f]
    before = [max(ref.group_loads(r, list(range(9)), 3)) for r in rows]
    assert tight == [r for r, b, q in zip(rows, before, quick) if not ref.gate_keeps_natural(b, q, min_gain, min_saving)]


def test_rank_loads_are_float64_for_integer_costs():
    costs = np.array([[2 ** 53, 1, 3, 4]], dtype=np.int64)
    loads = rank_loads(costs, None, 2)
    assert loads.dtype == np.float64 and loads.tolist() == [[float(2 ** 53), 7.0]]
    loads = rank_loads([[1, 2, 3, 4]], np.array([[3, 0, 1, 2]]), 2)
    assert loads.dtype == np.float64 and loads.tolist() == [[5.0, 5.0]]
