"""`python -m reorder demo`: a heterogeneous MIMO layout (default vision dp 2 + language dp 4) on
real torch.distributed CPU processes (Gloo, fork start), streaming synthetic Qwen-VL-like
micro-batches through `ReorderingBuffer` + `WindowExchanger`, checking every window that the
modules stay aligned and every sample arrives byte-exact (I1-I8), and ending with a summary table.

Every rank generates the same seeded global stream and reads its own contiguous share (scalable
reads). After each window every rank checks its own output (I3, I4 its rank, I5 byte-exact against
the spec's per-sample view of the natural batch), then one world-wide `all_gather_object` shares
sample ids, orders and figures, and every rank runs the same cross-module checks (I1, I2, I4 bridge
alignment, I6, I7, I8 and, for "lpt", equality with the spec's reference), so all ranks stop
together on a violation. `--emulated` runs the old in-process path (threads, support.harness).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
from collections import deque

import numpy as np

from reorder.cli.common import CliError, check_plot_path, human_stream, make_plot, plural, worse_note, write_json
from reorder.plan.window import spreads

MODULES = ("vision", "language")


def add_args(p: argparse.ArgumentParser):
    from reorder.cli import synthetic as syn
    from reorder.plan.balancers import BALANCERS
    from reorder.integrations.config import ReorderConfig

    p.add_argument("--vision-dp", type=int, default=2, help="vision encoder DP size (default 2)")
    p.add_argument("--language-dp", type=int, default=4, help="language model DP size (default 4)")
    p.add_argument("--micro-batch", type=int, default=16,
                   help="global micro-batch size B, a multiple of lcm(DP sizes) (default 16)")
    p.add_argument("--window", type=int, default=1, help="micro-batches per exchange window W (default 1)")
    p.add_argument("--windows", type=int, default=12, help="number of windows to stream (default 12)")
    default = ReorderConfig().balancer
    p.add_argument("--balancer", default=default, choices=sorted(BALANCERS),
                   help=f"default {default}, the library default (ReorderConfig.megatron_mimo_reorder_balancer)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="exchange the next window on a background thread (default on)")
    p.add_argument("--seq-len", type=int, default=2048, help="padded sequence length S (default 2048)")
    p.add_argument("--features", type=int, default=64, help="patch feature width (default 64)")
    p.add_argument("--mix", default="realistic", choices=sorted(syn.SIZE_MIXES),
                   help="image size mix (default realistic)")
    p.add_argument("--language-weight", type=float, default=0.0,
                   help="cost weight of real text tokens (default 0: cost = patches)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic stream (default 0)")
    p.add_argument("--emulated", action="store_true",
                   help="run the ranks as threads in this process instead of real processes")
    p.add_argument("--inject-corruption", action="store_true", help=argparse.SUPPRESS)  # the checks' self-test
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds (default 300)")
    p.add_argument("--plot", metavar="FILE.png", help="bar chart of per-rank load before/after (.png, .pdf or "
                   ".svg; needs matplotlib)")
    p.add_argument("--json", metavar="FILE", help="write the summary as JSON to FILE ('-': stdout)")


# ---- shared by both paths ------------------------------------------------------------------------


def _validate(args) -> dict:
    from reorder.plan.grid import canonical_grid

    dps = {"vision": args.vision_dp, "language": args.language_dp}
    for name, d in dps.items():
        if d < 1:
            raise CliError(f"--{name}-dp {d} is invalid: must be >= 1")
    if args.vision_dp > args.language_dp:
        raise CliError(f"--vision-dp {args.vision_dp} exceeds --language-dp {args.language_dp}: Megatron MIMO "
                       "requires encoder dp <= language dp")
    groups = canonical_grid(list(dps.values()))
    if args.micro_batch < 1 or args.micro_batch % groups:
        raise CliError(f"--micro-batch {args.micro_batch} is not a positive multiple of the canonical grid "
                       f"G = lcm({args.vision_dp}, {args.language_dp}) = {groups}")
    for flag in ("window", "windows"):
        if getattr(args, flag) < 1:
            raise CliError(f"--{flag} {getattr(args, flag)} is invalid: must be >= 1")
    if args.seq_len < 16:
        raise CliError(f"--seq-len {args.seq_len} is too short: use >= 16")
    if args.features < 1:
        raise CliError(f"--features {args.features} is invalid: must be >= 1")
    if not (args.language_weight >= 0):
        raise CliError(f"--language-weight {args.language_weight} is invalid: must be >= 0")
    if not args.emulated and args.vision_dp + args.language_dp > 64:
        raise CliError(f"{args.vision_dp + args.language_dp} processes is too many for a CPU demo (at most 64)")
    check_plot_path(args.plot)
    return dps


def _cost(language_weight: float):
    from reorder.plan.cost import CostModel

    return CostModel(encoder_weight=1.0, language_weight=language_weight)


def _stream(cfg: dict):
    """The seeded global micro-batch stream, identical on every rank."""
    from reorder.cli import synthetic as syn

    rng = np.random.default_rng(cfg["seed"])
    B = cfg["micro_batch"]
    for k in range(cfg["windows"] * cfg["window"]):
        yield syn.make_global_batch(rng, B, cfg["seq_len"], features=cfg["features"], mix=cfg["mix"],
                                    first_id=k * B)


def _record(module_reports: dict, wait_ms: dict | None = None) -> dict:
    """One window's module-wide figures: module -> list of WindowReports of its ranks."""
    rec = {}
    for m, reps in module_reports.items():
        r0 = reps[0]
        rec[m] = dict(loads_before=r0.loads_before.tolist(), loads_after=r0.loads_after.tolist(),
                      moved_samples=r0.moved_samples, total_samples=r0.total_samples, moved_bytes=r0.moved_bytes,
                      plan_ms=r0.plan_ms, exchange_ms=max(r.exchange_ms for r in reps),
                      wait_ms=None if wait_ms is None else wait_ms[m])
    return rec


