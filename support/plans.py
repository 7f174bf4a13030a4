"""Plan checks shared by the balancer tests: a plan's shape, its max load by correctly rounded sums,
LPT's max load by the spec's LPT, and the guarantees of `balanced` against brute force."""

import math

import numpy as np

from reorder.plan import balancers as bal
from spec import optimum as opt
from spec import reference as ref


def fsum_max(costs, order, groups):
    rows = np.asarray(costs, dtype=np.float64)[np.asarray(order)].reshape(groups, -1)
    return max(math.fsum(r) for r in rows.tolist())


def assert_plan(order, n, groups):
    o = np.asarray(order)
    assert o.dtype == np.int64 and o.shape == (n,)
    assert sorted(o.tolist()) == list(range(n))
    assert (np.diff(o.reshape(groups, -1), axis=1) > 0).all()        # members ascending in a group


def lpt_max(costs, groups):
    """LPT's max load by the spec's LPT (upstream's, bit for bit), as correctly rounded sums."""
    return fsum_max(costs, ref.lpt_order([float(x) for x in costs], groups), groups)


def assert_guarantees(c, groups):
    """The plan of `balanced`: a canonical order, never above LPT's max load, and the optimum
    (brute force) where it promises one (two groups of at most 8, B <= 10)."""
    order = bal.balanced(c, groups)
    assert_plan(order, len(c), groups)
    got = fsum_max(c, order, groups)
    assert got <= lpt_max(c, groups)
    m = len(c) // groups
    if len(c) <= 10 or groups == 2 and m <= 8:
        best = opt.optimal_max_load(c.tolist(), groups)
        assert got == best if ref.sums_are_exact(c.tolist()) else best <= got <= best * (1 + 1e-12)
    return order
