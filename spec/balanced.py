"""The "balanced" balancer step by step, in plain Python (lists, loops, heapq, itertools): the
reference that `reorder.plan.balancers.balanced` and each of its phases must match bit for bit.

Never imports `reorder` (nor numpy). Each function states one rule of the documented plan, one step
at a time, with the same float operations in the same order as the fast version (loads are
left-to-right sums), so the plans agree exactly; a rule is changed here and there together.

A plan in progress is (M, C, L): M[g] the samples of group g, C[g] their costs, L[g] the group's
load. Sample i's natural group is i // m. Sorting "stably" means ties keep index order.
"""

from __future__ import annotations

import heapq
import itertools
import math
from fractions import Fraction

TOL = 5e-4
SMALL = 1024
SMALL_ITERS = 64
COARSE_MIN = 256
PAIR_ROUNDS = 6
BATCH_ROUNDS = 8
BATCH_WORK = 8192
POLISH_ITERS = 8
POLISH_WORK = 2048
HOME_ROUNDS = 4
HOME_ROUNDS_LARGE = 1
HOME_MAX_B = 1024
RESPLIT_M = 4
RESPLIT_WORK = 12000
TWO_GROUP_EXACT_M = 8
EXHAUSTIVE_B = 10
EXACT_MARGIN = 1e-12


def row_sum(row):
    """((c0 + c1) + c2) + ...: the load of a group."""
    total = row[0]
    for x in row[1:]:
        total = total + x
    return total


def argsort(values):
    """Indices by value, ties by index."""
    return sorted(range(len(values)), key=lambda i: (values[i], i))


def first_min(values):
    best = min(values)
    return values.index(best)


def prefix(xs):
    out = [0.0]
    for x in xs:
        out.append(out[-1] + x)
    return out


def cheap_lower_bound(s, groups, m):
    """From costs sorted descending: the mean load; for m == 2 the pairing of largest with smallest;
    else for every k < m the k+1 smallest of the k*G+1 largest costs plus the m-k-1 smallest costs."""
    asc = prefix(list(reversed(s)))
    best = asc[-1] / groups
    if m == 2:
        return max(best, max(s[i] + s[2 * groups - 1 - i] for i in range(groups)))
    pre = prefix(s)
    return max(best, max(pre[k * groups + 1] - pre[k * groups - k] + asc[m - 1 - k] for k in range(m)))


def lpt_groups(c, groups):
    """Equal-count LPT: (the members of each group in insertion order, its float max load)."""
    m = len(c) // groups
    members, loads = [[] for _ in range(groups)], [0.0] * groups
    for i in sorted(range(len(c)), key=lambda i: (-c[i], i)):
        j = min((j for j in range(groups) if len(members[j]) < m), key=lambda j: (loads[j], j))
        members[j].append(i)
        loads[j] = loads[j] + c[i] if len(members[j]) > 1 else c[i]
    return members, max(loads)


def sums_are_exact(c):
    if not max(c) * len(c) < 2 ** 32:
        return False
    return all((Fraction(x) * 2 ** 20).denominator == 1 for x in c)


def exact_max(rows):
    return max(math.fsum(r) for r in rows)


# --- coarse: evict and refill -------------------------------------------------------------------------

