"""Where the planning time of a small window goes (B <= 16 samples): `plan_window` whole, the balancer
alone (`balanced`, and `lpt` beside it), and the shares of `balanced`'s phases, on the host.

  python bench/plan_small.py [--reps 400] [--out bench/results/plan_small.json]

For each size B x G (G = dp ranks, one micro-batch, VLM-like costs with text-only samples): median
host ms of `plan_window` and of the two balancers called directly; the share of `balanced`'s time in
each phase (cProfile cumulative time over the same calls: the cost checks, the lower bound, the
two-group re-split, the search, LPT's max load, the LPT guard); and what one call runs, counted, which is the same on every host
(unlike times): Python function calls and C calls (numpy and builtins). Small windows are bound by
the count of small numpy calls, not by arithmetic: the calls column says how many there are.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import code_commit, cpu_name, median_ms  # noqa: E402
from reorder.plan import balancers as bal  # noqa: E402
from reorder.plan.cost import CostModel  # noqa: E402
from reorder.plan.counts import SampleCounts  # noqa: E402
from reorder.plan.grid import Grid  # noqa: E402
from reorder.plan.window import PlanSettings, plan_window, window_costs  # noqa: E402

COST = CostModel()
PHASES = {  # phase -> the balancers.py functions whose cumulative time it is (called from `balanced`)
    "checks": ("check_costs",),
    "bound": ("_cheap_lower_bound",),
    "two_group_resplit": ("_resplit",),  # G == 2: every partition (inside the search it is counted there too)
    "search": ("_search",),
    "lpt_max": ("_lpt_max",),
    "lpt_guard": ("_worse_than_lpt",),
}


def instance(rng, batch: int):
    ph = rng.integers(250, 4000, size=(1, batch)) * (rng.random((1, batch)) > 0.3)
    return SampleCounts.of(placeholders=ph, real_tokens=rng.integers(100, 4096, size=(1, batch)),
                           images=(ph > 0).astype(np.int64), rows=ph * 4)


def counted_calls(fn) -> dict:
    """Python and C calls of one `fn()` (sys.setprofile), by kind."""
    seen = {"python": 0, "c": 0}

    def hook(frame, event, arg):
        if event == "call":
            seen["python"] += 1
        elif event == "c_call":
            seen["c"] += 1

    sys.setprofile(hook)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def phase_shares(fn, reps: int) -> dict:
    """Share of fn's profiled time in each phase of `balanced` (cumulative, by function name; the
rest is `balanced`'s own lines: argsort, reshapes, row sums, the final sort)."""
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        fn()
    pr.disable()
    stats = pstats.Stats(pr).stats
    total = sum(tt for (_, _, _), (_, _, tt, _, _) in stats.items())
    out = {}
    for phase, names in PHASES.items():
        cum = sum(ct for (file, _, name), (_, _, _, ct, _) in stats.items()
                  if name in names and file.endswith("balancers.py"))
        out[phase] = round(cum / total, 3) if total else 0.0
    return out


def measure(sizes, reps: int, seed: int) -> dict:
    rng, rows = np.random.default_rng(seed), {}
    for batch, groups in sizes:
        counts = instance(rng, batch)
        grid, settings = Grid(size=groups, dp=groups, rank=0), PlanSettings()
        costs = window_costs(counts, COST, False)[0]
        plan = lambda: plan_window(counts, COST, grid, settings)  # noqa: E731
        balanced = lambda: bal.balanced(costs, groups)  # noqa: E731
        lpt = lambda: bal.lpt(costs, groups)  # noqa: E731
        row = {"plan_window_ms": median_ms(plan, reps, warmup=5),
               "balanced_ms": median_ms(balanced, reps, warmup=5),
               "lpt_ms": median_ms(lpt, reps, warmup=5),
               "balanced_phase_share": phase_shares(balanced, max(reps // 4, 20)),
               "plan_window_calls": counted_calls(plan), "balanced_calls": counted_calls(balanced),
               "lpt_calls": counted_calls(lpt)}
        rows[f"{batch}x{groups}"] = row
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="4x2,8x2,8x4,16x2,16x4,16x8", help="B x G pairs, comma separated")
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/results/plan_small.json")
    args = p.parse_args()
    sizes = [tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")]
    rows = measure(sizes, args.reps, args.seed)
    print(f"{'B x G':>6} {'plan_window ms':>15} {'balanced ms':>12} {'lpt ms':>8} {'calls py/C':>11}  "
          f"balanced phase shares")
    for size, r in rows.items():
        c = r["plan_window_calls"]
        print(f"{size:>6} {r['plan_window_ms']:15.4f} {r['balanced_ms']:12.4f} {r['lpt_ms']:8.4f} "
              f"{c['python']:>5}/{c['c']:<5}  {r['balanced_phase_share']}")
    res = {"commit": code_commit(), "cpu": cpu_name(), "reps": args.reps, "seed": args.seed, "sizes": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