def _progress_line(k: int, n: int, t0: float, rec: dict) -> str:
    parts = []
    for m, r in rec.items():
        lb, la = np.asarray(r["loads_before"]), np.asarray(r["loads_after"])
        parts.append(f"{m} spread {spreads(lb).mean():.2f}->{spreads(la).mean():.2f}, moved "
                     f"{r['moved_samples']}/{r['total_samples']} ({r['moved_bytes'] / 2**20:.1f} MiB)")
    return f"  window {k + 1:{len(str(n))}d}/{n} {time.perf_counter() - t0:5.1f} s  I1-I8 ok | " + " | ".join(parts)


# ---- real processes ------------------------------------------------------------------------------


def _checks():
    """The invariant checks against spec/ (support.checks), or None outside a checkout: spec/ and
    support/ live in the repository, not in the installed package."""
    try:
        from support import checks
    except ImportError:
        return None
    return checks


class _DemoRank:
    """One process of the demo world (ranks [0, dv) are vision, [dv, dv + dl) language): its
    groups, exchanger and buffer over the shared stream, and the checks of each window."""

    def __init__(self, rank: int, world: int, cfg: dict):
        from reorder.cli import synthetic as syn
        from reorder.exchange.dist import build_groups
        from reorder.exchange.exchanger import WindowExchanger
        from reorder.integrations.megatron import select_fields
        from reorder.runtime.buffer import ReorderingBuffer
        from reorder.cli.synthetic import module_fields

        dv, dl = cfg["vision_dp"], cfg["language_dp"]
        self.rank, self.world, self.cfg = rank, world, cfg
        self.dps = {"vision": dv, "language": dl}
        groups = build_groups({"vision": [list(range(dv))], "language": [list(range(dv, dv + dl))]},
                              device="cpu", overlap=cfg["overlap"],
                              timeout=datetime.timedelta(seconds=cfg["pg_timeout"]))
        self.module, self.grid = groups.module, groups.grid
        self.cost = _cost(cfg["language_weight"])
        self.fields = module_fields(self.module, self.cost)
        ex = WindowExchanger(grid=self.grid, micro_batch_size=cfg["micro_batch"], cost=self.cost,
                             balancer=cfg["balancer"], window_size=cfg["window"],
                             collectives=groups.side if cfg["overlap"] else groups.main)
        self.pending = deque()  # natural global batches, handed from the (possibly background) reader to the checker

        def source():
            for g in _stream(cfg):
                self.pending.append(g)
                yield select_fields(syn.rank_share(g, self.grid.dp, self.grid.rank), self.fields)

        self.buf = ReorderingBuffer(source(), ex, overlap=cfg["overlap"])

    def read_window(self, k: int):
        """(the window's natural global batches, what this rank shares of window k: its sample ids,
        orders, report and wait, or the error it hit)."""
        checks = _checks()
        cfg, grid = self.cfg, self.grid
        outs, window, error, report = [], [], None, None
        t_wait = time.perf_counter()
        try:
            for _ in range(cfg["window"]):
                outs.append(next(self.buf))
            if cfg["corrupt"] and k == cfg["windows"] - 1 and self.rank == self.world - 1:  # the checks' self-test
                outs[-1] = dict(outs[-1], position_ids=outs[-1]["position_ids"].clone())
                outs[-1]["position_ids"].view(-1)[-1] += 1
            wait_ms = (time.perf_counter() - t_wait) * 1e3
            report = self.buf.last_report
            window = [self.pending.popleft() for _ in outs]
            for s, (g, got) in enumerate(zip(window, outs) if checks else ()):  # I3, I4 (this rank), I5
                checks.check_rank(g, got, report.orders[s], grid.dp, grid.rank, fields=self.fields,
                                  vision_start_token_id=self.cost.vision_start_token_id)
        except Exception as e:  # noqa: BLE001 - shared with every rank, then all stop together
            error = f"{self.module} rank {grid.rank}: {type(e).__name__}: {e}"
            wait_ms = 0.0
        return window, dict(module=self.module, rank=grid.rank, error=error,
                            ids=[o["sample_id"].tolist() for o in outs] if error is None else None,
                            orders=None if report is None else report.orders.tolist(), report=report,
                            wait_ms=wait_ms)

    def world_errors(self, window, by_module: dict) -> list:
        """Every rank's error, else the cross-module checks' (the same verdict on every rank)."""
        errors = [e["error"] for ranks in by_module.values() for e in ranks if e["error"]]
        if errors or _checks() is None:
            return errors
        from support import checks
        from support.harness import module_costs

        try:
            checks.check_world(window, {m: [e["ids"] for e in ranks] for m, ranks in by_module.items()},
                               {m: [np.asarray(e["orders"]) for e in ranks] for m, ranks in by_module.items()},
                               {m: module_costs(window, m, self.cost) for m in self.dps}, self.dps,
                               groups=self.grid.size, balancer=self.cfg["balancer"])
        except Exception as e:  # noqa: BLE001 - every rank reaches the same verdict on the same data
            return [f"{type(e).__name__}: {e}"]
        return []

    def end_of_stream(self) -> None:
        """The end-of-stream handshake: every rank passes one empty window together."""
        try:
            next(self.buf)
            raise RuntimeError("the buffer yielded more micro-batches than the source holds")
        except StopIteration:
            pass


