"""Slow, obviously-correct reference versions of every reorder computation (plain Python, no torch).

Nothing here imports `reorder`; tests hold the implementation against these functions.
Conventions follow docs/design.md, Vocabulary: B samples per global micro-batch, grid G = lcm(dp sizes),
group j holds canonical positions [j*B/G, (j+1)*B/G), a module with DP size d gives rank r the
positions [r*B/d, (r+1)*B/d).
"""

from __future__ import annotations

import math


def canonical_grid(dp_sizes):
    """G = lcm of the module DP sizes (each must be >= 1)."""
    g = 1
    for d in dp_sizes:
        if d < 1:
            raise ValueError(f"dp size must be >= 1, got {d}")
        g = g * d // math.gcd(g, d)
    return g


def covered_groups(dp, groups, rank):
    """Groups rank `rank` of a module with DP size `dp` covers on a grid of `groups`."""
    per = groups // dp
    return [j for j in range(groups) if j // per == rank]


def owner(group, dp, groups):
    """Rank (of a module with DP size `dp`) that owns canonical group `group`."""
    for r in range(dp):
        if group in covered_groups(dp, groups, r):
            return r
    raise ValueError(group)


def natural_rank(index, batch, dp):
    """Rank that reads global position `index` under scalable reads (contiguous 1/dp share)."""
    share = batch // dp
    return index // share


def sample_cost(input_ids_row, attention_row, *, image_token_id, spatial_merge_size,
                encoder_weight, language_weight, encoder_quadratic_weight=0.0, language_quadratic_weight=0.0,
                encoder_image_weight=0.0, vision_start_token_id=None):
    """encoder_weight * patches + encoder_quadratic_weight * sum of per-image patches^2
    + encoder_image_weight * vision-start tokens
    + language_weight * real tokens + language_quadratic_weight * real tokens^2, for one sample
    (patches = placeholders * merge^2; for the quadratic term one image = one run of consecutive
    placeholder tokens)."""
    merge2 = spatial_merge_size * spatial_merge_size
    placeholders, runs, run = 0, [], 0
    for t in list(input_ids_row) + [None]:
        if t == image_token_id:
            placeholders += 1
            run += 1
        elif run:
            runs.append(run)
            run = 0
    cost = encoder_weight * float(placeholders * merge2)
    if encoder_quadratic_weight != 0:
        cost = cost + encoder_quadratic_weight * float(sum((k * merge2) ** 2 for k in runs))
    if encoder_image_weight != 0:
        cost = cost + encoder_image_weight * float(sum(1 for t in input_ids_row if t == vision_start_token_id))
    real = 0
    for m in attention_row or []:
        if m:
            real += 1
    if language_weight != 0:
        cost = cost + language_weight * float(real)
    if language_quadratic_weight != 0:
        cost = cost + language_quadratic_weight * float(real * real)
    return float(cost)


def lpt_order(costs, groups):
    """Equal-count LPT (docs/design.md, Balancers), returns canonical order (position -> sample index).

    Visit samples by (-cost, index); each goes to the non-full group with the smallest
    (load, group index); canonical order = groups in order, members in insertion order.
    """
    n = len(costs)
    if n % groups:
        raise ValueError("B % G != 0")
    cap = n // groups
    members = [[] for _ in range(groups)]
    loads = [0.0] * groups
    for i in sorted(range(n), key=lambda i: (-costs[i], i)):
        best = None
        for j in range(groups):
            if len(members[j]) == cap:
                continue
            if best is None or (loads[j], j) < (loads[best], best):
                best = j
        members[best].append(i)
        loads[best] = loads[best] + costs[i]
    return [i for m in members for i in m]


def group_loads(costs, order, groups):
    """Sum of costs of each group's members under a canonical order."""
    cap = len(order) // groups
    loads = []
    for j in range(groups):
        total = 0.0
        for p in range(j * cap, (j + 1) * cap):
            total += costs[order[p]]
        loads.append(total)
    return loads


def canonical_position(order):
    """Inverse of the order: sample index -> canonical position."""
    pos = {}
    for p, i in enumerate(order):
        pos[i] = p
    return [pos[i] for i in range(len(order))]


def new_owner(index, order, batch, dp):
    """Rank of a module with DP size dp that holds sample `index` after reordering."""
    return canonical_position(order)[index] // (batch // dp)


def window_routes(orders, batch, dp, rank):
    """Sends and receives of `rank` for a window; orders[slot] is that slot's canonical order.

    Returns (sends, recvs): sends[q] / recvs[q] are lists of (slot, sample index) in
    (slot, canonical position) order. A sample that stays appears in sends[rank] and recvs[rank].
    """
    sends = {q: [] for q in range(dp)}
    recvs = {q: [] for q in range(dp)}
    for slot, order in enumerate(orders):
        pos = canonical_position(order)
        for i in sorted(range(batch), key=lambda i: pos[i]):
            src = natural_rank(i, batch, dp)
            dst = pos[i] // (batch // dp)
            if src == rank:
                sends[dst].append((slot, i))
            if dst == rank:
                recvs[src].append((slot, i))
    return sends, recvs


def reassemble(orders, samples, batch, dp, rank):
    """What `rank` holds after the exchange: per slot, samples[slot][i] for its canonical positions."""
    share = batch // dp
    return [[samples[slot][order[p]] for p in range(rank * share, (rank + 1) * share)]
            for slot, order in enumerate(orders)]


def bridge_fanout(vision_batches, dp_vision, dp_language):
    """BridgeCommunicator fan-out model: vision replica i's batch, split by position, goes to
    language ranks [i*k, (i+1)*k), k = dp_language / dp_vision. Returns per-language-rank lists."""
    k = dp_language // dp_vision
    out = []
    for i in range(dp_vision):
        b = vision_batches[i]
        per = len(b) // k
        for j in range(k):
            out.append(list(b[j * per:(j + 1) * per]))
    return out


def bridge_fanin(language_batches, dp_vision, dp_language):
    """Fan-in model: vision replica i receives language ranks [i*k, (i+1)*k) concatenated."""
    k = dp_language // dp_vision
    return [[s for j in range(i * k, (i + 1) * k) for s in language_batches[j]]
            for i in range(dp_vision)]


def gate_backoff_skips(fully_gated, max_skip):
    """Which windows of a stream the gate backoff skips (True) and which it plans (False).

    fully_gated[k]: the cost-benefit gate would keep every slot of window k natural if it were
    planned (a skipped window's value is never read). After the j-th planned window in a row that was
    fully gated, the next min(2**(j-1), max_skip) windows are skipped; a planned window that moves
    anything ends the run. max_skip 0: nothing is skipped."""
    skips, run, left = [], 0, 0
    for gated in fully_gated:
        if left:
            skips.append(True)
            left -= 1
            continue
        skips.append(False)
        run = run + 1 if gated else 0
        left = min(2 ** (run - 1), max_skip) if run and max_skip else 0
    return skips


def gate_keeps_natural(before, after, min_gain=None, min_saving=None):
    """Cost-benefit gate for one slot, `before` / `after` the max group load of the natural / the
    planned assignment: True when the plan does not pay, so the slot keeps its natural order.
    A plan pays only if it passes every threshold that is set: relative gain 1 - after / before
    (0 when before is 0) above `min_gain`, and saving before - after above `min_saving`."""
    if min_gain is not None:
        gain = 1.0 - after / before if before > 0 else 0.0
        if gain <= min_gain:
            return True
    if min_saving is not None and before - after <= min_saving:
        return True
    return False


def gated_orders(costs, planned, groups, min_gain=None, min_saving=None):
    """The gate over a window: per slot, `planned[s]` if it pays, else the natural order.
    Returns (orders, gated) as lists."""
    orders, gated = [], []
    for row, order in zip(costs, planned):
        natural = list(range(len(row)))
        before = max(group_loads(row, natural, groups))
        after = max(group_loads(row, order, groups))
        keep = gate_keeps_natural(before, after, min_gain, min_saving)
        gated.append(keep)
        orders.append(natural if keep else list(order))
    return orders, gated


def equal_count_optimum(costs, groups):
    """(minimal max group load, fewest samples away from their natural group among the plans that
    reach it) over every assignment of B costs to G groups of B/G each, by enumeration (tiny B
    only). A group's load is the correctly rounded sum of its costs (math.fsum)."""
    n = len(costs)
    m = n // groups
    best = [math.inf, math.inf]
    members = [[] for _ in range(groups)]

    def place(i, moved):
        if i == n:
            load = max(math.fsum(g) for g in members)
            if (load, moved) < tuple(best):
                best[:] = [load, moved]
            return
        for j in range(groups):
            if len(members[j]) < m:
                members[j].append(costs[i])
                place(i + 1, moved + (j != i // m))
                members[j].pop()

    place(0, 0)
    return best[0], best[1]


def moved_samples(order, groups):
    """Samples whose group changed under a canonical order (sample i naturally in group i // (B/G))."""
    m = len(order) // groups
    return sum(1 for p, i in enumerate(order) if p // m != i // m)


def lower_bound_families(costs, groups):
    """Lower bounds on the minimal max group load under equal counts (m = B/G per group), by family,
    each a sum over costs sorted descending (s) divided by a count; `lower_bound` is their max:

    - "mean": the total over G;
    - "largest": with m == 1, the largest cost;
    - "pair": with m == 2, the optimum itself: largest with smallest, second with second smallest...;
    - "pigeon": for k < m, some group holds k+1 of the k*G+1 largest costs (the k+1 smallest of
      them at least) plus m-k-1 others (the smallest costs at least);
    - "pigeon_r": for k < m and r <= G with k*G+r <= B, r groups together hold r*(k+1) of the
      k*G+r largest costs (the smallest of them at least) plus r*(m-k-1) others, over r;
    - "spread": for every t, the t largest costs lie in some u groups (t/m <= u <= min(t, G)), whose
      u*m - t other slots hold at least the smallest costs: the lowest such average over u.
    Plain Python on exact values (integer costs give exact results)."""
    n = len(costs)
    m = n // groups
    s = sorted(costs, reverse=True)
    smallest = sorted(costs)
    out = {"mean": sum(s) / groups}
    if m == 1:
        out["largest"] = s[0]
        return out
    if m == 2:
        out["pair"] = max(s[i] + s[2 * groups - 1 - i] for i in range(groups))
        return out
    out["pigeon"] = max(sum(s[k * groups - k:k * groups + 1]) + sum(smallest[:m - 1 - k]) for k in range(m))
    pigeon_r = []
    for k in range(m):
        for r in range(1, groups + 1):
            size = k * groups + r
            if size <= n:
                pigeon_r.append((sum(s[size - r * (k + 1):size]) + sum(smallest[:r * (m - k - 1)])) / r)
    out["pigeon_r"] = max(pigeon_r)
    spread = []
    for t in range(1, n + 1):
        spread.append(min((sum(s[:t]) + sum(smallest[:u * m - t])) / u
                          for u in range(1, groups + 1) if u <= t <= u * m))
    out["spread"] = max(spread)
    return out


def sums_are_exact(costs):
    """True when every cost is a multiple of 2**-20 and max cost * B < 2**32: then every sum of
    the costs is exact in float64 (at most 52 significant bits)."""
    from fractions import Fraction
    if not costs or not max(costs) * len(costs) < 2 ** 32:
        return False
    return all((Fraction(c) * 2 ** 20).denominator == 1 for c in costs)
