"""Balancer quality, movement and planning time on synthetic VLM cost distributions.

For every balancer (identity for reference, lpt, balanced) over a fixed grid (bimodal, lognormal and
heavy-tail per-sample costs; G in {2,4,8,16,32,64} groups; m in {1,2,4,8,16} samples per group; fixed
seeds) it reports max group load / optimum, the fraction of samples moved (a sample is moved when its
group changes) and the planning time. The optimum is exact where it is proven (the best plan meets
`lower_bound`, or `exact` solves within --exact-limit seconds; B <= 64 only); elsewhere the ratio is
taken against the best proven lower bound, so it over-states the true ratio. Prints tables, writes
bench/results/balance.json and a plot bench/results/balance.png.

  python bench/balance.py            # full grid, 5 seeds (~1 minute; needs scipy and matplotlib)
  python bench/balance.py --quick    # smoke run in seconds (writes balance_quick.*)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.common import times_ms  # noqa: E402
from reorder.plan.balancers import balanced, exact, identity, lower_bound, lpt  # noqa: E402

BALANCERS = {"identity": identity, "lpt": lpt, "balanced": balanced}
DISTS = ("bimodal", "lognormal", "heavytail")
GROUPS = (2, 4, 8, 16, 32, 64)
PER_GROUP = (1, 2, 4, 8, 16)


def vlm_costs(dist: str, n: int, seed: int) -> np.ndarray:
    """Per-sample cost in patches (encoder weight 1): integers, with ties and zeros (text-only)."""
    rng = np.random.default_rng([DISTS.index(dist), n, seed])
    if dist == "bimodal":          # small images vs large ones, 10% text-only
        big = rng.random(n) < 0.4
        c = np.where(big, rng.normal(9000, 1500, n), rng.normal(1200, 300, n))
        c = np.maximum(np.round(c), 1)
        c[rng.random(n) < 0.1] = 0
    elif dist == "lognormal":      # one image of log-normal size
        c = np.round(rng.lognormal(np.log(2500), 0.8, n))
    else:                          # Pareto(2) tail, capped at 50k patches, 10% text-only
        c = np.minimum(np.round(500 * (rng.pareto(2.0, n) + 1)), 50000)
        c[rng.random(n) < 0.1] = 0
    return c.astype(np.float64)


def max_load(c, order, groups):
    return max(math.fsum(r) for r in c[order].reshape(groups, -1).tolist())


def moved_fraction(order, groups):
    m = len(order) // groups
    return float((order.reshape(groups, m) // m != np.arange(groups)[:, None]).mean())


def optimum(c, groups, best, args):
    """(value, proven): exact when the best plan meets the lower bound or the MILP solves in time."""
    lb = lower_bound(c, groups)
    if len(c) // groups <= 2:                     # m <= 2: lower_bound is the exact optimum
        return lb, True
    if best <= lb * (1 + 1e-12):
        return best, True
    if len(c) <= args.exact_max_b and args.exact_limit > 0:
        try:
            return max_load(c, exact(c, groups, fewest_moves=False, time_limit=args.exact_limit), groups), True
        except TimeoutError:
            pass
    return lb, False


def summarize(rows, name, times):
    r = np.array([row[name]["ratio"] for row in rows])
    mv = {g: [row[name]["moved"] for row in rows if row["G"] == g] for g in GROUPS}
    ms = {f"{g}x{m}": float(np.median(times[name][(g, m)])) for (g, m) in sorted(times[name])}

    def mean(*gs):
        v = [x for g in gs for x in mv.get(g, [])]
        return float(np.mean(v)) if v else None
    big = times[name].get((64, 16))
    return {
        "ratio_median": float(np.median(r)),
        "ratio_p95": float(np.percentile(r, 95)),
        "ratio_max": float(r.max()),
        "ratio_mean": float(r.mean()),
        "optimal_fraction": float(np.mean([row[name]["ratio"] <= 1 + 1e-12 for row in rows if row["proven"]])),
        "moved_fraction": float(np.mean([row[name]["moved"] for row in rows])),
        "moved_fraction_g4_8": mean(4, 8),
        "moved_fraction_g32_64": mean(32, 64),
        "moved_fraction_by_groups": {str(g): mean(g) for g in GROUPS if mv.get(g)},
        "plan_ms_1024x64": float(np.median(big)) if big else None,
        "plan_ms_1024x64_p10_p90": [float(np.percentile(big, 10)), float(np.percentile(big, 90))] if big else None,
        "plan_ms_by_size": ms,
        "max_load_above_lpt": int(sum(row[name]["max"] > row["lpt"]["max"] for row in rows)),
    }


def plot(result, rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(16, 4.6))
    colors = {"identity": "tab:gray", "lpt": "tab:orange", "balanced": "tab:blue"}
    for name in ("lpt", "balanced"):
        r = np.sort([row[name]["ratio"] for row in rows])
        ax[0].plot(r, np.arange(1, len(r) + 1) / len(r), label=name, color=colors[name])
    ax[0].set_xlabel("max load / optimum (or lower bound)")
    ax[0].set_ylabel("fraction of instances")
    ax[0].set_xlim(0.999, max(1.01, float(np.percentile([row["lpt"]["ratio"] for row in rows], 99))))
    ax[0].set_title("balance (CDF, 1.0 = optimal)")
    ax[0].legend()
    for name in ("lpt", "balanced"):
        by = result["balancers"][name]["moved_fraction_by_groups"]
        gs = sorted(int(g) for g in by)
        ax[1].plot(gs, [by[str(g)] for g in gs], "o-", label=name, color=colors[name])
    ax[1].axhspan(0, 0.4, xmin=0, xmax=1, color="tab:green", alpha=0.05)
    ax[1].set_xscale("log", base=2)
    ax[1].set_xlabel("groups G")
    ax[1].set_ylabel("fraction of samples moved")
    ax[1].set_ylim(0, 1)
    ax[1].set_title("movement (mean over m and distributions)")
    ax[1].legend()
    for name in ("identity", "lpt", "balanced"):
        ms = result["balancers"][name]["plan_ms_by_size"]
        pts = sorted((int(k.split("x")[0]) * int(k.split("x")[1]), v) for k, v in ms.items())
        bs = sorted({b for b, _ in pts})
        ax[2].plot(bs, [max(v for b2, v in pts if b2 == b) for b in bs], "o-", label=name, color=colors[name])
    ax[2].axhline(1.0, color="tab:red", lw=0.8, ls="--")
    ax[2].set_xscale("log", base=2)
    ax[2].set_yscale("log")
    ax[2].set_xlabel("samples B (slowest G at each B)")
    ax[2].set_ylabel("planning ms (median)")
    ax[2].set_title("planning time, single process")
    ax[2].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small grid, 1 seed: a smoke run in seconds")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="timed calls per instance")
    p.add_argument("--big-reps", type=int, default=20, help="timed calls per 1024x64 instance")
    p.add_argument("--exact-limit", type=float, default=1.0, help="MILP seconds per instance (0: off)")
    p.add_argument("--exact-max-b", type=int, default=64, help="largest B handed to the MILP")
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    args = p.parse_args(argv)
    groups_grid, per_group, seeds = GROUPS, PER_GROUP, args.seeds
    if args.quick:
        groups_grid, per_group, seeds = (2, 8, 64), (1, 4, 16), 1
        args.reps, args.big_reps, args.exact_limit = 1, 5, min(args.exact_limit, 0.2)
    stem = "balance_quick" if args.quick else "balance"
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    args.json = args.json or os.path.join(here, stem + ".json")
    args.png = args.png or os.path.join(here, stem + ".png")

    t0 = time.time()
    rows, times = [], {name: {} for name in BALANCERS}
    for dist in DISTS:
        for g in groups_grid:
            for m in per_group:
                for seed in range(seeds):
                    c = vlm_costs(dist, g * m, seed)
                    row = {"dist": dist, "G": g, "m": m, "seed": seed}
                    for name, fn in BALANCERS.items():
                        order = fn(c, g)
                        reps = args.big_reps if (g, m) == (64, 16) else args.reps
                        times[name].setdefault((g, m), []).extend(times_ms(lambda: fn(c, g), reps))
                        row[name] = {"max": max_load(c, order, g), "moved": moved_fraction(order, g)}
                    best = min(row[name]["max"] for name in BALANCERS)
                    row["opt"], row["proven"] = optimum(c, g, best, args)
                    for name in BALANCERS:
                        row[name]["ratio"] = row[name]["max"] / row["opt"] if row["opt"] > 0 else 1.0
                    rows.append(row)
    elapsed = time.time() - t0

    result = {
        "command": "python bench/balance.py" + (" --quick" if args.quick else ""),
        "grid": {"distributions": list(DISTS), "groups": list(groups_grid), "per_group": list(per_group),
                 "seeds": seeds, "instances": len(rows),
                 "proven_optimum_fraction": float(np.mean([r["proven"] for r in rows])),
                 "exact_limit_s": args.exact_limit, "exact_max_b": args.exact_max_b},
        "host": {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
                 "machine": platform.machine()},
        "elapsed_s": elapsed,
        "balancers": {name: summarize(rows, name, times) for name in BALANCERS},
        "instances": [{k: (v if not isinstance(v, dict) else {kk: round(vv, 6) for kk, vv in v.items()})
                       for k, v in r.items()} for r in rows],
    }

    print(f"{len(rows)} instances ({result['grid']['proven_optimum_fraction']:.0%} with a proven optimum, "
          f"the rest against a lower bound) in {elapsed:.0f} s")
    print()
    print("| balancer | ratio median | ratio p95 | ratio max | optimal | moved G4-8 | moved G32-64 "
          "| plan ms 1024x64 (p10-p90) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in result["balancers"].items():
        big = (f"{s['plan_ms_1024x64']:.3f} ({s['plan_ms_1024x64_p10_p90'][0]:.2f}-"
               f"{s['plan_ms_1024x64_p10_p90'][1]:.2f})") if s["plan_ms_1024x64"] is not None else "-"
        print(f"| {name} | {s['ratio_median']:.4f} | {s['ratio_p95']:.4f} | {s['ratio_max']:.4f} | "
              f"{s['optimal_fraction']:.0%} | {s['moved_fraction_g4_8']:.3f} | "
              f"{s['moved_fraction_g32_64'] if s['moved_fraction_g32_64'] is not None else float('nan'):.3f} "
              f"| {big} |")
    print()
    print("moved fraction by G:   " + "  ".join(f"G={g}" for g in groups_grid))
    for name in ("lpt", "balanced"):
        by = result["balancers"][name]["moved_fraction_by_groups"]
        print(f"  {name:9s}" + "".join(f"{by[str(g)]:7.3f}" for g in groups_grid))
    print()
    print("planning ms (median) by G x m:")
    for name in ("lpt", "balanced"):
        ms = result["balancers"][name]["plan_ms_by_size"]
        print(f"  {name:9s}" + " ".join(f"{k}:{v:.2f}" for k, v in ms.items()))
    above = result["balancers"]["balanced"]["max_load_above_lpt"]
    print(f"\nbalanced above lpt on {above} of {len(rows)} instances")

    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, rows, args.png)
    print(f"wrote {args.json} and {args.png}")
    return result


if __name__ == "__main__":
    main()
