"""What one GPU can show of the exchange: dp-1 windows (a local reorder) against what reorder off
does, the host time and the torch ops of one window, and planning at the largest MIMO sizes.

  python bench/single_gpu.py [--device cuda] [--reps 50] [--out bench/results/single_gpu.json]

Keys (JSON, printed as a table; times are medians over --reps, side by side in one process):
- dp1_exchange_ms / to_device_ms / dp1_over_to_device_ms: a micro-batch of 4 from pinned host
  memory reordered onto the device (permuted windows), against `.to(device)` of every field (what
  reorder off does), synchronized; the difference is what reordering adds;
- dp1_early_copy_ms / dp1_early_copy_over_to_device_ms: the same with `early_copy=True` (each
  field copied to the device by DMA as soon as the micro-batch is counted, under the planning);
- dp1_perm_ms_mb4: the same micro-batch already on the device, permuted, synchronized;
- host_ms_per_window: host time of that device-resident window's exchange call (count, plan, move
  list, pack and reassembly launches), not synchronized;
- ops_per_window: torch ops the call dispatches (counted with a TorchDispatchMode);
- plan_ms_<B>x<G> / moves_ms_<B>x<G>: `plan_window` (default balancer) and one rank's `build_moves`
  for B samples over G = dp ranks, on the host; plan_ms_lpt_<B>x<G>: the same plan by balancer
  "lpt", timed alternately with the default one; plan_quality: per balancer and size, the planned
  max / mean rank load and the fraction of samples that change rank (what the planning time buys);
- dp1_stages_ms: the device-resident window's stages, each synchronized (prepare: count and
  describe; gather; plan; pack: move list, sources and the pack launch; all_to_all; assemble);
- executor: which executor carried the copies.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import Count, code_commit, median_ms, synchronizer, times_ms  # noqa: E402
from reorder import CostModel, Grid, WindowExchanger  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.plan.counts import SampleCounts  # noqa: E402
from reorder.plan.moves import ByteField, build_moves  # noqa: E402
from reorder.plan.window import PlanSettings, plan_window  # noqa: E402

COST = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)


def permuted_batches(mb, seq, features, mix, count=8):
    """`count` micro-batches whose dp-1 plan permutes them (a natural one would copy nothing)."""
    rng, out = np.random.default_rng(7), []
    probe = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=mb, cost=COST)
    while len(out) < count:
        g = syn.make_global_batch(rng, mb, seq, features=features, mix=mix)
        if (probe.exchange([g])[1].orders != np.arange(mb)).any():
            out.append(g)
    return out


def dp1(args, dev) -> dict:
    sync = synchronizer(dev)
    host = permuted_batches(args.micro_batch, args.seq_len, args.features, args.mix)
    pinned = [syn.pin(g) for g in host] if dev.type == "cuda" else host
    resident = [syn.to_device(g, dev) for g in host]
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=args.micro_batch, cost=COST, device=dev)
    early = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=args.micro_batch, cost=COST,
                            device=dev, early_copy=True)
    k = iter(range(10**9))
    res = dict(dp1_exchange_ms=median_ms(lambda: ex.exchange([pinned[next(k) % 8]]), args.reps, sync, warmup=1),
               dp1_early_copy_ms=median_ms(lambda: early.exchange([pinned[next(k) % 8]]), args.reps, sync, warmup=1),
               to_device_ms=median_ms(lambda: syn.to_device(pinned[next(k) % 8], dev, non_blocking=True),
                                      args.reps, sync, warmup=1),
               dp1_perm_ms_mb4=median_ms(lambda: ex.exchange([resident[next(k) % 8]]), args.reps, sync, warmup=1))
    res["dp1_over_to_device_ms"] = res["dp1_exchange_ms"] - res["to_device_ms"]
    res["dp1_early_copy_over_to_device_ms"] = res["dp1_early_copy_ms"] - res["to_device_ms"]
    sync()
    host_ms = []
    for i in range(args.reps):
        t = time.perf_counter()
        ex.exchange([resident[i % 8]])
        host_ms.append((time.perf_counter() - t) * 1e3)
        sync()
    res["host_ms_per_window"] = float(np.median(host_ms))
    staged = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=args.micro_batch, cost=COST,
                             device=dev, profile_stages=True)
    stages = [staged.exchange([resident[i % 8]])[1].stage_ms for i in range(args.reps)]
    res["dp1_stages_ms"] = {k: float(np.median([s[k] for s in stages])) for k in stages[0]}
    with Count() as c:
        ex.exchange([resident[0]])
    res["ops_per_window"] = sum(c.ops.values())
    res["ops_by_kind"] = dict(collections.Counter({op: n for op, n in c.ops.items()}).most_common(12))
    res["executor"] = ex.round._executor(resident[0]["input_ids"].device).name
    return res


def profile(args, dev) -> None:
    """Where the host time of device-resident dp-1 windows goes (cProfile, sorted by own time)."""
    import cProfile
    import pstats

    batches = [syn.to_device(g, dev) for g in permuted_batches(args.micro_batch, args.seq_len, args.features,
                                                                args.mix)]
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=args.micro_batch, cost=COST, device=dev)
    ex.exchange([batches[0]])
    pr = cProfile.Profile()
    pr.enable()
    for i in range(args.reps):
        ex.exchange([batches[i % len(batches)]])
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def planning(sizes, reps) -> dict:
    rng, out = np.random.default_rng(0), {"plan_quality": {}}
    fields = (ByteField("dense", 1, 16384), ByteField("dense", 3, 16384), ByteField("row", 1, 2352),
              ByteField("image", 1, 24))
    for batch, groups in sizes:
        ph = rng.integers(250, 4000, size=(1, batch)) * (rng.random((1, batch)) > 0.3)
        counts = SampleCounts.of(placeholders=ph, real_tokens=rng.integers(100, 4096, size=(1, batch)),
                                 images=(ph > 0).astype(np.int64), rows=ph * 4)
        grid, size = Grid(size=groups, dp=groups, rank=groups // 2), f"{batch}x{groups}"
        settings = {"balanced": PlanSettings(), "lpt": PlanSettings(balancer="lpt")}
        plans = {name: plan_window(counts, COST, grid, s) for name, s in settings.items()}  # untimed first calls
        times = {name: [] for name in settings}
        for _ in range(reps):  # alternately, so both see the same machine state
            for name, s in settings.items():
                times[name] += times_ms(lambda: plan_window(counts, COST, grid, s), 1)
        out[f"plan_ms_{size}"] = float(np.median(times["balanced"]))
        out[f"plan_ms_lpt_{size}"] = float(np.median(times["lpt"]))
        for name, plan in plans.items():
            out["plan_quality"].setdefault(name, {})[size] = dict(
                max_over_mean=float(plan.loads_after.max() / plan.loads_after.mean()),
                moved=float(plan.moved.mean()))
        plan = plans["balanced"]
        out[f"moves_ms_{size}"] = median_ms(lambda: build_moves(fields, counts, plan, grid.rank), reps, warmup=1)
    return out


def window_options(p: argparse.ArgumentParser, reps: int) -> None:
    """The options that shape the timed window (shared with bench/host_parts.py)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--features", type=int, default=1176)
    p.add_argument("--mix", default="large")
    p.add_argument("--reps", type=int, default=reps)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    window_options(p, reps=50)
    p.add_argument("--plan-sizes", default="1024x64,8192x1024")
    p.add_argument("--profile", action="store_true", help="also print the top of a cProfile of dp-1 windows")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "single_gpu.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    res = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__,
               micro_batch=args.micro_batch, seq_len=args.seq_len, features=args.features, mix=args.mix,
               commit=code_commit())
    res.update(dp1(args, dev))
    if args.profile:
        profile(args, dev)
    res.update(planning([tuple(int(x) for x in s.split("x")) for s in args.plan_sizes.split(",")], args.reps))
    for k, v in res.items():
        if k not in ("ops_by_kind", "dp1_stages_ms", "plan_quality"):
            print(f"{k:28s} {v:.3f}" if isinstance(v, float) else f"{k:28s} {v}")
    print("dp1_stages_ms", {k: round(v, 3) for k, v in res["dp1_stages_ms"].items()})
    for name, q in res["plan_quality"].items():
        print(f"plan_quality {name:9s}", {k: {f: round(v, 4) for f, v in r.items()} for k, r in q.items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
