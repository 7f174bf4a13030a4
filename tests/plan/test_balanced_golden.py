"""Golden plans of the default balancer: the exact canonical order `balanced` gives on a fixed,
seeded set of instances (shapes from 2 groups to 300, 1 to 16 samples per group; continuous,
heavy-tailed, integer-tied and zero-heavy costs), stored in golden/balanced_plans.json.

The properties (test_balanced_properties.py) say which plans are acceptable; among equally good
plans `balanced` promises one, deterministically, and a change of which one comes back changes what
every rank of every module receives. This table pins it: an intended change regenerates it with
REORDER_ACCEPT_GOLDEN=1 and shows in review as a diff of plans. (When the table was written, every
plan in it equalled the step-by-step reference the properties replaced.)"""

import json
import os
from pathlib import Path

import numpy as np

from reorder.plan.balancers import balanced

GOLDEN = Path(__file__).parent / "golden" / "balanced_plans.json"
SHAPES = [(2, 2), (2, 5), (2, 8), (3, 4), (4, 2), (4, 6), (5, 3), (8, 4), (8, 16), (16, 2), (16, 8), (32, 4),
          (64, 2), (64, 8), (100, 3), (300, 2)]
KINDS = ("lognormal", "pareto", "integers", "zeros")


def instance(groups: int, m: int, kind: str, seed: int) -> np.ndarray:
    rng = np.random.default_rng((groups, m, KINDS.index(kind), seed))
    n = groups * m
    if kind == "lognormal":
        return rng.lognormal(6.0, 1.2, n)
    if kind == "pareto":
        return (rng.pareto(1.3, n) + 1) * 100
    if kind == "integers":  # many ties
        return rng.integers(0, 6, n).astype(np.float64) * 250
    costs = rng.lognormal(5.0, 1.0, n)
    costs[rng.random(n) < 0.6] = 0.0
    return costs


def plans() -> dict:
    return {f"{g}x{m} {kind} {seed}": balanced(instance(g, m, kind, seed), g).tolist()
            for g, m in SHAPES for kind in KINDS for seed in range(4 if g * m <= 64 else 2)}


def test_balanced_gives_the_golden_plans():
    got = plans()
    if os.environ.get("REORDER_ACCEPT_GOLDEN") == "1":
        GOLDEN.write_text(json.dumps(got, indent=0, separators=(",", ":")) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert got.keys() == want.keys()
    differ = [k for k in want if got[k] != want[k]]
    assert not differ, f"{len(differ)} of {len(want)} plans changed, first {differ[0]}: {got[differ[0]]} != {want[differ[0]]}"
