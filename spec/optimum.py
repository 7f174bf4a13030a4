"""The optimum of equal-count balancing by brute force, for small instances (B up to about 16).

Plain Python over subsets of samples (bitmasks), memoised; nothing here imports `reorder` or numpy,
and nothing follows how a balancer searches. A group's load is the correctly rounded sum of its
costs (`math.fsum`), the definition the balancers guarantee against. Sample i naturally sits in
group i // m (m = B/G); a sample is moved when the plan puts it in another group.
"""

from __future__ import annotations

import functools
import itertools
import math


def _subsets(mask, size):
    """Every subset of `mask` with `size` bits that holds its lowest bit (so each unordered split
    of `mask` into subsets of `size` is counted once)."""
    low = mask & -mask
    rest = [1 << i for i in range(mask.bit_length()) if (mask ^ low) >> i & 1]
    for comb in itertools.combinations(rest, size - 1):
        yield low | sum(comb)


def _every_subset(mask, size):
    """Every subset of `mask` with `size` bits."""
    bits = [1 << i for i in range(mask.bit_length()) if mask >> i & 1]
    for comb in itertools.combinations(bits, size):
        yield sum(comb)


def _check(costs, groups):
    n = len(costs)
    if groups < 1 or n == 0 or n % groups:
        raise ValueError(f"B={n} is not a positive multiple of G={groups}")
    return n, n // groups


def optimal_max_load(costs, groups):
    """The lowest max group load over every split of the B costs into G groups of B/G:
    best(S) = min over groups g of S (holding S's first sample) of max(load(g), best(S - g))."""
    n, m = _check(costs, groups)
    costs = [float(x) for x in costs]

    @functools.lru_cache(maxsize=None)
    def load(sub):
        return math.fsum(costs[i] for i in range(n) if sub >> i & 1)

    @functools.lru_cache(maxsize=None)
    def best(mask):
        if mask == 0:
            return -math.inf
        return min(max(load(sub), best(mask ^ sub)) for sub in _subsets(mask, m))

    return best((1 << n) - 1)


def fewest_moves(costs, groups, cap):
    """The fewest moved samples over every equal-count plan whose group loads are all <= `cap`
    (math.inf when there is none): groups 0, 1, ... take their B/G samples in turn, and group j's
    moved samples are those it holds from other groups."""
    n, m = _check(costs, groups)
    costs = [float(x) for x in costs]
    home = [sum(1 << i for i in range(j * m, (j + 1) * m)) for j in range(groups)]

    @functools.lru_cache(maxsize=None)
    def least(mask):
        if mask == 0:
            return 0
        j = groups - bin(mask).count("1") // m
        out = math.inf
        for sub in _every_subset(mask, m):
            if math.fsum(costs[i] for i in range(n) if sub >> i & 1) <= cap:
                out = min(out, m - bin(sub & home[j]).count("1") + least(mask ^ sub))
        return out

    return least((1 << n) - 1)


def optimum(costs, groups):
    """(the lowest max group load, the fewest moved samples among the plans reaching it)."""
    best = optimal_max_load(costs, groups)
    return best, fewest_moves(costs, groups, best)


def optimal_split(costs, groups):
    """One split of range(B) into G groups of B/G (lists of sample indices, ascending) whose max load
    is `optimal_max_load`: the first found, groups in the order they were built."""
    n, m = _check(costs, groups)
    best = optimal_max_load(costs, groups)
    costs = [float(x) for x in costs]

    def build(mask):
        if mask == 0:
            return []
        for sub in _subsets(mask, m):
            if math.fsum(costs[i] for i in range(n) if sub >> i & 1) <= best:
                rest = build(mask ^ sub)
                if rest is not None:
                    return [[i for i in range(n) if sub >> i & 1]] + rest
        return None

    return build((1 << n) - 1)
