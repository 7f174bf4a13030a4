"""`exact` (the MILP stages) against brute force, its messages when a stage stops early, and
`check_costs`' messages."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reorder.plan import balancers as bal
from spec import reference as ref
from support.plans import fsum_max


# --- exact and check_costs: their messages ------------------------------------------------------------

def test_exact_reports_a_stage_stopped_by_its_time_limit():
    rng = np.random.default_rng(0)
    c = np.round(rng.lognormal(8, 1, 64))
    with pytest.raises(TimeoutError) as e:
        bal.exact(c, 8, time_limit=1e-6)
    msg = str(e.value)
    assert msg.startswith("exact: min max load not solved to optimality (status ")
    assert msg.endswith("; B=64, G=8, time_limit=1e-06")
    with pytest.raises(TimeoutError) as e:            # stage 2 alone, also stopped by the limit
        bal._AssignmentMilp(c, 8, 1e-6).fewest_moves(float(c.sum()))
    assert str(e.value).startswith("exact: fewest moves not solved to optimality (status ")
    assert str(e.value).endswith("; B=64, G=8, time_limit=1e-06")


def test_exact_shortcuts_one_group_and_one_sample_per_group():
    """Every plan has the same max load: the natural order, also without the fewest-moves stage."""
    for fewest in (True, False):
        assert bal.exact(np.array([1.0, 2, 3, 4]), 4, fewest_moves=fewest).tolist() == [0, 1, 2, 3]
        assert bal.exact(np.array([1.0, 2, 3, 4]), 1, fewest_moves=fewest).tolist() == [0, 1, 2, 3]


@settings(max_examples=15)
@given(st.sampled_from([(2, 2), (3, 2), (2, 3), (4, 2), (3, 3)]), st.data())
def test_exact_is_optimal_on_float_costs(shape, data):
    """Fractional loads: the load bound T is continuous, so the optimum is the float optimum."""
    groups, m = shape
    costs = data.draw(st.lists(st.sampled_from([0.1, 0.25, 0.7, 1.3, 2.05, 3.5]) | st.floats(0, 10).map(lambda x: round(x, 3)),
                               min_size=groups * m, max_size=groups * m))
    opt, fewest = ref.equal_count_optimum(costs, groups)
    for fewest_moves in (False, True):
        order = bal.exact(np.array(costs), groups, fewest_moves=fewest_moves)
        assert fsum_max(costs, order, groups) == pytest.approx(opt, rel=1e-9, abs=1e-9)
    assert ref.moved_samples(order.tolist(), groups) == fewest or fsum_max(costs, order, groups) != opt


def test_exact_raises_when_a_stage_stops_with_an_unproven_solution(monkeypatch):
    """A stage the time limit stops after it found a plan (status 1, x set) is not optimal: raise."""
    import scipy.optimize

    real = scipy.optimize.milp

    def stopped(*a, **k):
        res = real(*a, **k)
        res.status, res.message = 1, "Time limit reached. (HiGHS Status 13: model_status is Time limit reached)"
        return res

    monkeypatch.setattr(scipy.optimize, "milp", stopped)
    with pytest.raises(TimeoutError) as e:
        bal.exact(np.array([10.0, 10, 10, 1, 1, 1]), 3, time_limit=5)
    assert str(e.value) == ("exact: min max load not solved to optimality (status 1: Time limit reached. (HiGHS "
                            "Status 13: model_status is Time limit reached)); B=6, G=3, time_limit=5")


def test_exact_stage_two_below_the_optimum_has_no_solution():
    """A cap under the optimal max load leaves stage 2 infeasible: the same error, with the status."""
    c = np.array([10.0, 10, 10, 1, 1, 1])
    milp = bal._AssignmentMilp(c, 3, None)
    assert sorted(milp.fewest_moves(11.0).tolist()) == [0, 0, 1, 1, 2, 2]
    with pytest.raises(TimeoutError) as e:
        milp.fewest_moves(10.5)
    assert str(e.value).startswith("exact: fewest moves not solved to optimality (status 2: ")
    assert str(e.value).endswith("; B=6, G=3, time_limit=None")


@pytest.mark.parametrize("costs, groups, slots, msg", [
    ([1.0, 2.0], 0, False, "groups=0 is invalid: the canonical grid G must be an integer >= 1"),
    ([1.0, 2.0], True, False, "groups=True is invalid: the canonical grid G must be an integer >= 1"),
    ([1.0, 2.0], 2.0, False, "groups=2.0 is invalid: the canonical grid G must be an integer >= 1"),
    ([1.0, 2.0, 3.0], 2, False, "costs holds B=3 samples, not a positive multiple of groups=2: every group "
                                "holds B/G samples, so choose B as a multiple of G = lcm(DP sizes)"),
    ([], 1, False, "costs holds B=0 samples, not a positive multiple of groups=1: every group holds B/G "
                   "samples, so choose B as a multiple of G = lcm(DP sizes)"),
    ([[1.0, 2.0, 3.0]], 2, True, "costs holds B=3 samples per slot, not a positive multiple of groups=2: "
                                 "every group holds B/G samples, so choose B as a multiple of G = lcm(DP sizes)"),
    ([1.0, -0.5], 1, False, "costs[1] is -0.5: every sample cost must be finite and >= 0"),
    ([[0.0, 1.0], [math.inf, 2.0]], 2, True, "costs[1, 0] is inf: every sample cost must be finite and >= 0"),
    ([[0.0, 1.0], [2.0, math.nan]], 1, True, "costs[1, 1] is nan: every sample cost must be finite and >= 0"),
    ([[1.0, 2.0]], 2, False, "costs has shape (1, 2): expected one cost per sample, shape [B]"),
    ([1.0, 2.0], 2, True, "costs has shape (2,): expected [slots, B], one row of per-sample costs per micro-batch"),
])
def test_check_costs_messages(costs, groups, slots, msg):
    with pytest.raises(ValueError) as e:
        bal.check_costs(costs, groups, slots=slots)
    assert str(e.value) == msg


def test_check_costs_returns_contiguous_float64():
    c = bal.check_costs(np.arange(8, dtype=np.int32)[::2], np.int64(2))
    assert c.dtype == np.float64 and c.flags.c_contiguous and c.tolist() == [0.0, 2.0, 4.0, 6.0]
    w = bal.check_costs(np.zeros((0, 4)), 2, slots=True)
    assert w.shape == (0, 4)
    for name in ("lpt", "identity", "balanced"):
        with pytest.raises(ValueError, match="is nan: every sample cost"):
            bal.get_balancer(name)(np.array([1.0, np.nan]), 1)
    with pytest.raises(ValueError) as e:
        bal.get_balancer("magic")
    assert str(e.value) == "balancer='magic' is unknown; choose one of ['balanced', 'identity', 'lpt']"
