"""The phases of `balanced` (reorder.plan.balancers), each held to what its docstring promises on plans
in progress, checked by brute force over the candidate moves or against `spec.optimum`, never against
a restatement of the phase: a plan in progress stays a plan (every sample once, m per group, loads the
left-to-right row sums), the phases that must not raise the max load do not, a swap search that says it
is stuck has no improving swap left, a re-split reaches the optimum of the groups it re-splits.

A plan in progress is (M, C, L): M[g] the samples of group g, C[g] their costs, L[g] its load."""

import math

import numpy as np
import pytest

from reorder.plan import balancers as bal
from spec import optimum as opt
from spec import reference as ref
from support.costs import vlm_costs

KINDS = range(6)          # support.costs.vlm_costs: bimodal, lognormal, heavy tail, rounding floats, floats, ties


def random_state(rng, groups, m, kind):
    """A random plan in progress over costs of `kind`."""
    c = vlm_costs(rng, groups * m, kind)
    M = rng.permutation(groups * m).reshape(groups, m).astype(np.int64)
    return c, M, c[M], bal._row_sums(c[M])


def assert_state(c, M, C, L):
    G, m = M.shape
    assert sorted(M.ravel().tolist()) == list(range(G * m))
    assert C.tolist() == c[M].tolist()
    assert L.tolist() == np.cumsum(C, axis=1)[:, -1].tolist()


