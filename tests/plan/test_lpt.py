"""`lpt` and its parts against upstream's LPT (`spec.reference.lpt_order`, bit for bit): list
scheduling by rounds against the heap, one group, the max load LPT reaches above a plan's."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reorder.plan import balancers as bal
from spec import reference as ref
from support.costs import vlm_costs
from support.plans import assert_guarantees


MANY_GROUPS = [(256, 2), (256, 4), (300, 3), (512, 2), (1024, 2)]  # LPT and the refill by rounds


@pytest.mark.parametrize("groups, m", MANY_GROUPS, ids=str)
def test_lpt_is_the_reference_and_balanced_below_it_on_many_groups(groups, m):
    """From G = 256 groups LPT and the evict-and-refill run by rounds of array operations: LPT is
    still the reference's plan, element for element, and `balanced` keeps its guarantees, on every
    cost kind (ties, zeros, floats)."""
    rng = np.random.default_rng(groups * m)
    for kind in range(6):
        c = vlm_costs(rng, groups * m, kind)
        assert bal.lpt(c, groups).tolist() == ref.lpt_order(c.tolist(), groups), kind
        assert_guarantees(c, groups)


@st.composite
def greedy_states(draw):
    """(xs descending, loads, rooms, shift): a list scheduling problem in progress, with ties, zero
    costs, groups without room and loads that may be equal."""
    groups = draw(st.integers(1, 24))
    room = np.array(draw(st.lists(st.integers(0, 4), min_size=groups, max_size=groups)), dtype=np.int64)
    if not room.any():
        room[draw(st.integers(0, groups - 1))] = 1
    value = st.sampled_from([0.0, 1.0, 2.0, 2.5, 1e4]) | st.integers(0, 40).map(float)
    xs = np.array(sorted(draw(st.lists(value, min_size=int(room.sum()), max_size=int(room.sum()))), reverse=True))
    load = np.array(draw(st.lists(value, min_size=groups, max_size=groups)))
    shift = draw(st.sampled_from([0.0, 0.0, 1.0, 3.25]))
    return xs, load, room, shift


@settings(max_examples=300, deadline=None)
@given(greedy_states(), st.sampled_from([1, 2, 8, 10**6]))
def test_greedy_by_rounds_is_the_heap(problem, short_round):
    """List scheduling by rounds gives the heap's groups, loads and rooms exactly, whatever the
    rounds hand to the heap (`_SHORT_ROUND` 10**6: every round short; 1: never)."""
    xs, load, room, shift = problem
    want_load, want_room = load.copy(), room.copy()
    want = bal._greedy_heap(xs, 0, len(xs), want_load, want_room, shift)
    saved, bal._SHORT_ROUND = bal._SHORT_ROUND, short_round
    try:
        got = bal._greedy_rounds(xs, load, room, shift)
    finally:
        bal._SHORT_ROUND = saved
    assert got.tolist() == want.tolist()
    assert room.tolist() == want_room.tolist() == [0] * len(room)
    assert load.tolist() == want_load.tolist()


def test_lpt_with_one_group():
    assert bal.lpt(np.array([1.0, 2.0]), 1).tolist() == [1, 0] == ref.lpt_order([1.0, 2.0], 1)
    assert bal.lpt(np.array([0.0, 3, 1]), 1).tolist() == [1, 2, 0] == ref.lpt_order([0.0, 3, 1], 1)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(2, 3), (3, 4), (8, 4), (16, 16), (64, 4), (300, 2)]), st.integers(0, 5),
       st.integers(0, 2**32 - 1), st.floats(0.5, 1.5))
def test_lpt_max_above_a_plan_is_exact_below_it_and_a_reached_load_above_it(shape, kind, seed, scale):
    """`_lpt_max(above=v)`: LPT's exact max when that is at most v; else a load above v and at most
    LPT's max (so a plan at or below v is correctly judged not worse than LPT)."""
    groups, m = shape
    c = vlm_costs(np.random.default_rng(seed), groups * m, kind)
    top = max(ref.group_loads(c.tolist(), ref.lpt_order(c.tolist(), groups), groups))
    visit = np.argsort(-c, kind="stable")
    above = top * scale
    got = bal._lpt_max(c, groups, visit, above=above)
    if top <= above:
        assert got == top
    else:
        assert above < got <= top


@pytest.mark.parametrize("above, got, placed", [(5.0, 6.0, 3), (6.0, 7.0, 4), (4.5, 5.0, 0), (8.0, 8.0, 6)])
def test_lpt_stops_at_the_first_load_strictly_above(above, got, placed):
    """[5, 4, 2, 2, 1, 1] over 2 groups: LPT's loads go 5, 4, then 6, 7, 7, 8. A load equal to
    `above` does not stop it (the largest cost included); the first one above does, with the
    samples placed so far."""
    c = np.array([5.0, 4, 2, 2, 1, 1])
    visit = np.argsort(-c, kind="stable")
    top, assigned = bal._lpt_run(c, 2, visit, above)
    assert (top, len(assigned)) == (got, placed)
    assert bal._lpt_max(c, 2, visit, above) == got
