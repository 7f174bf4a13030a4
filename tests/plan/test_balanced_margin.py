"""`balanced` at the edge of its tie margin: max loads within 1e-12 (relative) of each other count as
equal, so the plan that moves fewer samples is kept. On B <= 10 samples the search's plan is checked
against the optimum by enumeration; a natural plan whose max load is the optimum times (1 + 1e-12),
exactly, already reaches it, and nothing moves (the instances are built so that the search does not
start moving either: the natural max load is within the search's stopping distance, 1 + 5e-4, of the
proven lower bound, and above the bound itself; and LPT's max load is not below it, so the guard
against LPT keeps it too)."""

import numpy as np

from reorder.plan import balancers as bal
from spec import reference as ref

T = 1024.0       # a power of two: T * (1 + 1e-12) * (1 - 1e-12) rounds back to T exactly


def split(rng, total, parts=3):
    """`parts` positive integers summing to `total`."""
    cuts = np.sort(rng.choice(np.arange(1, total), parts - 1, replace=False))
    return [float(x) for x in np.diff([0, *cuts, total])]


def row_sum(xs):
    total = 0.0
    for x in xs:          # left to right, as a group's load is summed
        total += x
    return total


def at_the_margin(rng):
    """Costs of 3 groups of 3 whose optimum is T and whose natural max load is T * (1 + 1e-12), or
    None when the draw does not qualify. Group 0 is a, b, x + d (a + b + x = T, d tiny), group 1
    sums to T, group 2 is y, z, x (y + z + x = T - 1): swapping x + d and x reaches T, and no plan
    goes below T (every cost but x + d is an integer, the total is 3T - 1 + d). So every group's
    load but that of x + d is exact: no plan's float max load falls below T by rounding either."""
    top = T * (1 + 1e-12)
    a, b, x = split(rng, int(T))
    if x > T - 3:
        return None
    y, z = split(rng, int(T - 1 - x), 2)
    d = (top - (a + b)) - x
    costs = [a, b, x + d, *split(rng, int(T)), y, z, x]
    if row_sum(costs[:3]) != top:
        return None
    f = ref.lower_bound_families(costs, 3)
    lb = max(f["mean"], f["pigeon"])
    if not lb * (1 + 1e-12) < top <= lb * (1 + 5e-4):
        return None
    if max(ref.group_loads(costs, ref.lpt_order(costs, 3), 3)) < top:
        return None                    # (LPT below it: balanced's guard would return LPT's plan)
    return costs


def test_a_natural_plan_within_the_margin_of_the_optimum_is_kept():
    rng = np.random.default_rng(7)
    found = 0
    while found < 8:
        costs = at_the_margin(rng)
        if costs is None:
            continue
        found += 1
        assert ref.equal_count_optimum(costs, 3)[0] == T
        assert bal.balanced(np.array(costs), 3).tolist() == list(range(9)), costs
