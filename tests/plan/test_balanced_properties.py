"""What a plan of the default balancer `balanced` must be, checked against references that share
nothing with its search: upstream's LPT (`spec.reference.lpt_order`), the optimum by brute force over
subsets (`spec.optimum`) and the lower-bound families (`spec.reference.lower_bound_families`).

- a canonical order: a permutation of B samples, B/G per group, members of a group ascending;
- a max group load (correctly rounded sums, math.fsum) never above LPT's;
- the optimum where `balanced` promises it: one group or one sample per group, two groups of at most
  8 (one exact re-split), B <= 10 (every partition tried); with two groups also the fewest moves;
- nothing moves when moving cannot lower the max load: the natural plan is optimal (by brute force
  on small instances, by a lower bound that it reaches on large ones); not met where float sums
  round (an xfail test holds the input);
- deterministic: the same costs give the same plan, also in another process with another hash seed.

tests/plan/test_balancers.py holds more of the same kind: groups of equal load and a natural plan at the
largest-cost bound are kept, a plan is the same for copies and views of the costs, the movement
targets of the benchmarks (far fewer samples moved than LPT).
"""

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reorder.plan.balancers import balanced
from spec import optimum as opt
from spec import reference as ref
from support.costs import vlm_costs


def loads(costs, order, groups):
    """Group loads of a canonical order, each the correctly rounded sum of its costs."""
    rows = np.asarray(costs, dtype=np.float64)[np.asarray(order)].reshape(groups, -1)
    return [math.fsum(r) for r in rows.tolist()]


def max_load(costs, order, groups):
    return max(loads(costs, order, groups))


def lpt_max(costs, groups):
    return max_load(costs, ref.lpt_order([float(x) for x in costs], groups), groups)


def assert_canonical(order, n, groups):
    """int64 [B], every sample once, B/G per group, members of a group in ascending natural index."""
    o = np.asarray(order)
    assert o.dtype == np.int64 and o.shape == (n,)
    assert sorted(o.tolist()) == list(range(n))
    m = n // groups
    for j in range(groups):
        members = o[j * m:(j + 1) * m].tolist()
        assert len(members) == m and members == sorted(members), (j, members)


def exact_sums(costs):
    return ref.sums_are_exact([float(x) for x in costs])


def assert_optimal(costs, order, groups):
    """The plan's max load is the brute-force optimum: exactly when every sum is exact in float64,
    else up to the rounding of the float loads the balancer compares (a few ulps of B terms)."""
    best = opt.optimal_max_load(costs, groups)
    got = max_load(costs, order, groups)
    if exact_sums(costs):
        assert got == best, (got, best)
    else:
        assert best <= got <= best * (1 + 1e-12), (got, best)
    return best


# --- strategies ----------------------------------------------------------------------------------

# exact-sum costs (integers, ties, zeros, a huge one), and floats whose sums round
exact_value = st.sampled_from([0.0, 1.0, 2.0, 5.0, 9.0, 13.0, 1e4]) | st.integers(0, 1000).map(float)
float_value = (st.sampled_from([0.1, 0.2, 0.3, 1.1, 1.2, 1.3, 2.05, 7.5]) | st.floats(0, 1e5)
               | st.floats(0, 1).map(lambda x: x * 2.0 ** -30))
any_value = exact_value | float_value


def costs_for(groups, m, value=any_value):
    return st.lists(value, min_size=groups * m, max_size=groups * m)


def instances(shapes, value=any_value):
    return st.sampled_from(shapes).flatmap(lambda gm: st.tuples(st.just(gm[0]), costs_for(gm[0], gm[1], value)))


ANY_SHAPE = [(1, 1), (1, 7), (5, 1), (2, 2), (2, 9), (3, 3), (4, 2), (4, 5), (8, 4), (16, 3), (6, 16), (32, 8),
             (64, 2), (24, 11), (2, 40), (9, 30)]
