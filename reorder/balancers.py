"""Balancers: pure equal-count assignments of B sample costs to G groups (numbers in, numbers out).

A balancer takes `costs` (float64 [B], natural order) and `groups` (G, B % G == 0) and returns the
canonical order: int64 [B], position p -> natural sample index; group j holds positions
[j*B/G, (j+1)*B/G). Sample i naturally sits in group i // (B/G). Every balancer is deterministic:
ties are broken by index, never by hash or dict order.
"""

from __future__ import annotations

import heapq

import numpy as np


def identity(costs: np.ndarray, groups: int) -> np.ndarray:
    """The natural assignment: nothing moves."""
    return np.arange(len(costs), dtype=np.int64)


def lpt(costs: np.ndarray, groups: int) -> np.ndarray:
    """Equal-count LPT, bit-for-bit the reference (DESIGN section 5).

    Visit samples by (-cost, index); each goes to the non-full group with the smallest
    (load, group index); canonical order = groups in order, members in insertion order.
    """
    n = len(costs)
    cap = n // groups
    visit = np.lexsort((np.arange(n), -np.asarray(costs, dtype=np.float64)))
    heap = [(0.0, j) for j in range(groups)]
    members = np.empty((groups, cap), dtype=np.int64)
    fill = [0] * groups
    c = costs.tolist() if isinstance(costs, np.ndarray) else list(costs)
    for i in visit.tolist():
        load, j = heapq.heappop(heap)
        members[j, fill[j]] = i
        fill[j] += 1
        if fill[j] < cap:
            heapq.heappush(heap, (load + c[i], j))
    return members.reshape(-1)


BALANCERS = {"lpt": lpt, "identity": identity}


def get_balancer(name: str):
    """Look a balancer up by name; the error lists the known names."""
    try:
        return BALANCERS[name]
    except KeyError:
        raise ValueError(f"balancer={name!r} is unknown; choose one of {sorted(BALANCERS)}") from None
