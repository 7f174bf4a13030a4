"""Golden plans of the default balancer: the exact canonical order `balanced` gives on a fixed,
seeded set of instances (2 to 1024 groups, 2 to 128 samples per group; continuous, heavy-tailed,
vision-language, integer-tied and zero-heavy costs), stored in golden/balanced_plans.json.

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
DIGESTS = Path(__file__).parent / "golden" / "balanced_digests.json"
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


# the instance families the plans were once compared on element for element: every size class of the
# search (exact two-group re-split, exhaustive B <= 10, small and large searches, evict-and-refill
# from B = 256, LPT and refill by rounds from G = 256), edge cases whose plans depend on how many
# light groups the polishing swaps try, and tie- and zero-heavy costs
CLASSES = [(2, 2), (3, 2), (3, 3), (4, 2), (5, 2), (2, 5), (2, 7), (2, 8), (4, 4), (8, 2), (8, 4), (6, 5), (16, 4),
           (3, 10), (2, 9), (16, 16), (32, 8), (64, 16), (8, 32), (2, 128), (16, 8), (64, 4), (3, 40)]
EDGES = [(24, 10, 32, "lognormal"), (33, 8, 42, "lognormal"), (3, 36, 26, "pareto"), (6, 16, 15203, "tied")]
MANY_GROUPS = [(256, 2), (256, 4), (300, 3), (512, 2), (1024, 2)]
TIED = [(2, 2), (2, 3), (3, 2), (3, 3), (4, 2), (5, 2), (2, 6), (4, 3), (3, 4), (8, 2), (4, 4), (6, 3), (2, 8)]


def edge(groups, m, seed, kind) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n = groups * m
    return {"lognormal": lambda: np.round(rng.lognormal(np.log(2500), 0.8, n)),
            "pareto": lambda: np.round(500 * (rng.pareto(1.5, n) + 1)),
            "tied": lambda: rng.choice([0.0, 1.0, 5.0, 20.0], n)}[kind]()


def tied(groups, m, seed) -> np.ndarray:
    rng = np.random.default_rng((groups, m, seed, 7))
    values = np.array([0.0, 1.0, 2.0, 3.0, 7.5, 1e4])
    n = groups * m
    return np.where(rng.random(n) < 0.5, values[rng.integers(0, len(values), n)], rng.integers(0, 51, n).astype(float))


def instances() -> dict:
    """name -> (costs, groups) of every golden instance."""
    from support.costs import vlm_costs

    out = {f"{g}x{m} {kind} {seed}": (instance(g, m, kind, seed), g)
           for g, m in SHAPES for kind in KINDS for seed in range(4 if g * m <= 64 else 2)}
    for seed in range(3):
        rng = np.random.default_rng(seed)
        for i in range(len(CLASSES) * 2):
            g, m = CLASSES[i % len(CLASSES)]
            out[f"class {seed} {i} {g}x{m}"] = (vlm_costs(rng, g * m, (i + seed) % 6), g)
    for g, m, seed, kind in EDGES:
        out[f"edge {g}x{m} {kind} {seed}"] = (edge(g, m, seed, kind), g)
    for g, m in MANY_GROUPS:
        rng = np.random.default_rng(g * m)
        for kind in range(6):
            out[f"many {g}x{m} vlm {kind}"] = (vlm_costs(rng, g * m, kind), g)
    for g, m in TIED:
        for seed in range(10):
            out[f"tied {g}x{m} {seed}"] = (tied(g, m, seed), g)
    return out


def plan_text(costs, groups) -> str:
    """The plan as text: the canonical order's sample indices, space-separated."""
    return " ".join(map(str, balanced(costs, groups).tolist()))


def check_golden(path: Path, got: dict, show_plans: bool) -> None:
    """`got` (name -> value) equals the golden file at `path` (rewritten first with
    REORDER_ACCEPT_GOLDEN=1); the message names the first instance that changed."""
    if os.environ.get("REORDER_ACCEPT_GOLDEN") == "1":
        path.write_text(json.dumps(got, indent=0) + "\n")
    want = json.loads(path.read_text())
    assert got.keys() == want.keys()
    differ = [k for k in want if got[k] != want[k]]
    first = f": {got[differ[0]]} != {want[differ[0]]}" if differ and show_plans else ""
    assert not differ, f"{len(differ)} of {len(want)} plans changed, first {differ[0]}{first}"


def test_balanced_gives_the_golden_plans():
    check_golden(GOLDEN, {name: plan_text(c, g) for name, (c, g) in instances().items()}, show_plans=True)


def more_instances() -> dict:
    """name -> (costs, groups): many more seeds of the same families (plans pinned by digest)."""
    from support.costs import vlm_costs

    out = {}
    for g, m in TIED:
        for seed in range(10, 50):
            out[f"tied {g}x{m} {seed}"] = (tied(g, m, seed), g)
    for g, m in CLASSES:
        for kind in range(6):
            for seed in range(6 if g * m <= 128 else 2):
                out[f"class {g}x{m} vlm {kind} {seed}"] = (vlm_costs(np.random.default_rng((g, m, kind, seed)), g * m,
                                                                      kind), g)
    rng = np.random.default_rng(2024)
    for i in range(300):
        g, m = int(rng.integers(2, 13)), int(rng.integers(2, 11))
        costs = np.where(rng.random(g * m) < 0.3, 0.0, np.round(rng.lognormal(4, 1.5, g * m), int(rng.integers(0, 3))))
        out[f"mixed {i} {g}x{m}"] = (costs, g)
    return out


def test_balanced_gives_the_golden_plans_on_many_more_seeds():
    """The first 16 hex digits of the SHA-256 of each plan's text."""
    import hashlib

    got = {name: hashlib.sha256(plan_text(c, g).encode()).hexdigest()[:16] for name, (c, g) in more_instances().items()}
    check_golden(DIGESTS, got, show_plans=False)