def _rank_main(rank: int, world: int, cfg: dict):
    """One process of the demo world; rank 0 returns the run's records (or where it failed)."""
    import torch.distributed as dist

    out = sys.stderr if cfg["stderr"] else sys.stdout
    me = _DemoRank(rank, world, cfg)
    records, t0 = [], time.perf_counter()
    try:
        for k in range(cfg["windows"]):
            window, mine = me.read_window(k)
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
            by_module = {m: sorted((e for e in everyone if e["module"] == m), key=lambda e: e["rank"]) for m in me.dps}
            errors = me.world_errors(window, by_module)
            if errors:
                return dict(failed=f"window {k + 1}: " + "; ".join(errors), records=records) if rank == 0 else None
            if rank == 0:
                rec = _record({m: [e["report"] for e in ranks] for m, ranks in by_module.items()},
                              {m: max(e["wait_ms"] for e in ranks) for m, ranks in by_module.items()})
                records.append(rec)
                print(_progress_line(k, cfg["windows"], t0, rec), file=out, flush=True)
        me.end_of_stream()
    finally:
        me.buf.close()
    return dict(failed=None, records=records, elapsed_s=time.perf_counter() - t0) if rank == 0 else None


def _run_processes(args, dps, out) -> dict:
    from reorder.cli.processes import ProcessesFailed, run_processes

    cfg = {k: getattr(args, k) for k in ("vision_dp", "language_dp", "micro_batch", "window", "windows", "balancer",
                                         "overlap", "seq_len", "features", "mix", "language_weight", "seed")}
    cfg["stderr"] = out is sys.stderr
    cfg["corrupt"] = args.inject_corruption
    cfg["pg_timeout"] = min(120.0, args.timeout)
    try:
        return run_processes(_rank_main, sum(dps.values()), (cfg,), timeout=args.timeout,
                             pg_timeout=cfg["pg_timeout"])
    except ProcessesFailed as e:
        raise CliError(f"demo failed: {e}", code=1) from None