TWO_GROUPS = [(2, m) for m in range(2, 9)]                                  # one exact re-split
UP_TO_TEN = [(3, 2), (4, 2), (5, 2), (3, 3), (2, 5), (2, 4), (2, 3)]       # every partition is tried


# --- a canonical order, never above LPT ------------------------------------------------------------

@given(instances(ANY_SHAPE))
@example((3, [10.0, 10, 10, 1, 1, 1]))
@example((4, [0.0] * 32))
@example((2, [1.3, 1.2, 1.1, 1.0] * 4))
@example((5, [1.2, 1.2, 1.3, 1.1, 1.0, 1.0, 1.3, 1.1, 1.2, 1.2]))
def test_a_canonical_order_never_above_lpt(gc):
    groups, costs = gc
    order = balanced(np.array(costs), groups)
    assert_canonical(order, len(costs), groups)
    assert max_load(costs, order, groups) <= lpt_max(costs, groups)


@pytest.mark.parametrize("groups, m, kind", [(256, 2, 0), (256, 4, 1), (300, 3, 3), (512, 2, 5), (64, 16, 2),
                                             (32, 32, 4), (24, 10, 1), (33, 8, 1), (3, 36, 2), (6, 16, 5)])
def test_large_instances_a_canonical_order_never_above_lpt(groups, m, kind):
    """Evict-and-refill (B >= 256), LPT by rounds (G >= 256), few light partners per polish swap,
    many samples per group: still a canonical order never above LPT's max load."""
    c = vlm_costs(np.random.default_rng(groups * m + kind), groups * m, kind)
    order = balanced(c, groups)
    assert_canonical(order, len(c), groups)
    assert max_load(c, order, groups) <= lpt_max(c.tolist(), groups)


# --- the optimum where it is promised --------------------------------------------------------------

@settings(max_examples=80)
@given(instances(TWO_GROUPS + UP_TO_TEN))
@example((2, [1.0, 5, 2, 4]))
@example((2, [8.0, 8, 0, 0]))
@example((3, [0.0, 0, 6, 6, 3, 3]))
@example((4, [9000.0, 7000, 300, 200, 1200, 0, 800, 500]))
@example((2, [2.0] * 8 + [0.0] * 8))                # more optimal splits than the re-split labels
@example((2, [0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.1, 0.2, 0.3, 0.1]))
def test_optimal_on_two_groups_and_up_to_ten_samples(gc):
    groups, costs = gc
    order = balanced(np.array(costs), groups)
    assert_canonical(order, len(costs), groups)
    assert_optimal(costs, order, groups)


@settings(max_examples=80)
@given(instances(TWO_GROUPS, exact_value))
@example((2, [1.0, 5, 2, 4]))
@example((2, [10.0, 1, 1, 1, 1, 10]))
@example((2, [2.0] * 8 + [0.0] * 8))
def test_two_groups_move_the_fewest_samples_among_optimal_plans(gc):
    """Two groups (m <= 8): the one re-split tries every partition and keeps the most samples home."""
    groups, costs = gc
    order = balanced(np.array(costs), groups)
    best, fewest = opt.optimum(costs, groups)
    assert max_load(costs, order, groups) == best
    assert ref.moved_samples(order.tolist(), groups) == fewest


@given(st.lists(any_value, min_size=1, max_size=40))
def test_one_group_or_one_sample_per_group_moves_nothing(costs):
    """Every plan then has the same max load: the natural order."""
    for groups in (1, len(costs)):
        assert balanced(np.array(costs), groups).tolist() == list(range(len(costs)))


# --- nothing moves when moving cannot lower the max load -------------------------------------------

SMALL_SHAPES = [(2, 2), (2, 3), (3, 2), (2, 4), (3, 3), (4, 2), (2, 6), (3, 4), (4, 3), (6, 2), (2, 8)]