def evictions(C, L, theta):
    """The slots the coarse step vacates (bool rows), or None when it moves nothing. A group above
    `theta` keeps its largest cost and evicts its next largest ones, one more than the number of them
    (counted in order of size) while the running sum of (cost - the median of the light groups'
    smallest costs) stays below its excess, at most m-1; the groups at or below `theta` evict their
    smallest costs, as many in total, shared in proportion to their room (largest remainders first,
    ties by group), at most m-1 each."""
    G, m = len(C), len(C[0])
    orders = [sorted(range(m), key=lambda p: (-row[p], p)) for row in C]
    excess = [L[g] - theta for g in range(G)]
    heavy = [e > 0 for e in excess]
    if not any(heavy) or all(heavy):
        return None
    smallest = sorted(C[g][orders[g][-1]] for g in range(G) if not heavy[g])
    incoming = smallest[len(smallest) // 2]
    E = []
    for g in range(G):
        if not heavy[g]:
            E.append(0)
            continue
        shed, below = 0.0, 0
        for p in orders[g][1:]:
            shed = shed + (C[g][p] - incoming)
            below += shed < excess[g]
        E.append(min(below + 1, m - 1))
    total = sum(E)
    room = [-excess[g] if not heavy[g] else 0.0 for g in range(G)]
    room_total = prefix(room)[-1]
    if total == 0 or not room_total > 0:
        return None
    share = [total * r / room_total for r in room]
    F = [math.floor(x) for x in share]
    rest = total - sum(F)
    if rest > 0:
        for g in sorted(range(G), key=lambda g: (F[g] - share[g], g))[:rest]:
            F[g] += 1
    F = [min(f, m - 1) for f in F]
    out = [[False] * m for _ in range(G)]
    for g in range(G):
        for rank, p in enumerate(orders[g]):
            out[g][p] = 1 <= rank <= E[g] if heavy[g] else rank >= m - F[g]
    return out


def refill(M, C, out):
    """The evicted samples back into the vacated slots by LPT on expected final loads: a group
    starts at the sum of what it kept plus, for every vacancy beyond its next one, the mean `avg` of
    the smallest evicted costs (as many as there are such vacancies); samples, largest first (ties by
    slot, row by row), go to the group of lowest (expected load, group), which then counts x - avg
    more; a group takes no more than its vacancies. Each group's vacated slots, in slot order, get its
    samples in the order they came."""
    G, m = len(M), len(M[0])
    slots = [(g, p) for g in range(G) for p in range(m) if out[g][p]]
    items = [M[g][p] for g, p in slots]
    ic = [C[g][p] for g, p in slots]
    pinned = [row_sum([0.0 if out[g][p] else C[g][p] for p in range(m)]) for g in range(G)]
    vacant = [sum(out[g]) for g in range(G)]
    open_groups = [g for g in range(G) if vacant[g]]
    extra = len(ic) - len(open_groups)
    avg = prefix(sorted(ic)[:extra])[-1] / extra if extra > 0 else 0.0
    heap = [(pinned[g] + (vacant[g] - 1) * avg, g) for g in open_groups]
    heapq.heapify(heap)
    left = list(vacant)
    visit = sorted(range(len(ic)), key=lambda i: (-ic[i], i))
    dst = []
    for i in visit:
        load, j = heap[0]
        dst.append(j)
        left[j] -= 1
        if left[j]:
            heapq.heapreplace(heap, (load + ic[i] - avg, j))
        else:
            heapq.heappop(heap)
    fill = [visit[k] for k in sorted(range(len(dst)), key=lambda k: (dst[k], k))]
    M, C = [list(r) for r in M], [list(r) for r in C]
    for (g, p), i in zip(slots, fill):
        M[g][p], C[g][p] = items[i], ic[i]
    return M, C


def coarse(M, C, L, theta):
    out = evictions(C, L, theta)
    return (M, C) if out is None else refill(M, C, out)


# --- swap phases ------------------------------------------------------------------------------------

def swap(M, C, h, a, q, b):
    M[h][a], M[q][b] = M[q][b], M[h][a]
    C[h][a], C[q][b] = C[q][b], C[h][a]


def pair_rounds(M, C, L, target, rounds):
    """Per round: the P groups above `target` (at most G/2), heaviest first, pair with the P
    lightest; in each pair the swap (a, b) whose cost difference is nearest half the load gap (first
    in a-major order), made when that difference lies strictly inside (0, gap); all at once."""
    G, m = len(M), len(M[0])
    for _ in range(rounds):
        order = argsort(L)
        P = min(sum(x > target for x in L), G // 2)
        if P == 0:
            return
        hv, lt = order[::-1][:P], order[:P]
        moves = []
        for h, l in zip(hv, lt):
            gap = L[h] - L[l]
            dist = [abs(C[h][a] - C[l][b] - 0.5 * gap) for a in range(m) for b in range(m)]
            a, b = divmod(first_min(dist), m)
            db = C[h][a] - C[l][b]
            if db > 0 and db < gap:
                moves.append((h, a, l, b))
        if not moves:
            return
        for h, a, l, b in moves:
            swap(M, C, h, a, l, b)
        for h, _, l, _ in moves:
            L[h], L[l] = row_sum(C[h]), row_sum(C[l])


def batched_rounds(M, C, L, target, rounds, work):
    """Per round: the P heaviest groups, heaviest first, each take a distinct one of the K lightest
    (pk = work // m**2 candidate pairs: K = min(G-1, 2*sqrt(pk)), P = min(pk // K, G-K)), the one
    whose best swap gives the lowest pair max, if it is below the heavy group's load; the round stops
    the search when the heaviest group finds none, or no swap is made."""
    G, m = len(M), len(M[0])
    pk = max(1, work // (m * m))
    K = min(G - 1, max(1, int(2 * math.sqrt(pk))))
    P = max(1, min(pk // K, G - K))
    for _ in range(rounds):
        order = argsort(L)
        hv, lt = order[::-1][:P], order[:K]
        if L[hv[0]] <= target:
            return
        best, at = [], []
        for h in hv:
            rb, ra = [], []
            for l in lt:
                pm = [max(L[h] - (C[h][a] - C[l][b]), L[l] + (C[h][a] - C[l][b])) for a in range(m) for b in range(m)]
                f = first_min(pm)
                rb.append(pm[f])
                ra.append(f)
            best.append(rb)
            at.append(ra)
        if not any(x < L[hv[0]] for x in best[0]):
            return
        used = set()
        for p, h in enumerate(hv):
            ok = [k for k in range(K) if best[p][k] < L[h] and lt[k] not in used]
            if not ok:
                continue
            k = min(ok, key=lambda k: best[p][k])
            used.add(lt[k])
            a, b = divmod(at[p][k], m)
            swap(M, C, h, a, lt[k], b)
        if not used:
            return
        L[:] = [row_sum(r) for r in C]


def local_search(M, C, L, target, iters, K):
    """Steepest swaps of the heaviest group with the K lightest: the lowest pair max, if strictly
    below the heaviest load; among equal ones the fewest samples away from home, then the first
    (a, k, b) in order. Returns (iterations, stuck)."""
    G, m = len(M), len(M[0])
    for it in range(iters):
        order = argsort(L)
        h = order[-1]
        Lh = L[h]
        if Lh <= target:
            return it, False
        part = order[:K]
        cands = []
        for a in range(m):
            for k, q in enumerate(part):
                for b in range(m):
                    d = C[h][a] - C[q][b]
                    cands.append((max(Lh - d, L[q] + d), a, q, b))
        best = min(x[0] for x in cands)
        if not best < Lh:
            return it, True
        tied = [x for x in cands if x[0] == best]

        def away(x):
            _, a, q, b = x
            hh, hk = M[h][a] // m, M[q][b] // m
            return (hh != q) - (hh != h) + (hk != h) - (hk != q)
        _, a, q, b = min(tied, key=away) if len(tied) > 1 else tied[0]
        swap(M, C, h, a, q, b)
        L[h], L[q] = row_sum(C[h]), row_sum(C[q])
    return iters, False


def gather(M, C, L):
    """The heaviest group (first of the maxima) trades its costs, largest first, each for the first
    unused of the 4m smallest costs held elsewhere (ties by position) that is smaller and keeps the
    receiving group below the heaviest group's new load. Returns the number of swaps."""
    G, m = len(M), len(M[0])
    h = first_min([-x for x in L])
    flat = [C[g][p] for g in range(G) for p in range(m)]
    o = [i for i in argsort(flat) if i // m != h][:4 * m]
    loads = list(L)
    Lh = loads[h]
    used = [False] * len(o)
    n = 0
    for a in argsort([-x for x in C[h]]):
        x = C[h][a]
        for t, i in enumerate(o):
            y = flat[i]
            if y >= x:
                break
            if used[t]:
                continue
            q, d = i // m, x - y
            if loads[q] + d < Lh - d:
                used[t] = True
                swap(M, C, h, a, q, i % m)
                Lh -= d
                loads[q] += d
                n += 1
                break
    L[:] = [row_sum(r) for r in C]
    return n


def partitions(groups, m):
    """Every split of range(groups*m) into unlabelled bins of m, in order: the bin of the first
    element with every combination of the rest, recursively."""
    out = []

    def rec(rest, chosen):
        if not rest:
            out.append(chosen)
            return
        first, tail = rest[0], rest[1:]
        for comb in itertools.combinations(tail, m - 1):
            rec(tuple(x for x in tail if x not in comb), chosen + ((first,) + comb,))

    rec(tuple(range(groups * m)), ())
    return out


def partition_max(row, part):
    return max(row_sum([row[i] for i in b]) for b in part)


def resplit(M, C, L, k, budget):
    """The heaviest group and k-1 others (k == 2: any other; k == 3: two of the four lightest), every
    partition of their samples: the lowest max load (the first 256 (combination, partition) pairs
    reaching it), then the labelling bin -> group that keeps most samples home (first in order).
    Applied when it lowers the heaviest load and fits in `budget` partitions."""
    G, m = len(M), len(M[0])
    if G < k:
        return False
    order = argsort(L)
    h = order[-1]
    pool = order[:-1] if k == 2 else order[:min(G - 1, 4)]
    combos = [(h,) + t for t in itertools.combinations(pool, k - 1)]
    P = partitions(k, m)
    if len(combos) * len(P) > budget[0]:
        return False
    budget[0] -= len(combos) * len(P)
    rows = [[x for g in cb for x in C[g]] for cb in combos]
    ids = [[x for g in cb for x in M[g]] for cb in combos]
    pm = [[partition_max(rows[t], part) for part in P] for t in range(len(combos))]
    best = min(min(r) for r in pm)
    found = [(t, pi) for t in range(len(combos)) for pi in range(len(P)) if pm[t][pi] == best][:256]
    if not best < L[h]:
        return False
    pick, most = None, -1
    for t, pi in found:
        for perm in itertools.permutations(range(k)):
            dest = [combos[t][perm[b]] for b in range(k)]
            kept = sum(ids[t][i] // m == dest[b] for b in range(k) for i in P[pi][b])
            if kept > most:
                pick, most = (t, pi, dest), kept
    t, pi, dest = pick
    for b, g in enumerate(dest):
        M[g] = [ids[t][i] for i in P[pi][b]]
        C[g] = [rows[t][i] for i in P[pi][b]]
        L[g] = row_sum(C[g])
    return True


def improve(M, C, L, target, iters, K):
    """Local search; when stuck, a gather move, else a re-split with one other group (m <= 4), else
    with two others (m <= 4), then search on, within `iters` steps and RESPLIT_WORK partitions."""
    m = len(M[0])
    used = 0
    budget = [RESPLIT_WORK]
    while used < iters:
        it, stuck = local_search(M, C, L, target, iters - used, K)
        used += it + 1
        if not stuck:
            return
        if gather(M, C, L):
            continue
        if m <= RESPLIT_M and resplit(M, C, L, 2, budget):
            continue
        if not (m <= RESPLIT_M and resplit(M, C, L, 3, budget)):
            return


def exhaustive(c, groups, m):
    """(lowest max load over every partition, the first optimal partition with the most samples that
    can stay home: per bin its largest same-home count, summed)."""
    P = partitions(groups, m)
    pm = [partition_max(c, part) for part in P]
    best = min(pm)
    pick, most = None, -1
    for part, x in zip(P, pm):
        if x == best:
            home = sum(max(sum(i // m == g for i in b) for g in range(groups)) for b in part)
            if home > most:
                pick, most = part, home
    return best, [list(b) for b in pick]


def relabel(M, m):
    """Bins get group labels greedily by overlap with the groups' natural samples (largest overlap
    first, ties by bin then group), unlabelled bins the free groups in order."""
    G = len(M)
    overlap = [(sum(i // m == g for i in M[b]), b, g) for b in range(G) for g in range(G)]
    label, taken = [-1] * G, [False] * G
    for count, b, g in sorted((x for x in overlap if x[0] > 0), key=lambda x: (-x[0], x[1] * G + x[2])):
        if label[b] < 0 and not taken[g]:
            label[b], taken[g] = g, True
    free = [g for g in range(G) if not taken[g]]
    for b in range(G):
        if label[b] < 0:
            label[b] = free.pop(0)
    out = [None] * G
    for b in range(G):
        out[label[b]] = list(M[b])
    return out


def return_home(M, C, L, cap, rounds):
    """Per round: each moved sample (row by row) and its best partner in its home group (the swap
    that cuts the moved count most while both loads stay <= cap; first partner on ties); the swaps
    that cut it, most first (stably), kept when first to touch both their groups; all at once."""
    G, m = len(M), len(M[0])
    for _ in range(rounds):
        moved = [(a, p) for a in range(G) for p in range(m) if M[a][p] // m != a]
        if not moved:
            return
        cands = []
        for a, p in moved:
            q, ci = M[a][p] // m, C[a][p]
            keys = []
            for b in range(m):
                ck = C[q][b]
                fits = L[a] - ci + ck <= cap and L[q] + ci - ck <= cap
                kh = M[q][b] // m
                keys.append(int(kh != a) - 1 - int(kh != q) if fits else 1)
            b = first_min(keys)
            if keys[b] < 0:
                cands.append((keys[b], a, p, q, b))
        if not cands:
            return
        cands.sort(key=lambda x: x[0])
        touched, keep = set(), []
        for key, a, p, q, b in cands:
            if a not in touched and q not in touched:
                keep.append((a, p, q, b))
            touched.update((a, q))
        for a, p, q, b in keep:
            swap(M, C, a, p, q, b)
        L[:] = [row_sum(r) for r in C]


# --- the whole plan ---------------------------------------------------------------------------------

def adopt(c, X):
    M = relabel(X, len(X[0]))
    C = [[c[i] for i in r] for r in M]
    L = [row_sum(r) for r in C]
    return M, C, L, max(L)


def search(c, M, C, L, lb, lpt_max):
    G, m = len(M), len(M[0])
    n = G * m
    target = lb * (1 + TOL)
    small = G * m * m <= SMALL
    K = G - 1 if small else max(1, min(G - 1, POLISH_WORK // (m * m)))
    iters = SMALL_ITERS if small else POLISH_ITERS
    if n >= COARSE_MIN:
        M, C = coarse(M, C, L, lb)
        L = [row_sum(r) for r in C]
    pair_rounds(M, C, L, target, PAIR_ROUNDS)
    if not small:
        batched_rounds(M, C, L, target, BATCH_ROUNDS, BATCH_WORK)
    improve(M, C, L, target, iters, K)
    best = max(L)
    if small or best > lpt_max:
        A = [sorted(r) for r in lpt_groups(c, G)[0]]
        CA = [[c[i] for i in r] for r in A]
        LA = [row_sum(r) for r in CA]
        improve(A, CA, LA, target, iters, K)
        if max(LA) < best * (1 - EXACT_MARGIN) or best > lpt_max:
            M, C, L, best = adopt(c, A)
    if n <= EXHAUSTIVE_B:
        opt, X = exhaustive(c, G, m)
        if best > opt * (1 + EXACT_MARGIN):
            M, C, L, best = adopt(c, X)
    return_home(M, C, L, best, HOME_ROUNDS if small else HOME_ROUNDS_LARGE if n < HOME_MAX_B else 0)
    return M, C, L


def balanced(costs, groups):
    """The canonical order `balanced` returns for float costs (B % G == 0)."""
    c = [float(x) for x in costs]
    n, G = len(c), groups
    m = n // G
    if G == 1 or m == 1:
        return list(range(n))
    lb = cheap_lower_bound(sorted(c, reverse=True), G, m)
    M = [list(range(g * m, (g + 1) * m)) for g in range(G)]
    C = [[c[i] for i in r] for r in M]
    L = [row_sum(r) for r in C]
    lpt_members, lpt_max = lpt_groups(c, G)
    if G == 2 and m <= TWO_GROUP_EXACT_M:
        if max(L) > lb * (1 + EXACT_MARGIN):
            resplit(M, C, L, 2, [math.inf])
    elif max(L) > lb * (1 + EXACT_MARGIN):
        M, C, L = search(c, M, C, L, lb, lpt_max)
    mine = max(L)
    if sums_are_exact(c):
        worse = mine > lpt_max
    else:
        worse = not mine < lpt_max * (1 - EXACT_MARGIN) and \
            exact_max(C) > exact_max([[c[i] for i in sorted(r)] for r in lpt_members])
    if worse:
        M = relabel([sorted(r) for r in lpt_members], m)
    return [i for r in M for i in sorted(r)]