# ---- emulated ranks (threads) --------------------------------------------------------------------


def _run_emulated(args, dps, out) -> dict:
    from reorder.cli.emulated import run_window

    checks, cost = _checks(), _cost(args.language_weight)
    cfg = {k: getattr(args, k) for k in ("micro_batch", "window", "windows", "seq_len", "features", "mix", "seed")}
    stream = _stream(cfg)
    records, t0 = [], time.perf_counter()
    for k in range(args.windows):
        batches = [next(stream) for _ in range(args.window)]
        results = run_window(batches, dps, cost=cost, balancer=args.balancer)
        try:
            if checks is not None:  # in a checkout: every invariant of spec/ on the window
                from support import harness

                harness.check_window(batches, results, cost=cost, balancer=args.balancer,
                                     vision_start_token_id=cost.vision_start_token_id)
        except AssertionError as e:
            return dict(failed=f"window {k + 1}: {type(e).__name__}: {e}", records=records)
        rec = _record({m: res.reports for m, res in results.items()})
        records.append(rec)
        print(_progress_line(k, args.windows, t0, rec), file=out, flush=True)
    return dict(failed=None, records=records, elapsed_s=time.perf_counter() - t0)


# ---- summary -------------------------------------------------------------------------------------


def summarize(records: list, dps: dict) -> dict:
    """Per module: per-rank loads summed over every micro-batch, straggler cost (sum over
    micro-batches of the max per-rank cost) before/after, mean spread, moved samples and bytes,
    median plan / exchange / wait time per window."""
    out = {}
    for m, d in dps.items():
        lb = np.concatenate([np.asarray(r[m]["loads_before"]) for r in records]).reshape(-1, d)
        la = np.concatenate([np.asarray(r[m]["loads_after"]) for r in records]).reshape(-1, d)
        before, after = float(lb.max(axis=1).sum()), float(la.max(axis=1).sum())
        waits = [r[m]["wait_ms"] for r in records if r[m]["wait_ms"] is not None]
        out[m] = dict(dp=d, loads_before=lb.sum(axis=0).tolist(), loads_after=la.sum(axis=0).tolist(),
                      straggler_before=before, straggler_after=after,
                      saved=1 - after / before if before else 0.0,
                      spread_before=float(spreads(lb).mean()), spread_after=float(spreads(la).mean()),
                      moved_samples=int(sum(r[m]["moved_samples"] for r in records)),
                      samples=int(sum(r[m]["total_samples"] for r in records)),
                      moved_bytes=int(sum(r[m]["moved_bytes"] for r in records)),
                      plan_ms=float(np.median([r[m]["plan_ms"] for r in records])),
                      exchange_ms=float(np.median([r[m]["exchange_ms"] for r in records])),
                      wait_ms=float(np.median(waits)) if waits else None)
    return out


