"""Balancers: pure equal-count assignments of B sample costs to G groups (numbers in, numbers out).

A balancer takes `costs` (float64 [B], natural order) and `groups` (G, B % G == 0) and returns the
canonical order: int64 [B], position p -> natural sample index; group j holds positions
[j*B/G, (j+1)*B/G). Sample i naturally sits in group i // (B/G). Every balancer is deterministic:
ties are broken by index, never by hash or dict order.

- "identity": the natural assignment, nothing moves.
- "lpt": equal-count LPT, bit-for-bit the reference (compatibility mode, docs/design.md, Balancers).
- "balanced" (recommended): a max group load never above LPT's on any input, usually optimal or
  within 0.05% of it, and far fewer samples moved (`balanced` says how).
For tests and benchmarks: `lower_bound` (a proven lower bound on the optimal max load) and `exact`
(the optimum, by MILP; needs scipy).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import operator

import numpy as np

from reorder.plan.shared import read_only


def check_costs(costs, groups, *, slots: bool = False) -> np.ndarray:
    """The input check of every balancer, the bounds, `exact` and `plan_orders` (one function, so they
    all refuse the same inputs with the same words): `costs` as contiguous float64, shape [B] (with
    `slots`, [W, B]: one row per micro-batch), after checking that `groups` is an integer >= 1, B a
    positive multiple of it and every cost finite and >= 0. Else a ValueError naming the argument and
    the value."""
    c = np.ascontiguousarray(costs, dtype=np.float64)
    if c.ndim != (2 if slots else 1):
        want = "[slots, B], one row of per-sample costs per micro-batch" if slots else \
            "one cost per sample, shape [B]"
        raise ValueError(f"costs has shape {c.shape}: expected {want}")
    if isinstance(groups, bool) or not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"groups={groups!r} is invalid: the canonical grid G must be an integer >= 1")
    n = c.shape[-1]
    if n == 0 or n % groups:
        raise ValueError(f"costs holds B={n} samples{' per slot' if slots else ''}, not a positive multiple of "
                         f"groups={int(groups)}: every group holds B/G samples, so choose B as a multiple of "
                         f"G = lcm(DP sizes)")
    if c.size and not (c.min() >= 0 and c.max() < math.inf):      # NaN fails the first test
        bad = np.unravel_index(int(np.flatnonzero(~np.isfinite(c) | (c < 0))[0]), c.shape)
        where = ", ".join(str(int(i)) for i in bad)
        raise ValueError(f"costs[{where}] is {float(c[bad])!r}: every sample cost must be finite and >= 0")
    return c


def identity(costs: np.ndarray, groups: int) -> np.ndarray:
    """The natural assignment: nothing moves."""
    return np.arange(len(check_costs(costs, groups)), dtype=np.int64)


def lpt(costs: np.ndarray, groups: int) -> np.ndarray:
    """Equal-count LPT, bit-for-bit the reference (docs/design.md, Balancers).

    Visit samples by (-cost, index); each goes to the non-full group with the smallest
    (load, group index); canonical order = groups in order, members in insertion order.
    """
    c = check_costs(costs, groups)
    visit = np.argsort(-c, kind="stable")  # (-cost, index)
    grp = np.asarray(_lpt_run(c, groups, visit)[1], dtype=np.int64)  # group of visit[k]
    return visit[np.argsort(grp, kind="stable")].astype(np.int64)  # groups in order, insertion order


# --------------------------------------------------------------------------------------------------
# "balanced": movement-aware equal-count balancing, never worse than LPT.
#
# Every load here is a float64 sum in a fixed order (np.cumsum along a row, or Python's sequential
# `+`): no order-dependent reductions, so every rank of every module computes bit-identical plans.
# Every loop has a fixed iteration bound (never a wall-clock one): same inputs, same work, same plan.
# --------------------------------------------------------------------------------------------------

# Tuning constants of `balanced` and of list scheduling, with what each sets (the algorithm's rules,
# such as exact float sums below 2**32 or the pair-round aim of half the load gap, stay in the code).
# Search effort and stopping:
_TOL = 5e-4             # the search stops once the max load is within 0.05% of the proven lower bound
_EXACT_MARGIN = 1e-12   # float max loads closer than this (relative) are compared with math.fsum
_SMALL = 1024           # G*m*m at or below: "small", swaps against every group and a second start from LPT
_SMALL_ITERS = 64       # swap iterations per start on small instances
_POLISH_ITERS = 8       # single-swap iterations after the batched rounds (large instances)
_POLISH_WORK = 2048     # swap candidates per polish iteration (sets how many light groups are tried)
# Phases on large instances:
_COARSE_MIN = 256       # B at or above: evict-and-refill before the swap rounds
_PAIR_ROUNDS = 6        # vectorised heaviest/lightest pair rounds
_BATCH_ROUNDS = 8       # batched swap rounds (large instances only)
_BATCH_WORK = 8192      # swap candidates evaluated per batched round
# Sending moved samples back home at the end (at 1024 x 64 one round costs ~0.09 ms and saves ~1%
# of the samples moved):
_HOME_ROUNDS = 4        # rounds on small instances
_HOME_ROUNDS_LARGE = 1  # rounds on large instances below _HOME_MAX_B samples
_HOME_MAX_B = 1024      # B at or above: no round
# Re-splits and exact steps:
_RESPLIT_M = 4          # re-split moves (every partition of two or three groups' samples) for m up to this
_RESPLIT_WORK = 12000   # partitions one search may evaluate in re-splits (bounds their time)
_RESPLIT_PARTNERS = 4   # a three-group re-split takes the heaviest group and two of this many lightest
_RESPLIT_CANDIDATES = 256  # optimal re-splits among which the labelling that keeps most samples home is chosen
_TWO_GROUP_EXACT_M = 8  # G == 2 and m up to this: one exact two-group re-split is the whole search
_EXHAUSTIVE_B = 10      # B at or below: every partition is tried, the max load is the optimum
_FILTER_MIN_P = 1000    # two-group re-splits over at least this many partitions filter by approximate loads
_FILTER_TOL = 1e-11     # the filter's margin, relative to the row total: far above its approximation error
# List scheduling (LPT and the refill), the same result either way:
_ROUNDS_MIN_G = 256     # groups with room at or above: by rounds of array operations, else a heap
_SHORT_ROUND = 8        # a round of fewer than G / this samples hands the next G samples to the heap


def _row_sums(C: np.ndarray) -> np.ndarray:
    """Per-row sums in a fixed left-to-right order (((c0 + c1) + c2) + ...), bit-identical on every
    machine: exactly np.cumsum(C, axis=-1)[..., -1]; many short rows add column by column (numpy's
    cumsum over many short rows is slow)."""
    k = C.shape[-1]
    if k > 32 or k >= 8 and C.size <= 512:
        return np.cumsum(C, axis=-1)[..., -1].copy()
    out = C[..., 0].copy()
    for j in range(1, k):
        out += C[..., j]
    return out


def _partition_max(costs: np.ndarray, groups: int, m: int) -> np.ndarray:
    """Max bin load of every partition of `_partitions(groups, m)`: costs [..., groups*m] ->
    [..., P]. Each bin's load is summed left to right over its m members (as `_row_sums`)."""
    cols = _partition_columns(groups, m)                   # [m, P, groups], contiguous per member
    g = np.take(costs, cols, axis=-1)                      # [..., m, P, groups] (take: faster than [..., cols])
    load = g[..., 0, :, :].copy()
    for j in range(1, m):
        load += g[..., j, :, :]
    out = load[..., 0].copy()
    for b in range(1, load.shape[-1]):
        np.maximum(out, load[..., b], out=out)
    return out


