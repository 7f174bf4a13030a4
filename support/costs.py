"""Synthetic per-sample costs for the balancer tests."""

import numpy as np


def vlm_costs(rng, n: int, kind: int) -> np.ndarray:
    """float64 [n] costs of one kind: 0 bimodal patch counts (10 % text-only), 1 lognormal, 2 heavy
    tail (10 % text-only), all rounded to whole patches; 3 floats whose sums round (1.0-1.3),
    4 plain floats, 5 small integers with many ties."""
    if kind == 0:
        c = np.where(rng.random(n) < 0.4, rng.normal(9000, 1500, n), rng.normal(1200, 300, n))
        c[rng.random(n) < 0.1] = 0
    elif kind == 1:
        c = rng.lognormal(np.log(2500), 0.8, n)
    elif kind == 2:
        c = 500 * (rng.pareto(2.0, n) + 1)
        c[rng.random(n) < 0.1] = 0
    elif kind == 3:
        return rng.integers(0, 4, n) * 0.1 + 1.0
    elif kind == 4:
        return rng.random(n) * 100
    else:
        return rng.integers(0, 20, n).astype(float)
    return np.round(np.maximum(c, 0))