def print_tables(summary: dict, micro_batches: int, out) -> None:
    width = max(8, *(len(f"{x:.0f}") + 1 for s in summary.values() for x in s["loads_before"] + s["loads_after"]))
    maxdp = max(s["dp"] for s in summary.values())
    print(f"\nper-rank load (cost = patches, summed over {plural(micro_batches, 'micro-batch')})", file=out)
    print(f"{'module':9} {'dp':>3} {'':7}" + "".join(f"{'rank ' + str(r):>{width}}" for r in range(maxdp)), file=out)
    for m, s in summary.items():
        for label, key in (("before", "loads_before"), ("after", "loads_after")):
            head = f"{m:9} {s['dp']:3d}" if label == "before" else f"{'':13}"
            print(f"{head} {label:7}" + "".join(f"{x:{width}.0f}" for x in s[key]), file=out)
    print(f"\n{'module':9} {'dp':>3} {'straggler cost':>15} {'after':>10} {'saved':>7} {'spread':>15} "
          f"{'moved samples':>14} {'MiB moved':>10} {'plan ms':>8} {'exchange ms':>12} {'wait ms':>8}", file=out)
    for m, s in summary.items():
        wait = "-" if s["wait_ms"] is None else f"{s['wait_ms']:.2f}"
        print(f"{m:9} {s['dp']:3d} {s['straggler_before']:15.0f} {s['straggler_after']:10.0f} {s['saved']:7.1%} "
              f"{s['spread_before']:6.3f} -> {s['spread_after']:5.3f} {s['moved_samples']:>6d}/{s['samples']:<7d} "
              f"{s['moved_bytes'] / 2**20:10.2f} {s['plan_ms']:8.3f} {s['exchange_ms']:12.2f} {wait:>8}", file=out)


def run(args) -> dict:
    dps = _validate(args)
    out = human_stream(args)
    from reorder.plan.grid import canonical_grid

    groups = canonical_grid(list(dps.values()))
    mode = "emulated ranks (threads)" if args.emulated else \
        f"{sum(dps.values())} processes (torch.distributed, Gloo, fork)"
    print(f"reorder demo: vision dp {args.vision_dp} + language dp {args.language_dp} (grid G={groups}) on {mode}; "
          f"B={args.micro_batch}, W={args.window}, {plural(args.windows, 'window')}, balancer {args.balancer}, "
          f"overlap {'on' if args.overlap and not args.emulated else 'off'}, seq {args.seq_len}, mix {args.mix}",
          file=out, flush=True)
    if args.language_dp % args.vision_dp:
        print(f"note: language dp {args.language_dp} is not a multiple of vision dp {args.vision_dp} (no Megatron "
              "bridge fan-out for this layout): cross-module alignment is checked through the shared canonical "
              "order (I2, I8), not rank by rank (I4 bridge)", file=out, flush=True)
    t0 = time.perf_counter()
    result = _run_emulated(args, dps, out) if args.emulated else _run_processes(args, dps, out)
    if result["failed"]:
        raise CliError(f"demo failed at {result['failed']}", code=1)
    summary = summarize(result["records"], dps)
    micro_batches = args.windows * args.window
    print_tables(summary, micro_batches, out)
    for m, s in summary.items():
        note = worse_note(m, s["dp"], s["saved"], args.balancer, groups)
        if note:
            print(note, file=out)
    elapsed = time.perf_counter() - t0
    verdict = (f"all invariants (I1-I8: alignment of vision rank v with language ranks v*k..v*k+k-1, byte-exact "
               f"payloads, ...) held on {plural(args.windows, 'window')}" if _checks() else
               "invariants not checked: the checks read spec/ and support/, which are in the repository, not in the "
               "installed package (run the demo from a checkout to check I1-I8)")
    print(f"\n{verdict}; {elapsed:.1f} s.\nstraggler cost = sum over micro-batches "
          "of the max per-rank cost; spread = max/mean per-rank cost (mean over micro-batches); "
          "wait = time the consumer blocked for a window", file=out, flush=True)
    data = dict(mode="emulated" if args.emulated else "processes",
                config={k: v for k, v in vars(args).items() if k not in ("command", "json", "plot")},
                groups=groups, micro_batches=micro_batches, elapsed_s=elapsed,
                invariants="I1-I8 held on every window" if _checks() else "not checked",
                modules=summary)
    if args.plot:
        panels = {m: dict(dp=s["dp"], before=s["loads_before"], after=s["loads_after"],
                          note=f"{m} (dp {s['dp']}): spread {s['spread_before']:.2f} -> {s['spread_after']:.2f}, "
                               f"straggler -{s['saved']:.1%}") for m, s in summary.items()}
        make_plot("plot_rank_loads", args.plot, panels,
                  f"reorder demo: per-rank load, {plural(micro_batches, 'micro-batch')} of B={args.micro_batch}, "
                  f"balancer {args.balancer} (spread = max/mean per micro-batch)",
                  f"cost (patches) summed over {plural(micro_batches, 'micro-batch')}")
        print(f"plot written to {args.plot}", file=out)
    write_json(args.json, data)
    return data