def _partition_columns(groups: int, m: int) -> np.ndarray:
    return read_only(np.ascontiguousarray(np.moveaxis(_partitions(groups, m), 2, 0)))


# the caches wrap plain functions, not decorator syntax: mutmut mutates no decorated function
_partition_columns = functools.lru_cache(maxsize=None)(_partition_columns)


def _best_partitions(U: np.ndarray, groups: int, m: int, limit: int):
    """The lowest max bin load over every row of U [R, groups*m] and every partition of
    `_partitions(groups, m)`, exactly as `_partition_max` computes it, and the (row, partition) pairs
    that reach it, row-major, the first `limit`: (load, rows, partitions).

    One row, two bins and many partitions: each max load is first approximated from subset sums of
    either half of the row (in any order: off by about 3m * 2**-53 of the row total at most), and
    exact loads are computed only where the approximation is within `_FILTER_TOL` of the row total of
    the lowest one: a superset of the partitions reaching the exact minimum."""
    P = _partitions(groups, m)
    if groups == 2 and len(U) == 1 and len(P) >= _FILTER_MIN_P:
        u = U[0]
        sub = u.reshape(2, m) @ _subset_matrix(m)                 # every subset sum of either half
        total = sub[0, -1] + sub[1, -1]
        if total < 2.0 ** 1000:                                   # no sum can overflow
            lo, hi = _half_masks(m)
            a = sub[0].take(lo) + sub[1].take(hi)                  # ~ bin 0's load
            np.maximum(a, total - a, out=a)
            p = np.flatnonzero(a <= a.min() + _FILTER_TOL * total)
            pmax = _row_sums(u[P[p]]).max(axis=1)
            best = pmax.min()
            p = p[pmax == best][:limit]
            return best, np.zeros(len(p), dtype=np.int64), p
    pmax = _partition_max(U, groups, m)
    best = pmax.min()
    r, p = np.nonzero(pmax == best)
    return best, r[:limit], p[:limit]


def _subset_matrix(m: int) -> np.ndarray:
    """float64 [m, 2**m]: column s holds the bits of s (row b: bit b)."""
    return read_only(((np.arange(2 ** m) >> np.arange(m)[:, None]) & 1).astype(np.float64))


_subset_matrix = functools.lru_cache(maxsize=None)(_subset_matrix)


def _half_masks(m: int):
    """Bin 0 of every partition of `_partitions(2, m)` as two bitmasks (int64 [P] each): its members
    below m, and its members from m on, shifted down by m."""
    bits = (1 << _partitions(2, m)[:, 0, :]).sum(axis=1)
    return read_only(bits & ((1 << m) - 1)), read_only(bits >> m)


_half_masks = functools.lru_cache(maxsize=None)(_half_masks)


def _exact_max(rows) -> float:
    """Max over groups of the correctly rounded sum of the group's costs."""
    return max(math.fsum(r) for r in rows)


def _sums_are_exact(c: np.ndarray) -> bool:
    """True when every sum of these costs is exact in float64 (all multiples of 2**-20, total below
    2**32): then float comparisons of loads are exact comparisons. Integer costs qualify."""
    if not c.max() * len(c) < 2.0 ** 32:
        return False
    scaled = c * 2.0 ** 20
    return bool((scaled == np.floor(scaled)).all())


