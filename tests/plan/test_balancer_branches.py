"""Every branch of `balanced`, against oracles that are not the code under test:
brute force over every equal-count plan (`spec.reference.equal_count_optimum`: the optimum and the
fewest moves that reach it), the exact-sum rule (`spec.reference.sums_are_exact`), the
optimum by brute force over subsets (`spec.optimum`) and upstream's LPT (`spec.reference.lpt_order`).

Branches a random input rarely reaches are reached on purpose: float costs whose sums round, where
the search's plan is worse than LPT's by the correctly rounded sum and the LPT fallback must take
over; a search switched off (monkeypatch) so that the exhaustive correction (B <= 10) and the LPT
restart (large B) have to repair it."""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reorder.plan import balancers as bal
from spec import reference as ref
from support.costs import vlm_costs
from support.plans import assert_guarantees, assert_plan, fsum_max, lpt_max


# --- exact float sums ----------------------------------------------------------------------------

@pytest.mark.parametrize("costs", [
    [1.0, 2.0, 3.0], [0.0, 0.0], [2.0 ** -20, 3.0], [2.0 ** -21, 3.0], [0.1, 0.2], [1.5, 2.25],
    [2.0 ** 31 - 1, 0.0], [2.0 ** 31, 0.0], [2.0 ** 31, 1.0], [2.0 ** 30, 1.0, 1.0, 1.0], [2.0 ** 30 - 1, 0, 0, 0],
    [3.0 * 2 ** 20, 0.5], [1e-300, 1.0], [5e8 + 0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
def test_sums_are_exact_follows_the_rule(costs):
    assert bal._sums_are_exact(np.array(costs)) is ref.sums_are_exact(costs)


def test_integer_costs_whose_total_passes_2_to_the_32_still_stay_at_or_below_lpt():
    """Costs too large for the exact-float shortcut take the correctly rounded path."""
    rng = np.random.default_rng(5)
    for groups, m in ((3, 3), (4, 2), (2, 5), (6, 4)):
        c = rng.integers(2 ** 40, 2 ** 41, groups * m).astype(np.float64) + rng.random(groups * m).round(3)
        assert not ref.sums_are_exact(c.tolist())
        order = bal.balanced(c, groups)
        assert_plan(order, len(c), groups)
        assert fsum_max(c, order, groups) <= fsum_max(c, bal.lpt(c, groups), groups)


# --- the LPT fallback: the search's plan is worse than LPT's by the correctly rounded sums -----------

# Costs 1.0-1.3 in steps of 0.1: sums of equal multisets round differently, so the search (float
# loads) takes a plan it thinks equal to LPT's that is worse by math.fsum: LPT's plan must win.
FALLBACK = [
    (5, [1.2, 1.2, 1.3, 1.1, 1.0, 1.0, 1.3, 1.1, 1.2, 1.2]),
    (8, [1.3, 1.2, 1.1, 1.3, 1.2, 1.3, 1.2, 1.0, 1.1, 1.0, 1.0, 1.2, 1.2, 1.0, 1.3, 1.2]),
    (8, [1.3, 1.2, 1.1, 1.1, 1.3, 1.2, 1.0, 1.0, 1.1, 1.2, 1.2, 1.2, 1.2, 1.3, 1.0, 1.0]),
    (16, [1.0, 1.0, 1.0, 1.3, 1.3, 1.1, 1.2, 1.0, 1.3, 1.3, 1.2, 1.0, 1.1, 1.2, 1.1, 1.2, 1.3, 1.2, 1.0, 1.3,
          1.1, 1.0, 1.3, 1.0, 1.1, 1.1, 1.0, 1.1, 1.3, 1.0, 1.0, 1.3, 1.1, 1.0, 1.2, 1.1, 1.3, 1.2, 1.3, 1.0,
          1.2, 1.3, 1.2, 1.1, 1.2, 1.1, 1.0, 1.0, 1.2, 1.1, 1.3, 1.1, 1.3, 1.2, 1.3, 1.0, 1.2, 1.1, 1.2, 1.1,
          1.0, 1.3, 1.1, 1.2]),
]


@pytest.mark.parametrize("groups, costs", FALLBACK)
def test_lpt_fallback_when_the_search_is_worse_by_exact_sums(groups, costs):
    c = np.array(costs)
    order = bal.balanced(c, groups)
    assert_plan(order, len(c), groups)
    lpt_order = bal.lpt(c, groups)
    assert fsum_max(c, order, groups) <= fsum_max(c, lpt_order, groups)
    # the fallback is LPT's partition, relabelled to keep samples home: the same groups as LPT's
    m = len(c) // groups
    assert sorted(map(tuple, np.sort(order.reshape(groups, m), axis=1).tolist())) == \
        sorted(map(tuple, np.sort(lpt_order.reshape(groups, m), axis=1).tolist()))


@given(st.sampled_from([(2, 2), (3, 2), (5, 2), (4, 3), (8, 2), (4, 4), (16, 4)]), st.data())
def test_never_above_lpt_by_exact_sums_on_rounding_costs(shape, data):
    groups, m = shape
    c = np.array(data.draw(st.lists(st.sampled_from([1.0, 1.1, 1.2, 1.3]), min_size=groups * m,
                                    max_size=groups * m)))
    order = bal.balanced(c, groups)
    assert_plan(order, len(c), groups)
    assert fsum_max(c, order, groups) <= fsum_max(c, bal.lpt(c, groups), groups)


# --- fewest moves against brute force --------------------------------------------------------------

def tiny_instances():
    """140 seeded tiny instances (2-4 groups, 2-5 per group): integer, lognormal and tied costs."""
    rng = np.random.default_rng(2025)
    shapes = [(2, 2), (2, 3), (2, 4), (3, 2), (4, 2), (3, 3), (2, 5)]
    for i in range(140):
        groups, m = shapes[i % len(shapes)]
        kind = (i // len(shapes)) % 3
        n = groups * m
        if kind == 0:
            c = rng.integers(0, 20, n).astype(float)
        elif kind == 1:
            c = np.round(rng.lognormal(3, 1, n))
        else:
            c = rng.choice([0.0, 1.0, 2.0, 5.0, 9.0, 13.0], n)
        yield i, groups, c


# where the heuristic keeps more samples moving than the fewest possible: instance -> extra moves
EXTRA_MOVES = {25: 1, 32: 2, 54: 3, 74: 1, 94: 1}


def test_optimal_with_the_fewest_moves_on_tiny_instances():
    """Every tiny instance: the optimal max load; the fewest moved samples among optimal plans on all
    but the five listed, where at most the listed extra samples move."""
    for i, groups, c in tiny_instances():
        order = bal.balanced(c, groups)
        assert_plan(order, len(c), groups)
        opt, fewest = ref.equal_count_optimum(c.tolist(), groups)
        assert fsum_max(c, order, groups) == opt, i
        assert ref.moved_samples(order.tolist(), groups) <= fewest + EXTRA_MOVES.get(i, 0), i
        if i not in EXTRA_MOVES:
            assert ref.moved_samples(order.tolist(), groups) == fewest, i


@pytest.mark.parametrize("groups, costs, moved", [
    (3, [10.0, 10, 10, 1, 1, 1], 2),
    (3, [9.0, 9, 9, 9, 5, 5, 5, 5, 1, 1, 1, 1], 4),
    (4, [9000.0, 7000, 300, 200, 1200, 0, 800, 500], 2),
    (2, [1.0, 5, 2, 4], 0),
    (2, [8.0, 8, 0, 0], 2),
    (3, [0.0, 0, 6, 6, 3, 3], 2),
])
def test_moves_on_the_documented_examples(groups, costs, moved):
    order = bal.balanced(costs, groups)
    opt, fewest = ref.equal_count_optimum(costs, groups) if len(costs) <= 10 else (None, moved)
    assert fewest == moved
    assert ref.moved_samples(order.tolist(), groups) == moved
    if opt is not None:
        assert fsum_max(costs, order, groups) == opt


# --- the exhaustive correction and the LPT restart, with the search switched off ----------------

def no_search(monkeypatch):
    for name in ("_pair_rounds", "_batched_rounds", "_improve"):
        monkeypatch.setattr(bal, name, lambda *a, **k: None)
    monkeypatch.setattr(bal, "_coarse", lambda M, C, L, theta: (M, C))


def test_exhaustive_correction_finds_the_optimum_the_search_missed(monkeypatch):
    """B <= 10: with no search at all the plan is the better of the natural and LPT's; wherever both
    miss the optimum, the exhaustive step must still return it."""
    no_search(monkeypatch)
    repaired = 0
    for i, groups, c in tiny_instances():
        if groups == 2 or len(c) > 10:
            continue
        opt, _ = ref.equal_count_optimum(c.tolist(), groups)
        order = bal.balanced(c, groups)
        assert_plan(order, len(c), groups)
        assert fsum_max(c, order, groups) == opt, i
        repaired += min(fsum_max(c, np.arange(len(c)), groups), fsum_max(c, bal.lpt(c, groups), groups)) > opt
    assert repaired >= 3


def test_exhaustive_partition_against_brute_force():
    for i, groups, c in tiny_instances():
        m = len(c) // groups
        load, parts = bal._exhaustive(c, groups, m)
        assert parts.shape == (groups, m) and sorted(parts.ravel().tolist()) == list(range(len(c)))
        opt, fewest = ref.equal_count_optimum(c.tolist(), groups)
        assert load == max(math.fsum(c[p].tolist()) for p in parts) == opt, i
        # among optimal partitions the most samples can stay home: relabelled, it moves the fewest
        assert ref.moved_samples(np.sort(bal._relabel(parts, m), axis=1).ravel().tolist(), groups) <= fewest + 1


@pytest.mark.parametrize("seed", range(3))
def test_lpt_restart_repairs_a_large_plan_the_search_left_above_lpt(monkeypatch, seed):
    """B >= 256 with no search: the natural plan is above LPT's, so LPT's partition (relabelled) and
    a search from it replace it; the result is never above LPT."""
    rng = np.random.default_rng(seed)
    groups, m = 32, 16
    c = np.round(rng.lognormal(np.log(2500), 0.8, groups * m))
    c[: m] *= 6                                           # group 0 far above every plan LPT makes
    no_search(monkeypatch)
    order = bal.balanced(c, groups)
    assert_plan(order, len(c), groups)
    assert fsum_max(c, order, groups) == fsum_max(c, bal.lpt(c, groups), groups)
    assert ref.moved_samples(order.tolist(), groups) < ref.moved_samples(bal.lpt(c, groups).tolist(), groups)


# --- the whole plan on rare branches: its guarantees, with phases switched off -----------------------

def test_balanced_asks_lpt_only_up_to_a_plans_max(monkeypatch):
    """Every branch of `balanced` (two groups, the search, a natural plan at the bound) computes
    LPT's max against a finite plan max, so LPT stops early; the plans keep their guarantees."""
    seen, real = [], bal._lpt_max
    monkeypatch.setattr(bal, "_lpt_max", lambda c, g, v, above=math.inf: seen.append(above) or real(c, g, v, above))
    rng = np.random.default_rng(4)
    cases = [(np.array([9.0, 1, 5, 5]), 2), (vlm_costs(rng, 64, 1), 8), (np.full(12, 3.0), 4)]
    for c, groups in cases:
        seen.clear()
        assert_guarantees(c, groups)
        assert seen and all(math.isfinite(a) for a in seen), (groups, seen)


PHASES = {"coarse": lambda M, C, L, theta: (M, C), "pair_rounds": lambda *a: None, "batched_rounds": lambda *a: None,
          "improve": lambda *a: None}


@pytest.mark.parametrize("off", [("coarse",), ("pair_rounds",), ("batched_rounds",), ("improve",),
                                 ("coarse", "pair_rounds", "batched_rounds"), tuple(PHASES)])
def test_guarantees_hold_with_phases_switched_off(monkeypatch, off):
    """The later phases (the LPT restart and its search, the exhaustive correction, return-home, the
    final check against LPT) meet the plans that the earlier ones would have repaired: the plan still
    never goes above LPT, and is still optimal where promised."""
    for name in off:
        monkeypatch.setattr(bal, "_" + name, PHASES[name])
    rng = np.random.default_rng(len(off))
    for i, (groups, m) in enumerate([(5, 2), (3, 3), (4, 2), (3, 2), (2, 5), (2, 8), (4, 4), (16, 8), (32, 8),
                                     (16, 16), (64, 4), (20, 13), (8, 32), (3, 40)]):
        assert_guarantees(vlm_costs(rng, groups * m, i % 6), groups)


@pytest.mark.parametrize("kind", range(3))
def test_filtered_two_group_resplit_on_zeros_and_large_rounding_totals(kind):
    """The filter's margin is relative to the row total: all zeros (margin 0) and totals of 10**4 with
    sums that round must still keep every optimal partition."""
    for m in (7, 8):
        rng = np.random.default_rng(kind * 10 + m)
        u = [np.zeros(2 * m), rng.choice([100.1, 200.2, 300.3, 700.7, 1100.1, 2200.2], 2 * m),
             rng.choice([0.1, 0.2, 0.3], 2 * m) * 1e5 + rng.choice([0.0, 0.1, 0.2], 2 * m)][kind][None, :]
        pmax = bal._partition_max(u, 2, m)
        rows, parts = np.nonzero(pmax == pmax.min())
        best, r, p = bal._best_partitions(u, 2, m, len(pmax[0]))
        assert best == pmax.min() and np.array_equal(r, rows) and np.array_equal(p, parts)


def _no_search(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the search ran on a natural plan at the bound")
    monkeypatch.setattr(bal, "_search", refuse)
    monkeypatch.setattr(bal, "_resplit", refuse)


@pytest.mark.parametrize("groups", [2, 3, 4])
@pytest.mark.parametrize("costs", ["zeros", "even"])
def test_a_natural_plan_at_the_bound_is_kept_without_a_search(groups, costs, monkeypatch):
    """All costs 0, or every group's natural load equal to the bound: nothing to search, nothing moves."""
    _no_search(monkeypatch)
    c = np.zeros(4 * groups) if costs == "zeros" else np.tile([5.0, 1.0, 3.0, 3.0], groups)
    assert bal.balanced(c, groups).tolist() == list(range(4 * groups))


@pytest.mark.parametrize("groups, deltas, base", [(2, (0, 0, 0, 0, 1, 1), 333303699983),
                                                  (3, (0, 0, 0, 1, 1, 2), 499955549974)])
def test_a_natural_plan_within_the_margin_of_the_bound_is_kept_by_the_search(groups, deltas, base, monkeypatch):
    """The natural max load is exactly lb * (1 + 1e-12) (lb = 999911099950, the max one more): the
    search does not start (neither the search nor the two-group re-split runs), and the final check
    replaces the natural plan by LPT's, which is exactly lb: the optimum."""
    _no_search(monkeypatch)
    c = np.array([base + d for d in deltas], dtype=np.float64)
    lb = bal.quick_lower_bound(c, groups)
    natural = max(math.fsum(r) for r in c.reshape(groups, -1).tolist())
    assert lb == 999911099950.0 and natural == lb * (1 + 1e-12) == lb + 1
    order = assert_guarantees(c, groups)
    assert fsum_max(c, order, groups) == lb == lpt_max(c, groups)


def test_lpt_restart_searches_with_the_large_instance_partners(monkeypatch):
    """64 x 16 with the first phases off: the first search ends above LPT's max load, and the search
    from LPT's partition (with K = 2048 // 16**2 = 8 partners) decides the plan: at or below LPT's
    max load, with fewer samples moved than LPT's plan."""
    for name in ("coarse", "pair_rounds", "batched_rounds"):
        monkeypatch.setattr(bal, "_" + name, PHASES[name])
    c = np.round(np.random.default_rng(45).lognormal(np.log(2500), 0.8, 64 * 16))
    order = assert_guarantees(c, 64)
    assert ref.moved_samples(order.tolist(), 64) < ref.moved_samples(ref.lpt_order(c.tolist(), 64), 64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_plan_does_not_depend_on_the_cost_unit(seed):
    """Costs in seconds, ms or patches plan alike: scaling every cost by a power of two scales every
    float sum exactly, so a large instance (B >= 256: the evict-and-refill phase runs) gets the same
    plan, also when its total cost is below one unit."""
    costs = np.random.default_rng(seed).lognormal(0.0, 0.8, 512) * 2.0 ** -10
    plan = bal.balanced(costs, 32)
    assert_plan(plan, 512, 32)
    for scale in (2.0 ** 8, 2.0 ** 20, 2.0 ** 40):
        assert bal.balanced(costs * scale, 32).tolist() == plan.tolist()


@pytest.mark.parametrize("seed", range(40))
def test_a_three_group_resplit_takes_the_heaviest_and_two_of_the_four_lightest(seed):
    """`_resplit(k=3)` bounds its work by its partners: only the heaviest group and two of the four
    lightest may change, and only when the re-split lowers the heaviest load."""
    rng = np.random.default_rng(seed)
    G, m = int(rng.integers(6, 9)), int(rng.integers(1, 4))
    C = np.round(rng.lognormal(3, 1, (G, m)), 1)
    M = np.arange(G * m).reshape(G, m)
    L = bal._row_sums(C)
    order = np.argsort(L, kind="stable")
    allowed = {int(order[-1])} | {int(g) for g in order[:4]}
    before_C, before_L = C.copy(), L.copy()
    changed_plan = bal._resplit(M, C, L, 3, [10 ** 9])
    changed = {g for g in range(G) if not np.array_equal(C[g], before_C[g])}
    assert changed <= allowed
    assert changed_plan == bool(changed)
    if changed_plan:  # applied only when it lowers the heaviest group's load
        assert L[int(order[-1])] < before_L[int(order[-1])]


def test_a_resplit_of_more_groups_than_there_are_reports_no_change():
    """Three groups cannot be re-split among two: nothing changes and `_improve` is told so (a True
    would send it round its loop again to its iteration bound)."""
    C = np.array([[9.0, 1.0], [2.0, 3.0]])
    M, L = np.arange(4).reshape(2, 2), bal._row_sums(C)
    assert bal._resplit(M, C, L, 3, [10 ** 9]) is False
    assert C.tolist() == [[9.0, 1.0], [2.0, 3.0]] and M.tolist() == [[0, 1], [2, 3]]


def test_refill_counts_a_second_vacancy_as_the_smallest_evicted_cost():
    """`_refill`'s rule with one slot beyond the next (extra = 1): the evicted costs 5, 19, 10 go
    back into group 0 (one vacancy, 4 pinned) and group 3 (two vacancies, nothing pinned), which
    expects 0 + 5 (its second slot counts as the smallest evicted cost). LPT: 19 to group 0 (4 < 5),
    10 to group 3, 5 to group 3: loads 23 and 15 (counting that slot as 0 would give 14 and 24)."""
    C = np.array([[4.0, 5.0], [0.0, 64.0], [29.0, 5.0], [19.0, 10.0], [4.0, 24.0]])
    M = np.arange(10).reshape(5, 2)
    out = np.array([[0, 1], [0, 0], [0, 0], [1, 1], [0, 0]], dtype=bool)
    M2, C2 = bal._refill(M, C, out)
    assert M2.tolist() == [[0, 6], [2, 3], [4, 5], [7, 1], [8, 9]]
    assert bal._row_sums(C2).tolist() == [23.0, 64.0, 34.0, 15.0, 28.0]
