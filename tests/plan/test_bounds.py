"""The lower bounds of `balanced` (`_cheap_lower_bound`, `x_lower_bound`) against the bound families
written out in plain Python (`spec.reference.lower_bound_families`), including the numpy bound for
B > 128 that a random input rarely reaches."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from reorder.plan import balancers as bal
from spec import reference as ref


# --- lower bounds against the spec's families -----------------------------------------------------

def spec_lower_bound(costs, groups):
    return max(ref.lower_bound_families(costs, groups).values())


def spec_quick_bound(costs, groups):
    f = ref.lower_bound_families(costs, groups)
    if "largest" in f:
        return f["largest"]
    return max(f["mean"], f.get("pair", f.get("pigeon", 0)))


shapes = st.sampled_from([(1, 1), (1, 4), (2, 1), (5, 1), (2, 2), (4, 2), (7, 2), (2, 3), (3, 3), (5, 3),
                          (2, 4), (3, 4), (4, 4), (6, 5), (3, 7), (8, 3)])


@given(shapes, st.data())
@example((3, 3), [22, 7, 18, 8, 9, 1, 22, 21, 13])    # r = 2 groups of the pigeonhole family bind (41)
@example((2, 3), [15, 19, 7, 18, 22, 11])
@example((3, 2), [4, 23, 8, 9, 19, 19])                # m = 2: the pairing bound binds
def test_bounds_equal_the_spec_families(shape, data):
    groups, m = shape
    if isinstance(data, list):
        costs = data
    else:
        costs = data.draw(st.lists(st.integers(0, 60) | st.sampled_from([0, 0, 1000]),
                                   min_size=groups * m, max_size=groups * m))
    c = np.array(costs, dtype=np.float64)
    assert bal.lower_bound(c, groups) == spec_lower_bound(costs, groups)
    assert bal.quick_lower_bound(c, groups) == spec_quick_bound(costs, groups)
    assert isinstance(bal.lower_bound(c, groups), float) and isinstance(bal.quick_lower_bound(c, groups), float)


@settings(max_examples=20)
@given(st.sampled_from([(65, 2), (70, 2), (43, 3), (33, 4), (129, 1), (20, 7)]), st.data())
def test_bounds_above_128_samples_equal_the_spec_families(shape, data):
    """B > 128: the cheap bound takes its numpy branch (plain Python below)."""
    groups, m = shape
    costs = data.draw(st.lists(st.integers(0, 10 ** 6), min_size=groups * m, max_size=groups * m))
    c = np.array(costs, dtype=np.float64)
    assert bal.quick_lower_bound(c, groups) == spec_quick_bound(costs, groups)
    assert bal.lower_bound(c, groups) == spec_lower_bound(costs, groups)


@pytest.mark.parametrize("groups, costs", [
    (2, [3.0, 3, 3, 3, 3, 3]),                     # mean
    (2, [26.0, 8]),                                # largest (m = 1)
    (3, [4.0, 23, 8, 9, 19, 19]),                  # pairing (m = 2)
    (2, [10.0, 1, 1, 1, 1, 1]),                    # pigeonhole, k = 0: the largest with the m-1 smallest
    (3, [22.0, 7, 18, 8, 9, 1, 22, 21, 13]),       # pigeonhole over r = 2 groups
    (3, [9.0, 9, 9, 9, 0, 0, 0, 0, 0]),            # pigeonhole, k = 1: two of the four 9s share a group
    (4, [100.0, 100, 0, 0] + [30.0] * 8),          # pigeonhole, k = 0 over r = 2 groups: 130 (mean 110)
])
def test_bounds_are_tight_where_a_family_binds(groups, costs):
    """Each family reaches the optimum on its example: a bound that drops or weakens one is caught."""
    opt = ref.equal_count_optimum(costs, groups)[0]
    assert bal.lower_bound(costs, groups) == spec_lower_bound(costs, groups) == opt
    if groups * 2 >= len(costs) or costs[0] == 10.0:
        assert bal.quick_lower_bound(costs, groups) == opt


def test_bounds_raise_no_floating_point_warning():
    import warnings
    rng = np.random.default_rng(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for groups, m in ((1, 5), (3, 3), (4, 8), (2, 70), (70, 2), (5, 1)):
            c = rng.integers(0, 100, groups * m).astype(float)
            bal.lower_bound(c, groups)
            bal.quick_lower_bound(c, groups)
            bal.lower_bound(np.zeros(groups * m), groups)