def moved(M):
    m = M.shape[1]
    return int((M // m != np.arange(M.shape[0])[:, None]).sum())


def copy(state):
    return tuple(x.copy() for x in state)


def swaps_of(M0, M1):
    """The samples that changed group: {sample: (group before, group after)}."""
    g0 = {int(i): g for g, row in enumerate(M0.tolist()) for i in row}
    g1 = {int(i): g for g, row in enumerate(M1.tolist()) for i in row}
    return {i: (g0[i], g1[i]) for i in g0 if g0[i] != g1[i]}


def not_above(a, b, exact):
    """a <= b, up to the last bits of a float row sum when the costs' sums round."""
    return a <= b if exact else a <= b * (1 + 1e-12)


def unique_heaviest(L):
    top = L.max()
    return int(np.argmax(L)) if np.count_nonzero(L == top) == 1 else None


SHAPES = [(2, 2), (2, 4), (3, 3), (4, 3), (5, 2), (8, 4), (6, 5), (16, 8), (3, 12)]


# --- pair rounds, batched rounds, local search, improve: the max load never rises ------------------

@pytest.mark.parametrize("groups, m", SHAPES)
def test_swap_phases_keep_a_plan_and_never_raise_the_max_load(groups, m):
    rng = np.random.default_rng(groups * 100 + m)
    for kind in KINDS:
        c, M0, C0, L0 = random_state(rng, groups, m, kind)
        lb = bal.quick_lower_bound(c, groups)
        for target in (0.0, lb, lb * 1.01, float(L0.max())):
            runs = {"pair": lambda M, C, L: bal._pair_rounds(M, C, L, target, 6),
                    "batched": lambda M, C, L: bal._batched_rounds(M, C, L, target, 8, 64),
                    "local": lambda M, C, L: bal._local_search(M, C, L, target, 8, max(1, groups // 2)),
                    "improve": lambda M, C, L: bal._improve(M, C, L, target, 16, groups - 1)}
            for name, run in runs.items():
                M, C, L = copy((M0, C0, L0))
                run(M, C, L)
                assert_state(c, M, C, L)
                assert not_above(L.max(), L0.max(), ref.sums_are_exact(c.tolist())), (name, kind, target)
                if L0.max() <= target:
                    assert M.tolist() == M0.tolist(), (name, "moved although at the target")


@pytest.mark.parametrize("groups, m", SHAPES)
def test_a_pair_round_swaps_one_sample_per_pair_and_lowers_the_pair(groups, m):
    """One round: the changed groups come in disjoint pairs, a heavier and a lighter one trading one
    sample each; the heavier gives the larger cost, and the pair's max load drops strictly; the
    trade is the one nearest half the load gap among every trade of the pair (by brute force)."""
    rng = np.random.default_rng(groups * 7 + m)
    for kind in KINDS:
        c, M0, C0, L0 = random_state(rng, groups, m, kind)
        M, C, L = copy((M0, C0, L0))
        bal._pair_rounds(M, C, L, 0.0, 1)
        moves = swaps_of(M0, M)
        pairs = {}
        for i, (a, b) in moves.items():
            pairs.setdefault(frozenset((a, b)), []).append(i)
        touched = [g for p in pairs for g in p]
        assert len(touched) == len(set(touched)) and all(len(v) == 2 for v in pairs.values())
        for pair, (i, j) in pairs.items():
            h, l = sorted(pair, key=lambda g: -L0[g])
            out, back = (i, j) if moves[i][0] == h else (j, i)
            assert c[out] > c[back]
            assert max(L[h], L[l]) < L0[h] or not ref.sums_are_exact(c.tolist())
            gap = L0[h] - L0[l]
            nearest = min(abs(x - y - 0.5 * gap) for x in C0[h] for y in C0[l])
            assert abs(c[out] - c[back] - 0.5 * gap) == nearest


@pytest.mark.parametrize("groups, m", SHAPES)
def test_local_search_stuck_means_no_improving_swap_and_one_step_is_the_best_swap(groups, m):
    """Against every group (K = G-1): `stuck` only when no swap of the heaviest group with another
    brings both below its load; one step makes a swap of the lowest pair max, and among those one
    that leaves the fewest samples away from home; a search that stops unstuck early is at the target."""
    rng = np.random.default_rng(groups * 13 + m)
    for kind in KINDS:
        c, M0, C0, L0 = random_state(rng, groups, m, kind)
        h = unique_heaviest(L0)
        if h is None:
            continue
        cands = [(max(L0[h] - (x - y), L0[q] + (x - y)), a, q, b)
                 for a, x in enumerate(C0[h]) for q in range(groups) if q != h for b, y in enumerate(C0[q])]
        lowest = min(k[0] for k in cands)
        M, C, L = copy((M0, C0, L0))
        it, stuck = bal._local_search(M, C, L, 0.0, 1, groups - 1)
        assert_state(c, M, C, L)
        if stuck:
            assert not lowest < L0[h] and M.tolist() == M0.tolist()
            continue
        assert it == 1 and lowest < L0[h]
        moves = swaps_of(M0, M)
        assert len(moves) == 2
        q = next(g for g in {g for pair in moves.values() for g in pair} if g != h)
        if ref.sums_are_exact(c.tolist()):
            assert max(L[h], L[q]) == lowest
        best_away = min(moved(_swapped(M0, h, a, q2, b)) for k, a, q2, b in cands if k == lowest)
        assert moved(M) == best_away
        M, C, L = copy((M0, C0, L0))
        it, stuck = bal._local_search(M, C, L, float(np.median(L0)), 64, groups - 1)
        assert stuck or it == 64 or L.max() <= np.median(L0)


def _swapped(M, h, a, q, b):
    M = M.copy()
    M[h, a], M[q, b] = M[q, b], M[h, a]
    return M


@pytest.mark.parametrize("groups, m", SHAPES)
def test_gather_trades_the_heaviest_groups_large_costs_for_smaller_ones(groups, m):
    rng = np.random.default_rng(groups * 17 + m)
    for kind in KINDS:
        c, M0, C0, L0 = random_state(rng, groups, m, kind)
        h = unique_heaviest(L0)
        M, C, L = copy((M0, C0, L0))
        n = bal._gather(M, C, L)
        assert_state(c, M, C, L)
        moves = swaps_of(M0, M)
        assert len(moves) == 2 * n
        exact = ref.sums_are_exact(c.tolist())
        assert not_above(L.max(), L0.max(), exact)
        if h is not None:
            assert all(h in pair for pair in moves.values())
            assert L[h] < L0[h] or n == 0 or not exact


# --- re-splits: the optimum of the groups they take ------------------------------------------------

@pytest.mark.parametrize("groups, m", [(2, 2), (3, 2), (2, 4), (4, 3), (5, 2), (3, 4), (6, 3), (2, 7)])
def test_two_group_resplit_reaches_the_best_pair_optimum(groups, m):
    """k = 2: the heaviest group with any other; every partition of the two: the new max load of the
    pair is the lowest optimum over partners (brute force), applied only when below the heaviest
    load; the other groups keep their samples."""
    rng = np.random.default_rng(groups * 19 + m)
    for kind in (0, 1, 2, 5):                                   # exact sums: float and fsum loads agree
        c, M0, C0, L0 = random_state(rng, groups, m, kind)
        h = unique_heaviest(L0)
        if h is None:
            continue
        best = min(opt.optimal_max_load(C0[h].tolist() + C0[q].tolist(), 2) for q in range(groups) if q != h)
        M, C, L = copy((M0, C0, L0))
        done = bal._resplit(M, C, L, 2, [math.inf])
        assert_state(c, M, C, L)
        assert done == (best < L0[h])
        changed = {g for pair in swaps_of(M0, M).values() for g in pair}
        if done:
            assert h in changed and len(changed) == 2
            assert max(L[g] for g in changed) == best
        else:
            assert not changed


@pytest.mark.parametrize("groups, m", [(3, 2), (4, 3), (5, 2), (6, 3), (3, 4)])
def test_three_group_resplit_is_optimal_for_the_groups_it_takes(groups, m):
    """k = 3: a heaviest group and two others; when all three change, their new max load is the
    optimum of their samples (brute force), below the heaviest load; the other groups stay."""
    rng = np.random.default_rng(groups * 23 + m)
    for kind in (0, 1, 2, 5):
        c, M0, C0, L0 = random_state(rng, groups, m, kind)
        M, C, L = copy((M0, C0, L0))
        if not bal._resplit(M, C, L, 3, [math.inf]):
            assert M.tolist() == M0.tolist()
            continue
        assert_state(c, M, C, L)
        changed = sorted({g for pair in swaps_of(M0, M).values() for g in pair})
        assert 2 <= len(changed) <= 3 and L0[changed].max() == L0.max()
        assert L[changed].max() < L0.max() and L.max() <= L0.max()
        if len(changed) == 3:
            assert L[changed].max() == opt.optimal_max_load(C0[changed].ravel().tolist(), 3)


@pytest.mark.parametrize("k", [2, 3])
def test_resplit_spends_its_budget_or_declines(k):
    """A re-split costs (partner choices) x (partitions of k groups); without that budget left it
    does nothing."""
    rng = np.random.default_rng(k)
    groups, m = 5, 3
    c, M0, C0, L0 = random_state(rng, groups, m, 0)
    work = math.comb(groups - 1 if k == 2 else min(groups - 1, bal._RESPLIT_PARTNERS), k - 1) * splits(k, m)
    M, C, L = copy((M0, C0, L0))
    budget = [work - 1]
    assert not bal._resplit(M, C, L, k, budget) and budget == [work - 1] and M.tolist() == M0.tolist()
    budget = [work]
    bal._resplit(M, C, L, k, budget)
    assert budget == [0]


def splits(k, m):
    """How many ways k*m items split into k unlabelled groups of m: (km)! / (m!^k k!)."""
    return math.factorial(k * m) // (math.factorial(m) ** k * math.factorial(k))


def test_partition_tables_hold_every_split_once():
    for k, m in ((2, 2), (2, 5), (3, 2), (3, 3), (4, 3), (2, 8)):
        P = bal._partitions(k, m)
        assert P.shape == (splits(k, m), k, m)
        found = {frozenset(frozenset(b) for b in p) for p in P.tolist()}
        assert len(found) == len(P) and all(sorted(x for b in f for x in b) == list(range(k * m)) for f in found)


# --- return home, relabel, evict and refill -------------------------------------------------------

@pytest.mark.parametrize("groups, m", SHAPES)
def test_return_home_moves_fewer_samples_within_the_cap(groups, m):
    rng = np.random.default_rng(groups * 29 + m)
    for kind in KINDS:
        c, M0, C0, L0 = random_state(rng, groups, m, kind)
        for cap in (float(L0.max()), float(np.median(L0)), math.inf):
            M, C, L = copy((M0, C0, L0))
            bal._return_home(M, C, L, cap, 1)
            assert_state(c, M, C, L)
            if M.tolist() != M0.tolist():
                assert moved(M) < moved(M0)
                changed = {g for pair in swaps_of(M0, M).values() for g in pair}
                assert all(L[g] <= cap for g in changed)
            M2, C2, L2 = copy((M0, C0, L0))
            bal._return_home(M2, C2, L2, cap, 4)
            assert moved(M2) <= moved(M)
            if cap == math.inf:
                assert moved(M2) < moved(M0) or moved(M0) == 0


@pytest.mark.parametrize("groups, m", SHAPES)
def test_relabel_keeps_the_groups_and_their_samples(groups, m):
    rng = np.random.default_rng(groups * 31 + m)
    for _ in range(6):
        X = rng.permutation(groups * m).reshape(groups, m)
        R = bal._relabel(X, m)
        assert sorted(map(sorted, R.tolist())) == sorted(map(sorted, X.tolist()))
        assert np.array_equal(bal._relabel(np.arange(groups * m).reshape(groups, m), m),
                              np.arange(groups * m).reshape(groups, m))


@pytest.mark.parametrize("groups, m", [(4, 64), (16, 16), (64, 4), (8, 32), (3, 100), (512, 2), (300, 4)])
def test_evict_and_refill_moves_only_the_evicted_samples(groups, m):
    """Groups above theta keep their largest cost, those at or below it give up their smallest
    ones, at most m-1 each; the refill puts exactly the evicted samples back into the vacated slots."""
    rng = np.random.default_rng(groups + m)
    for kind in KINDS:
        c, M, C, L = random_state(rng, groups, m, kind)
        for theta in (bal.quick_lower_bound(c, groups), float(np.mean(L)), float(np.median(L)), 0.0,
                      float(L.max())):
            out = bal._evictions(C, L, theta)
            if out is None:
                assert bal._coarse(M, C, L, theta)[0].tolist() == M.tolist()
                continue
            assert out.shape == (groups, m) and out.dtype == np.bool_
            assert (out.sum(axis=1) <= m - 1).all()
            for g in range(groups):
                if not out[g].any():
                    continue
                if L[g] > theta:
                    top = int(np.argmax(C[g]))
                    assert not out[g][top]
                    rest = np.delete(C[g], top)[~np.delete(out[g], top)]
                    assert rest.size == 0 or C[g][out[g]].min() >= rest.max()
                else:
                    assert C[g][out[g]].max() <= C[g][~out[g]].min()
            M2, C2 = bal._refill(M, C, out)
            assert (M2[~out] == M[~out]).all() and sorted(M2[out].tolist()) == sorted(M[out].tolist())
            assert C2.tolist() == c[M2].tolist()
            M3, C3 = bal._coarse(M, C, L, theta)
            assert M3.tolist() == M2.tolist()


# --- LPT inside balanced: the reference's partition and max -----------------------------------------

def test_lpt_partition_and_max_are_the_references():
    rng = np.random.default_rng(9)
    for groups, m in ((2, 2), (3, 3), (8, 4), (16, 16), (5, 1), (1, 6), (256, 2), (300, 3)):
        for kind in KINDS:
            c = vlm_costs(rng, groups * m, kind)
            order = ref.lpt_order(c.tolist(), groups)
            visit = np.argsort(-c, kind="stable")
            assert bal._lpt_members(c, groups).tolist() == [sorted(order[j * m:(j + 1) * m]) for j in range(groups)]
            assert bal._lpt_max(c, groups, visit) == max(ref.group_loads(c.tolist(), order, groups))


@pytest.mark.parametrize("iters", [1, 2, 5, 16])
def test_improve_spends_exactly_its_step_budget(monkeypatch, iters):
    """`_improve` gives the local search what is left of `iters`: each round uses the steps the search
    took plus one (the gather or re-split between searches), and no round starts once they are spent."""
    calls = []
    real = bal._local_search

    def counted(M, C, L, target, left, K):
        it, stuck = real(M, C, L, target, left, K)
        calls.append((left, it, stuck))
        return it, stuck

    monkeypatch.setattr(bal, "_local_search", counted)
    rng = np.random.default_rng(iters)
    for kind in KINDS:
        for groups, m in ((4, 3), (3, 4), (8, 2)):
            c, M, C, L = random_state(rng, groups, m, kind)
            calls.clear()
            bal._improve(M, C, L, 0.0, iters, groups - 1)  # target 0: never reached, so only the budget stops it
            left = iters
            for k, (given, it, stuck) in enumerate(calls):
                assert given == left and 0 <= it <= given, (kind, calls)
                left -= it + 1
                if k < len(calls) - 1:
                    assert stuck and left > 0, (kind, calls)
            assert calls and (left <= 0 or calls[-1][2]), (kind, calls)