@settings(max_examples=100)
@given(st.sampled_from(SMALL_SHAPES), st.data())
def test_a_natural_plan_that_is_optimal_is_kept(shape, data):
    """Costs laid out so that the natural groups are an optimal split (found by brute force, then
    shuffled: groups in any order, members in any order): no plan is better, nothing may move.
    Costs whose sums are exact in float64 (integers here); with sums that round, see the next test."""
    groups, m = shape
    costs = data.draw(costs_for(groups, m, exact_value))
    split = opt.optimal_split(costs, groups)
    split = data.draw(st.permutations(split))
    natural = [costs[i] for g in split for i in data.draw(st.permutations(g))]
    assert balanced(np.array(natural), groups).tolist() == list(range(len(natural)))


@pytest.mark.xfail(strict=True, reason="balanced compares float loads summed in index order: trading two "
                   "samples of equal cost changes a group's summation order, so its float load can drop by an "
                   "ulp; the two-group re-split takes that as a lower max load and moves both samples, though "
                   "every group keeps the same costs (same math.fsum loads)")
def test_samples_of_equal_cost_do_not_trade_groups_for_a_rounding_gain():
    """Natural loads 3.2 and 2.8 (math.fsum), optimal: the plan trades sample 1 (1.1) for sample 4
    (1.1). Group 0 sums 0.7 + 0.7 + 0.7 + 1.1 = 3.1999999999999997 instead of 0.7 + 1.1 + 0.7 + 0.7
    = 3.2, the same costs."""
    costs = [0.7, 1.1, 0.7, 0.7, 1.1, 1.1, 0.3, 0.3]
    assert opt.optimum(costs, 2) == (max(loads(costs, range(8), 2)), 0)
    order = balanced(np.array(costs), 2)
    assert loads(costs, order, 2) == loads(costs, range(8), 2)
    assert order.tolist() == list(range(8))


@given(st.integers(2, 512), st.data())
def test_pairs_at_the_pairing_bound_are_kept(groups, data):
    """m = 2: pairing the i-th largest with the i-th smallest is optimal (the pairing bound); costs
    laid out as those pairs, in any order, reach the bound: nothing may move."""
    s = sorted(data.draw(costs_for(groups, 2, exact_value)), reverse=True)
    pairs = [[s[i], s[2 * groups - 1 - i]] for i in range(groups)]
    pairs = data.draw(st.permutations(pairs))
    costs = [x for p in pairs for x in data.draw(st.permutations(p))]
    assert max_load(costs, range(len(costs)), groups) == max(ref.lower_bound_families(costs, groups).values())
    assert balanced(np.array(costs), groups).tolist() == list(range(len(costs)))


def test_a_natural_plan_at_the_quick_bound_is_kept_at_every_size():
    """The documented rule on large instances: the natural max load at the proven bound (here the
    mean load), nothing moves. Seeded natural groups of equal loads, up to 1024 samples."""
    rng = np.random.default_rng(7)
    for groups, m in ((8, 4), (64, 16), (256, 4), (512, 2)):
        row = rng.integers(0, 5000, m).astype(float)
        c = np.concatenate([rng.permutation(row) for _ in range(groups)])
        assert max_load(c, np.arange(len(c)), groups) == math.fsum(c) / groups          # the mean: optimal
        assert balanced(c, groups).tolist() == list(range(len(c)))


# --- determinism -----------------------------------------------------------------------------------

def test_the_same_plan_in_another_process_with_another_hash_seed():
    """No hash or dict order enters a plan: a fresh interpreter with another PYTHONHASHSEED plans
    seeded instances of every size class alike."""
    rng = np.random.default_rng(11)
    cases = [(groups, vlm_costs(rng, groups * m, kind).tolist())
             for kind, (groups, m) in enumerate([(2, 7), (3, 3), (8, 4), (16, 16), (64, 16), (256, 2)])]
    script = ("import json, sys; import numpy as np; from reorder.plan.balancers import balanced; "
              "print(json.dumps([balanced(np.array(c), g).tolist() for g, c in json.load(sys.stdin)]))")
    import json
    here = [balanced(np.array(c), g).tolist() for g, c in cases]
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", script], input=json.dumps(cases), capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": seed},
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert json.loads(out.stdout) == here