def _lpt_run(c: np.ndarray, groups: int, visit: np.ndarray, above: float = math.inf):
    """Equal-count LPT exactly as `lpt` (same visiting order, same float additions): its max group
    load and the group of every sample in visiting order. On many groups by rounds of array
    operations (`_greedy_rounds`), else through a heap (`_lpt_heap`): the same result. `above`: on
    few groups the heap stops at the first load above it (see `_lpt_max`), the groups then partial."""
    if groups < _ROUNDS_MIN_G:
        return _lpt_heap(c, groups, visit, above)
    load = np.zeros(groups)
    grp = _greedy_rounds(c[visit], load, np.full(groups, len(c) // groups), 0.0)
    return float(load.max()), grp


def _lpt_heap(c: np.ndarray, groups: int, visit: np.ndarray, above: float = math.inf):
    """`_lpt_run` one sample at a time through a heap (`_greedy` with its room kept in the heap
    entries: the fastest loop on few groups), stopping at the first load above `above`. When the G
    largest costs are positive they go to groups 0..G-1 in order (every load is 0 until then, ties
    by group index), so that first round is set up directly."""
    cap = len(c) // groups
    xs = c[visit].tolist()
    if xs[0] > above:
        return xs[0], []
    if cap > 1 and xs[groups - 1] > 0:
        heap = [(xs[j], j, 2) for j in range(groups)]     # (load, group, count after the next one)
        heapq.heapify(heap)
        xs = xs[groups:]
        assigned = list(range(groups))
    else:
        heap = [(0.0, j, 1) for j in range(groups)]
        assigned = []
    top = -math.inf
    push, replace, pop = assigned.append, heapq.heapreplace, heapq.heappop
    for x in xs:
        load, j, k = heap[0]
        push(j)
        load += x
        if load > above:
            return load, assigned      # loads only grow: LPT's max is at least this one
        if k < cap:
            replace(heap, (load, j, k + 1))
        else:
            pop(heap)
            if load > top:
                top = load
    return top, assigned


def _greedy(xs: np.ndarray, load: np.ndarray, room: np.ndarray, shift: float) -> np.ndarray:
    """List scheduling with room: xs in order, each to the group with room left of lowest (load,
    group index), whose load becomes (load + x) - shift and room one less (LPT: xs descending, room
    B/G, shift 0). Returns the group of every x (int64); `load` and `room` are updated in place
    (with shift 0 the loads are then the final group loads). One x at a time through a heap on
    few groups; on many, by rounds of array operations with the same result (`_greedy_rounds`)."""
    if np.count_nonzero(room) < _ROUNDS_MIN_G:
        return _greedy_heap(xs, 0, len(xs), load, room, shift)
    return _greedy_rounds(xs, load, room, shift)


def _greedy_rounds(xs, load, room, shift):
    """`_greedy` by rounds: the groups with room, sorted by (load, group), take the next xs, one
    each, as long as that is what the heap would do: x_i goes to the i-th group while no group that
    took one of the xs before it (and has room left) has a new load at or below the i-th group's
    (the heap takes the lowest (load, group); a tie stops the round). A short round hands the next
    G xs to the heap. With shift 0, zeros at the end (xs descending) fill the groups with room, the
    least loaded first, each to its room: a zero leaves its group the least loaded."""
    n, G = len(xs), len(load)
    end = n - int(np.searchsorted(xs[::-1], 0.0, side="right")) if shift == 0.0 and n and xs[-1] == 0 else n
    grp = np.empty(n, dtype=np.int64)
    t = 0
    while t < end:
        open_ = np.flatnonzero(room)
        take = open_[np.lexsort((open_, load[open_]))][:end - t]
        new = (load[take] + xs[t:t + len(take)]) - shift
        stays = room[take] > 1
        lowest = np.minimum.accumulate(np.where(stays, new, math.inf))  # of the takers with room left
        late = np.flatnonzero(load[take[1:]] >= lowest[:-1])
        r = int(late[0]) + 1 if len(late) else len(take)
        load[take[:r]] = new[:r]
        room[take[:r]] -= 1
        grp[t:t + r] = take[:r]
        t += r
        if r < G // _SHORT_ROUND and t < end:
            grp[t:min(end, t + G)] = _greedy_heap(xs, t, min(end, t + G), load, room, shift)
            t = min(end, t + G)
    if t < n:
        open_ = np.flatnonzero(room)
        order = open_[np.lexsort((open_, load[open_]))]
        grp[t:] = np.repeat(order, room[order])
        room[order] = 0
    return grp


def _greedy_heap(xs, t: int, end: int, load, room, shift: float) -> np.ndarray:
    """`_greedy` of xs[t:end] one at a time through a heap of (load, group)."""
    L, R = load.tolist(), room.tolist()
    heap = [(L[j], j) for j in range(len(L)) if R[j]]
    heapq.heapify(heap)
    took = []
    push, replace, pop = took.append, heapq.heapreplace, heapq.heappop
    for x in xs[t:end].tolist():
        lo, j = heap[0]
        push(j)
        R[j] -= 1
        if R[j]:
            replace(heap, ((lo + x) - shift, j))
        else:
            pop(heap)
            L[j] = (lo + x) - shift
    for lo, j in heap:
        L[j] = lo
    load[:], room[:] = L, R
    return np.array(took, dtype=np.int64)


def _lpt_max(c: np.ndarray, groups: int, visit: np.ndarray, above: float = math.inf) -> float:
    """Max group load of equal-count LPT, exactly as `lpt` computes it, when that is at most `above`;
    else a load above `above` that LPT reaches (a lower bound of its max: enough to know that a plan
    at or below `above` is not worse, without running LPT to the end)."""
    return _lpt_run(c, groups, visit, above)[0]


def _lpt_members(c: np.ndarray, groups: int) -> np.ndarray:
    """LPT's partition as int64 [G, m] (row j: group j's samples, ascending)."""
    visit = np.argsort(-c, kind="stable")
    grp = np.empty(len(c), dtype=np.int64)
    grp[visit] = _lpt_run(c, groups, visit)[1]
    return np.argsort(grp, kind="stable").reshape(groups, -1)


def _cheap_lower_bound(s: np.ndarray, groups: int, m: int) -> float:
    """Lower bound on the optimal max load from costs sorted descending (O(B)): the mean load; for
    every k < m, some group holds k+1 of the k*G+1 largest costs plus m-k-1 others; for m == 2 the
    exact optimum (largest paired with smallest)."""
    if len(s) <= 128:      # the same float operations in plain Python: faster on few costs
        x = s.tolist()
        asc = [0.0, *itertools.accumulate(reversed(x))]
        best = asc[-1] / groups
        if m == 2:
            return max(best, max(map(operator.add, x[:groups], reversed(x[groups:]))))
        pre = [0.0, *itertools.accumulate(x)]
        return max(best, max([pre[k * groups + 1] - pre[k * groups - k] + asc[m - 1 - k] for k in range(m)]))
    asc = np.concatenate(([0.0], np.cumsum(s[::-1])))
    best = asc[-1] / groups
    if m == 2:
        return max(best, float((s[:groups] + s[::-1][:groups]).max()))
    pre = np.concatenate(([0.0], np.cumsum(s)))
    k = np.arange(m)
    v = pre[k * groups + 1] - pre[k * groups - k] + asc[m - 1 - k]
    return max(best, float(v.max()))


def quick_lower_bound(costs, groups: int) -> float:
    """A proven lower bound on the minimal max group load in O(B log B) (`lower_bound` is tighter
    and O(B*G))."""
    c = check_costs(costs, groups)
    m = len(c) // groups
    s = np.sort(c)[::-1]
    return float(s[0]) if m == 1 else _cheap_lower_bound(s, groups, m)


def lower_bound(costs, groups: int) -> float:
    """A proven lower bound on the minimal max group load under equal counts (for tests/benchmarks).

    Max of: mean load; the largest cost plus the m-1 smallest (and its generalisation: r groups
    together hold at least r(k+1) of the k*G+r largest costs); the t largest costs spread over u
    groups with u*m slots, u <= min(t, G), the free slots holding at least the smallest costs; for
    m == 2 the exact optimum. O(B*G) time and memory.
    """
    c = check_costs(costs, groups)
    n, G = len(c), groups
    m = n // G
    s = np.sort(c)[::-1]
    if m == 1:
        return float(s[0])
    best = _cheap_lower_bound(s, G, m)
    if m == 2:
        return best
    pre = np.concatenate(([0.0], np.cumsum(s)))
    asc = np.concatenate(([0.0], np.cumsum(s[::-1])))
    for k in range(m):
        r = np.arange(1, G + 1)
        size = k * G + r
        r, size = r[size <= n], size[size <= n]
        top = pre[size] - pre[size - r * (k + 1)]
        best = max(best, float(((top + asc[r * (m - k - 1)]) / r).max()))
    t = np.arange(1, n + 1)[:, None]
    u = np.arange(1, G + 1)[None, :]
    ok = (u <= t) & (u * m >= t)
    val = np.where(ok, (pre[t] + asc[np.clip(u * m - t, 0, n)]) / u, np.inf)
    return max(best, float(val.min(axis=1).max()))


def _coarse(M, C, L, theta):
    """Evict and refill: each group above `theta` keeps its largest cost and evicts its next largest
    ones until it would sit at `theta` (counting the small costs it will receive back); groups below
    evict their smallest costs, as many in total, in proportion to their room; the evicted samples are
    refilled into the vacated slots by LPT. Moves only the evicted samples. Returns new (M, C)."""
    out = _evictions(C, L, theta)
    return (M, C) if out is None else _refill(M, C, out)


def _evictions(C, L, theta):
    """bool [G, m]: the slots `_coarse` vacates, or None when it moves nothing."""
    G, m = C.shape
    order = np.argsort(-C, axis=1, kind="stable")
    order += np.arange(0, G * m, m)[:, None]        # flat positions, row by row
    Cs = C.ravel()[order]
    excess = L - theta
    heavy = excess > 0
    light = ~heavy
    if not heavy.any() or not light.any():
        return None
    smallest = np.sort(Cs[light, -1])
    incoming = float(smallest[len(smallest) // 2])
    shed = np.cumsum(Cs[:, 1:] - incoming, axis=1)
    E = np.where(heavy, np.minimum((shed < excess[:, None]).sum(axis=1) + 1, m - 1), 0)
    total = int(E.sum())
    room = np.where(light, -excess, 0.0)
    if total == 0 or not room.sum() > 0:
        return None
    share = total * room / np.cumsum(room)[-1]
    F = np.floor(share).astype(np.int64)
    rest = total - int(F.sum())
    if rest > 0:
        F[np.argsort(F - share, kind="stable")[:rest]] += 1         # largest remainders, ties by index
    F = np.minimum(F, m - 1)
    col = np.arange(m)[None, :]
    out_sorted = np.where(heavy[:, None], (col >= 1) & (col <= E[:, None]), col >= m - F[:, None])
    out = np.zeros((G, m), dtype=bool)
    out.ravel()[order] = out_sorted
    return out


def _refill(M, C, out):
    """New (M, C) with the samples of the vacated slots `out` put back into them by LPT on expected
    final loads: every slot of a group beyond its next one counts as the mean of the smallest
    evicted costs (those fill such slots), so a group with many vacancies (one huge sample kept)
    takes the small samples, last."""
    G = M.shape[0]
    gi, pi = np.nonzero(out)                       # vacated slots, grouped by group (row-major)
    items, ic = M[gi, pi], C[gi, pi]
    pinned = _row_sums(np.where(out, 0.0, C))
    vacant = np.bincount(gi, minlength=G)
    extra = len(ic) - np.count_nonzero(vacant)
    avg = float(np.cumsum(np.sort(ic)[:extra])[-1] / extra) if extra > 0 else 0.0
    visit = np.argsort(-ic, kind="stable")                    # ties by slot, row by row
    dst = _greedy(ic[visit], np.where(vacant > 0, pinned + (vacant - 1) * avg, 0.0), vacant, avg)
    # the vacated slots (gi, pi) are grouped by group: fill them in the same grouping
    fill = visit[np.argsort(dst, kind="stable")]
    M, C = M.copy(), C.copy()
    M[gi, pi] = items[fill]
    C[gi, pi] = ic[fill]
    return M, C


def _swap(M, C, h, a, q, b):
    M[h, a], M[q, b] = M[q, b], M[h, a]
    C[h, a], C[q, b] = C[q, b], C[h, a]


def _pair_rounds(M, C, L, target, rounds):
    """Pair the groups above `target` (heaviest first, at most G/2) with the lightest ones; in every
    pair do the one swap that best evens the two (cost difference nearest half the load gap, strictly
    inside (0, gap) so the pair's max strictly drops). All pairs at once."""
    G, m = M.shape
    for _ in range(rounds):
        order = np.argsort(L, kind="stable")
        P = min(int(np.count_nonzero(L > target)), G // 2)
        if P == 0:
            return
        hv, lt = order[::-1][:P], order[:P]
        gap = L[hv] - L[lt]
        Ch, Cl = C[hv], C[lt]
        d = (Ch[:, :, None] - Cl[:, None, :]).reshape(P, m * m)
        d -= (0.5 * gap)[:, None]
        f = np.abs(d, out=d).argmin(axis=1)
        a, b = np.divmod(f, m)
        ar = np.arange(P)
        db = Ch[ar, a] - Cl[ar, b]
        good = (db > 0) & (db < gap)
        if not good.any():
            return
        hv, lt, a, b = hv[good], lt[good], a[good], b[good]
        t = M[hv, a]
        M[hv, a] = M[lt, b]
        M[lt, b] = t
        t = C[hv, a]
        C[hv, a] = C[lt, b]
        C[lt, b] = t
        both = np.concatenate((hv, lt))
        L[both] = _row_sums(C[both])


def _batched_rounds(M, C, L, target, rounds, work):
    """Each round the P heaviest groups each make their best swap (lowest resulting pair max) with a
    distinct one of the K lightest groups; heavier groups choose first."""
    G, m = M.shape
    mm = m * m
    pk = max(1, work // mm)
    K = min(G - 1, max(1, int(2 * math.sqrt(pk))))
    P = max(1, min(pk // K, G - K))
    for _ in range(rounds):
        order = np.argsort(L, kind="stable")
        hv, lt = order[::-1][:P], order[:K]
        if L[hv[0]] <= target:
            return
        Lh = L[hv]
        d = C[hv][:, None, :, None] - C[lt][None, :, None, :]
        pair_max = np.maximum(Lh[:, None, None, None] - d, L[lt][None, :, None, None] + d).reshape(P, K, mm)
        f = pair_max.argmin(axis=2)
        best = np.take_along_axis(pair_max, f[:, :, None], axis=2)[:, :, 0]
        ok = best < Lh[:, None]
        if not ok[0].any():
            return      # the heaviest group cannot improve here: the max load would not drop
        score = np.where(ok, best, np.inf).tolist()
        fl = f.tolist()
        hvl, ltl = hv.tolist(), lt.tolist()     # disjoint: P <= G - K
        used = set()
        for p in range(P):
            h = hvl[p]
            row = score[p]
            k = min((k for k in range(K) if row[k] != math.inf and ltl[k] not in used),
                    key=row.__getitem__, default=None)
            if k is None:
                continue
            used.add(ltl[k])
            used.add(h)
            a, b = divmod(fl[p][k], m)
            _swap(M, C, h, a, ltl[k], b)
        if not used:
            return
        L[:] = _row_sums(C)


def _local_search(M, C, L, target, iters, K):
    """Steepest single swaps between the heaviest group and the K lightest groups: the swap with the
    lowest resulting pair max, strictly below the heaviest load; among equal ones the one that moves
    fewest samples away from home. Returns (iterations used, stuck)."""
    G, m = M.shape
    for it in range(iters):
        order = np.argsort(L, kind="stable")
        h = int(order[-1])
        Lh = L[h]
        if Lh <= target:
            return it, False
        part = order[:K]
        d = C[h][:, None, None] - C[part][None, :, :]
        pair_max = np.maximum(Lh - d, L[part][None, :, None] + d)
        best = pair_max.min()
        if not best < Lh:
            return it, True
        cand = pair_max == best
        if np.count_nonzero(cand) > 1:
            home_h, home_k = M[h] // m, M[part] // m
            away = ((home_h[:, None] != part[None, :]).astype(np.int8) - (home_h != h)[:, None])[:, :, None] \
                + ((home_k != h).astype(np.int8) - (home_k != part[:, None]))[None]
            f = int(np.argmin(np.where(cand, away, 9)))
        else:
            f = int(np.argmax(cand))
        a, f = divmod(f, len(part) * m)
        q, b = int(part[f // m]), f % m
        _swap(M, C, h, a, q, b)
        L[[h, q]] = _row_sums(C[[h, q]])
    return iters, False


def _gather(M, C, L):
    """The heaviest group trades its costs, largest first, for the smallest costs held anywhere else,
    as long as the receiving group stays below the heaviest group's new load (fixes a group holding
    one huge sample, which must end up with the smallest samples). Returns the number of swaps."""
    G, m = M.shape
    h = int(np.argmax(L))
    flat = C.ravel()
    o = np.argsort(flat, kind="stable")
    o = o[o // m != h][: 4 * m]
    oc, og, op = flat[o].tolist(), (o // m).tolist(), (o % m).tolist()
    loads = L.tolist()
    Lh = loads[h]
    used = [False] * len(oc)
    n = 0
    for a in np.argsort(-C[h], kind="stable").tolist():
        x = float(C[h, a])
        for t, y in enumerate(oc):
            if y >= x:
                break
            if used[t]:
                continue
            q, d = og[t], x - y
            if loads[q] + d < Lh - d:
                used[t] = True
                _swap(M, C, h, a, q, op[t])
                Lh -= d
                loads[q] += d
                n += 1
                break
    L[:] = _row_sums(C)
    return n


def _resplit(M, C, L, k, budget):
    """Best re-split of the heaviest group together with k-1 others (k == 2: any other group; k == 3:
    two of the four lightest): every equal-count partition of their k*m samples (`_partitions`), the
    lowest max, then the labelling that keeps most samples home. Applied only if it lowers the
    heaviest load; skipped when it would exceed the remaining `budget` of partitions. Small m only."""
    G, m = M.shape
    if G < k:
        return False
    order = np.argsort(L, kind="stable")
    h = int(order[-1])
    pool = order[:-1] if k == 2 else order[:min(G - 1, _RESPLIT_PARTNERS)]   # any partner; pairs of the lightest
    combos = np.array([(h,) + t for t in itertools.combinations(pool.tolist(), k - 1)])
    P = _partitions(k, m)
    if len(combos) * len(P) > budget[0]:
        return False
    budget[0] -= len(combos) * len(P)
    U = C[combos].reshape(len(combos), k * m)
    best, ti, pi = _best_partitions(U, k, m, _RESPLIT_CANDIDATES)
    if not best < L[h]:
        return False
    ids = M[combos].reshape(len(combos), k * m)
    perms = _permutations(k)                                                  # bin b -> combos[t, perm[b]]
    home = ids[ti[:, None, None], P[pi]] // m                                 # [cand, bin, m]
    dest = combos[ti][:, perms]                                               # [cand, perm, bin]
    kept = (home[:, None, :, :] == dest[..., None]).sum(axis=(2, 3))          # [cand, perm]
    f = int(np.argmax(kept))
    r, q = divmod(f, len(perms))
    t, part, g = ti[r], P[pi[r]], dest[r, q]                                  # bin b -> group g[b]
    M[g] = ids[t][part]
    C[g] = rows = U[t][part]
    L[g] = _row_sums(rows)
    return True


def _improve(M, C, L, target, iters, K):
    """Local search; when it is stuck, a gather move, else a re-split of the heaviest group with one
    other (m <= 4, or m <= 8 when G == 2: then exact) or with two others (m <= 4), then search on,
    within `iters` steps and `_RESPLIT_WORK` partitions evaluated by re-splits."""
    G, m = M.shape
    used = 0
    budget = [_RESPLIT_WORK]
    while used < iters:
        it, stuck = _local_search(M, C, L, target, iters - used, K)
        used += it + 1
        if not stuck:
            return
        if _gather(M, C, L):
            continue
        if m <= _RESPLIT_M and _resplit(M, C, L, 2, budget):
            continue
        if not (m <= _RESPLIT_M and _resplit(M, C, L, 3, budget)):
            return


def _permutations(k: int) -> np.ndarray:
    return read_only(np.array(list(itertools.permutations(range(k)))))


_permutations = functools.lru_cache(maxsize=None)(_permutations)


def _partitions(groups: int, m: int) -> np.ndarray:
    """Every split of range(G*m) into G unlabelled groups of m: int64 [P, G, m] (15400 for 4 x 3)."""
    n = groups * m
    if groups == 2:
        first = np.array([(0,) + t for t in itertools.combinations(range(1, n), m - 1)], dtype=np.int64)
        mask = np.ones((len(first), n), dtype=bool)
        mask[np.arange(len(first))[:, None], first] = False
        return read_only(np.stack([first, np.nonzero(mask)[1].reshape(len(first), m)], axis=1))
    out = []

    def rec(rest, chosen):
        if not rest:
            out.append(chosen)
            return
        first, tail = rest[0], rest[1:]
        for comb in itertools.combinations(tail, m - 1):
            rec(tuple(x for x in tail if x not in comb), chosen + ((first,) + comb,))

    rec(tuple(range(n)), ())
    return read_only(np.array(out, dtype=np.int64))


_partitions = functools.lru_cache(maxsize=None)(_partitions)


def _exhaustive(c, groups, m):
    """Optimal partition by enumeration (B <= 10): lowest max load; among those, the most samples
    that can stay home (per bin, its largest same-home count). Returns (max load, int64 [G, m])."""
    P = _partitions(groups, m)
    pmax = _partition_max(c, groups, m)
    best = pmax.min()
    tied = np.flatnonzero(pmax == best)
    same_home = (P[tied][..., None] // m == np.arange(groups)).sum(axis=2)      # [t, bin, home]
    pick = tied[int(np.argmax(same_home.max(axis=2).sum(axis=1)))]
    return float(best), P[pick].copy()


def _relabel(M, m):
    """Give every bin of a partition the group label it overlaps most (greedy by overlap, ties by
    index): the same loads, fewer moved samples."""
    G = M.shape[0]
    overlap = np.bincount(np.repeat(np.arange(G), m) * G + (M // m).ravel(), minlength=G * G)
    nz = np.flatnonzero(overlap)
    nz = nz[np.lexsort((nz, -overlap[nz]))]
    label = [-1] * G
    taken = [False] * G
    for f in nz.tolist():
        b, g = divmod(f, G)
        if label[b] < 0 and not taken[g]:
            label[b] = g
            taken[g] = True
    free = [g for g in range(G) if not taken[g]]
    for b in range(G):
        if label[b] < 0:
            label[b] = free.pop(0)
    out = np.empty_like(M)
    out[np.array(label)] = M
    return out


def _return_home(M, C, L, cap, rounds):
    """Swaps that bring moved samples back to their natural group (net fewer moved samples) while
    every load stays <= cap. Each round: per moved sample its best partner in its home group; the
    candidates, most saving first, are kept when they are the first to touch both their groups
    (so the kept swaps are disjoint and all computed loads stay valid); all applied at once."""
    G, m = M.shape
    home_row = np.repeat(np.arange(G), m)
    for _ in range(rounds):
        flat = M.ravel()
        mv = np.flatnonzero(flat // m != home_row)
        if len(mv) == 0:
            return
        a = mv // m
        p = mv - a * m
        q = flat[mv] // m
        ci = C.ravel()[mv][:, None]
        ck = C[q]
        fits = (L[a][:, None] - ci + ck <= cap) & (L[q][:, None] + ci - ck <= cap)
        kh = M[q] // m
        gain = (kh != a[:, None]).astype(np.int64) - 1 - (kh != q[:, None])   # change in moved count
        key = np.where(fits, gain, 1)
        b = key.argmin(axis=1)
        kb = key[np.arange(len(mv)), b]
        cand = np.flatnonzero(kb < 0)
        if len(cand) == 0:
            return
        cand = cand[np.argsort(kb[cand], kind="stable")]
        ga, gq = a[cand], q[cand]
        idx = np.arange(len(cand))
        first = np.full(G, len(cand))
        np.minimum.at(first, ga, idx)
        np.minimum.at(first, gq, idx)
        r = cand[(first[ga] == idx) & (first[gq] == idx)]
        ia, ib = (a[r], p[r]), (q[r], b[r])
        t = M[ia]
        M[ia] = M[ib]
        M[ib] = t
        t = C[ia]
        C[ia] = C[ib]
        C[ib] = t
        L[:] = _row_sums(C)


def balanced(costs: np.ndarray, groups: int) -> np.ndarray:
    """Movement-aware equal-count balancing; the recommended balancer.

    Guarantees, on any input: a permutation with exactly B/G samples per group; a max group load
    (group load = correctly rounded sum of its costs, `math.fsum`) never above LPT's; deterministic
    (ties by index, fixed iteration bounds, order-fixed float sums, so every rank computes the same
    plan); if the natural assignment already reaches the proven lower bound, nothing moves.

    Plan, starting from the natural assignment (sample i in group i // (B/G)):
    1. large batches (B >= 256): evict the surplus of overloaded groups and refill by LPT (`_coarse`);
    2. pair rounds: heaviest groups swap with the lightest, all pairs at once;
    3. swap local search on the heaviest group: against every group on small instances (G*m*m <= 1024),
       batched heaviest-vs-lightest rounds then a few single swaps on large ones; when stuck, a
       "gather" move (the heaviest group trades for the smallest samples) or, for m <= 4, a re-split
       of 2-3 groups (every partition of their samples). Search stops at (1 + 5e-4) x a proven
       lower bound;
    4. LPT: on small instances a second start from LPT's partition (relabelled to overlap the natural
       groups most); on any instance, if the search ended above LPT's max load, LPT's partition plus
       search replaces it. Only a strictly lower max load beats the natural start (fewer moves);
    5. B <= 10: every equal-count partition is enumerated; if the search missed the optimum, the
       optimal partition (relabelled) replaces it, so the max load there is always the optimum;
    6. swaps that send moved samples back home without raising the max load;
    7. guard: if the result's exact max load exceeds LPT's, LPT's partition (relabelled) is returned.

    Canonical order: groups in order, members of a group in ascending natural index. So a sample that
    stays in its group keeps its relative order, and a rank whose samples all stay holds them exactly
    as before (the order does not depend on how the search visited them).
    """
    c = check_costs(costs, groups)
    n, G = len(c), int(groups)
    m = n // G
    if G == 1 or m == 1:
        return np.arange(n, dtype=np.int64)     # every plan has the same max load: move nothing
    visit = np.argsort(-c, kind="stable")       # (-cost, index), LPT's visiting order
    lb = _cheap_lower_bound(c[visit], G, m)
    M = np.arange(n, dtype=np.int64).reshape(G, m)
    C = c.reshape(G, m).copy()
    L = _row_sums(C)
    # LPT's max load is only compared with plans at or below the one it is computed against, so
    # it runs until a load passes that plan's max (LPT's max is then above it: exactly what matters)
    if G == 2 and m <= _TWO_GROUP_EXACT_M:
        # two groups: one re-split tries every partition, so it is the optimum (and, among optimal
        # partitions, keeps the most samples home); no other phase can improve on it
        if L.max() > lb * (1 + _EXACT_MARGIN):
            _resplit(M, C, L, 2, [math.inf])
        lpt_max = _lpt_max(c, G, visit, above=L.max())
    elif L.max() > lb * (1 + _EXACT_MARGIN):        # else the natural plan is optimal: keep it
        M, C, L, lpt_max = _search(c, M, C, L, lb, visit)
    else:
        lpt_max = _lpt_max(c, G, visit, above=L.max())
    if _worse_than_lpt(c, C, L.max(), lpt_max, G):
        M = _relabel(_lpt_members(c, G), m)
    return np.sort(M, axis=1).reshape(-1)


def _search(c, M, C, L, lb, visit):
    """Steps 1-6 of `balanced` from the natural partition (M, C, L: members, costs, loads), which
    is above the lower bound `lb`: the best partition found, as new (M, C, L), and LPT's max load
    computed against the first search's (`_lpt_max` above it; the partition returned is not above
    that search's max)."""
    G, m = M.shape
    n = G * m
    target = lb * (1 + _TOL)
    small = G * m * m <= _SMALL
    K = G - 1 if small else max(1, min(G - 1, _POLISH_WORK // (m * m)))
    iters = _SMALL_ITERS if small else _POLISH_ITERS
    if n >= _COARSE_MIN:
        M, C = _coarse(M, C, L, lb)
        L = _row_sums(C)
    _pair_rounds(M, C, L, target, _PAIR_ROUNDS)
    if not small:
        _batched_rounds(M, C, L, target, _BATCH_ROUNDS, _BATCH_WORK)
    _improve(M, C, L, target, iters, K)
    best = L.max()
    lpt_max = _lpt_max(c, G, visit, above=best)
    if small or best > lpt_max:
        A = _lpt_members(c, G)
        CA = c[A]
        LA = _row_sums(CA)
        _improve(A, CA, LA, target, iters, K)
        if LA.max() < best * (1 - _EXACT_MARGIN) or best > lpt_max:
            M, C, L, best = _adopt(c, A)
    if n <= _EXHAUSTIVE_B:
        opt, X = _exhaustive(c, G, m)
        if best > opt * (1 + _EXACT_MARGIN):
            M, C, L, best = _adopt(c, X)
    _return_home(M, C, L, best, _HOME_ROUNDS if small else _HOME_ROUNDS_LARGE if n < _HOME_MAX_B else 0)
    return M, C, L, lpt_max


def _adopt(c, X):
    """Partition X [G, m] relabelled to overlap the natural groups most: (M, C, L, max load)."""
    M = _relabel(X, X.shape[1])
    C = c[M]
    L = _row_sums(C)
    return M, C, L, L.max()


def _worse_than_lpt(c, C, mine, lpt_max, groups) -> bool:
    """The guard of `balanced`: partition costs C (max load `mine`) above LPT's exact max load."""
    if _sums_are_exact(c):
        return mine > lpt_max                         # every float sum above is exact
    return not mine < lpt_max * (1 - _EXACT_MARGIN) and \
        _exact_max(C.tolist()) > _exact_max(c[_lpt_members(c, groups)].tolist())


# --------------------------------------------------------------------------------------------------
# Exact solver (tests and benchmarks).
# --------------------------------------------------------------------------------------------------

def exact(costs: np.ndarray, groups: int, *, fewest_moves: bool = True,
          time_limit: float | None = None) -> np.ndarray:
    """The optimal plan: minimal max group load under equal counts, then (fewest_moves) the fewest
    samples away from their natural group. Same contract and canonical order as `balanced`.

    Two MILPs (`_AssignmentMilp`) solved by scipy.optimize.milp (HiGHS); scipy is imported on the
    call because it is not a core dependency (pip install scipy). Stage 1 breaks the symmetry between
    groups (the r-th largest cost may only go to groups 0..r) and is bounded by LPT's max load;
    stage 2 keeps every load within 1e-9 (relative) of stage 1's optimum and maximises samples kept
    home. For small instances:
    B <= 16 usually takes well under a second, stage 2 is the harder one, and some B ~ 32-256
    instances take minutes. Raises TimeoutError when `time_limit` (seconds, per stage) stops a stage
    before optimality is proven.
    """
    c = check_costs(costs, groups)
    n, G = len(c), int(groups)
    m = n // G
    if G == 1 or m == 1:
        return np.arange(n, dtype=np.int64)
    visit = np.argsort(-c, kind="stable")
    rank = np.empty(n, dtype=np.int64)
    rank[visit] = np.arange(n)
    milp = _AssignmentMilp(c, G, time_limit)
    grp = milp.min_max_load(rank, _lpt_max(c, G, visit))
    if fewest_moves:
        grp = milp.fewest_moves(_exact_max([c[grp == j].tolist() for j in range(G)]))
    return np.lexsort((np.arange(n), grp)).astype(np.int64)


class _AssignmentMilp:
    """The two MILPs of `exact` over variables x[i*G + j] (sample i in group j), then T: every
    sample in one group, B/G samples per group, every group's load at most T (stage 1) or at most
    a fixed cap (stage 2). scipy is imported here: it is not a core dependency."""

    def __init__(self, c: np.ndarray, groups: int, time_limit: float | None):
        from scipy.optimize import LinearConstraint
        from scipy.sparse import coo_matrix

        n, G = len(c), groups
        self.n, self.G, self.m, self.nv, self.time_limit = n, G, n // G, n * G + 1, time_limit
        nv = self.nv
        self.i_idx = i_idx = np.repeat(np.arange(n), G)
        self.j_idx = j_idx = np.tile(np.arange(G), n)
        self.var = var = i_idx * G + j_idx
        self.one_group = LinearConstraint(coo_matrix((np.ones(n * G), (i_idx, var)), shape=(n, nv)), 1, 1)
        self.count = LinearConstraint(coo_matrix((np.ones(n * G), (j_idx, var)), shape=(G, nv)), self.m, self.m)
        self.load = coo_matrix((np.concatenate([c[i_idx], -np.ones(G)]),
                                (np.concatenate([j_idx, np.arange(G)]), np.concatenate([var, np.full(G, n * G)]))),
                               shape=(G, nv))

    def min_max_load(self, rank: np.ndarray, lpt_max: float) -> np.ndarray:
        """Stage 1: minimal max load, with the r-th largest cost (`rank`) only in groups 0..r
        (symmetry breaking) and T bounded by LPT's max load. The group of every sample."""
        lo, hi = np.zeros(self.nv), np.ones(self.nv)
        hi[:-1][self.j_idx > rank[self.i_idx]] = 0
        hi[-1] = lpt_max * (1 + 1e-6) + 1e-6             # loose: HiGHS rejects very tight windows
        objective = np.zeros(self.nv)
        objective[-1] = 1.0
        return self._solve(objective, lo, hi, 0, "min max load")

    def fewest_moves(self, best: float) -> np.ndarray:
        """Stage 2: every load within 1e-9 (relative) of `best`, most samples kept home."""
        lo, hi = np.zeros(self.nv), np.ones(self.nv)
        hi[-1] = lo[-1] = 0.0
        cap = best + 1e-9 * max(1.0, abs(best))
        objective = np.zeros(self.nv)
        objective[self.var[self.j_idx == self.i_idx // self.m]] = -1.0     # maximise samples kept home
        return self._solve(objective, lo, hi, cap, "fewest moves")

    def _solve(self, objective, lo, hi, load_cap, what) -> np.ndarray:
        from scipy.optimize import Bounds, LinearConstraint, milp

        integrality = np.ones(self.nv)
        integrality[-1] = 0
        options = {} if self.time_limit is None else {"time_limit": float(self.time_limit)}
        res = milp(objective, constraints=[self.one_group, self.count, LinearConstraint(self.load, -np.inf, load_cap)],
                   integrality=integrality, bounds=Bounds(lo, hi), options=options)
        if res.status != 0 or res.x is None:
            raise TimeoutError(f"exact: {what} not solved to optimality (status {res.status}: "
                               f"{res.message}); B={self.n}, G={self.G}, time_limit={self.time_limit}")
        return np.round(res.x[:-1]).reshape(self.n, self.G).argmax(axis=1)


BALANCERS = {"lpt": lpt, "identity": identity, "balanced": balanced}


def get_balancer(name: str):
    """Look a balancer up by name; the error lists the known names."""
    try:
        return BALANCERS[name]
    except KeyError:
        raise ValueError(f"balancer={name!r} is unknown; choose one of {sorted(BALANCERS)}") from None
