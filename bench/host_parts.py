"""Where the host time of a device-resident dp-1 window goes: each part of `WindowExchanger.exchange`
timed alone in a loop (host time, not synchronized, median per call), next to the whole call.

  python bench/host_parts.py [--device cuda] [--reps 200] [--out bench/results/host_parts.json]

Parts: count (input_ids / attention_mask counting, its one host copy included), describe (the
layout walk), plan (`plan_window`), moves (`build_moves`), outputs (`empty_shard` of every output
slot), and the executor's run on the assemble table, split into its table checks, `launch_table`,
and the launch itself where the executor is Triton (staging, table copy, kernel). Next to each time,
what one call of the part runs, counted (`calls`: the same on every host, unlike times): Python
lines and function calls, and C calls into numpy, torch and others (JSON key "calls"). Then whole
windows of W = 1, 2, 4, 8 micro-batches (`--window-sizes`): host time per window and per micro-batch,
and lines per window (JSON key "by_window_size"). `--profile`
also prints the top of a cProfile of whole windows; `--no-copies` replaces the executor by one that
copies nothing, so on a CPU the window's own host work is timed without the torch executor's copies.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import code_commit  # noqa: E402
from bench.single_gpu import COST, permuted_batches, profile, window_options  # noqa: E402
from reorder import Grid, WindowExchanger  # noqa: E402
from reorder.batch.blocks import byte_fields, empty_shard, field_buffers, unit_bytes  # noqa: E402
from reorder.batch.layout import describe, grid_thw_of  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.exchange.executors import check_bounds, launch_table  # noqa: E402
from reorder.plan.counts import SampleCounts  # noqa: E402
from reorder.plan.moves import build_moves  # noqa: E402
from reorder.plan.window import plan_window  # noqa: E402
from reorder.batch.counting import count_samples


def _library(fn) -> str:
    """"numpy", "torch" or "other": whose C function `fn` is (a c_call of sys.setprofile)."""
    owner = getattr(fn, "__self__", None)
    if isinstance(fn, np.ufunc) or isinstance(owner, np.ufunc):
        return "numpy"
    module = getattr(fn, "__module__", None) or (type(owner).__module__ if owner is not None else "")
    root = module.split(".")[0]
    return root if root in ("numpy", "torch") else "other"


def calls(fn) -> dict:
    """What one call of fn() executes below fn, counted (deterministic, unlike its time): Python lines
    and function calls (library code included), and C calls into numpy, into torch, and others
    (builtins, methods of lists and dicts)."""
    fn()
    out = {"lines": 0, "python": 0, "numpy": 0, "torch": 0, "other": 0}

    def line(frame, event, arg):
        if event == "line":
            out["lines"] += 1
        return line

    def call(frame, event, arg):
        if event == "call":
            out["python"] += 1
        elif event == "c_call":
            out[_library(arg)] += 1

    here = sys._getframe()
    sys.settrace(lambda frame, event, arg: None if frame.f_back is here else line)  # fn's own lines not counted
    sys.setprofile(call)
    try:
        fn()
    finally:
        sys.setprofile(None)
        sys.settrace(None)
    out["python"] -= 1  # fn itself
    out["other"] -= 1  # sys.setprofile(None)
    return out


def host_us(fn, reps: int) -> float:
    """Median host time of fn() in microseconds, after two untimed calls."""
    fn()
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return float(np.median(out) * 1e6)


class _NoCopies:
    """An executor that checks nothing and copies nothing (`--no-copies`)."""

    name, reads_pinned_host = "none", False

    def run(self, segments, sources, destinations, held=None) -> None:
        pass


def _exchanger(args, dev, window_size: int = 1) -> WindowExchanger:
    """The dp-1 exchanger every timing here uses (`--no-copies`: with an executor that copies nothing)."""
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=args.micro_batch, cost=COST,
                         device=dev, window_size=window_size)
    if args.no_copies:
        ex.round._executors[dev] = _NoCopies()
    return ex


def parts(args, dev, batches) -> dict:
    b = batches[0]
    ex = _exchanger(args, dev)
    ex.exchange([b])
    window = ex.round._prepare([b])
    counts = window.counts
    layout = window.layout
    plan = plan_window(counts, COST, ex.grid, ex.round.settings, unit_bytes(layout))
    fields = byte_fields(layout)
    moves = build_moves(fields, counts, plan, 0)
    def sources_of():  # the slots' buffers, then where the executor reads them
        return ex.round._sources(window, [t for shard, blobs in zip(window.shards, window.blobs)
                                          for t in field_buffers(layout, shard, blobs)])

    _, sources = sources_of()
    out_counts = SampleCounts(moves.out_counts.table[0])
    made = empty_shard(layout, out_counts, dev)
    executor = ex.round._executor(dev)
    addresses = check_bounds(moves.assemble, [sources[0][:0]] + sources, made[1])
    k = iter(range(10**9))
    timed = {
        "window": lambda: ex.exchange([batches[next(k) % len(batches)]]),
        "count": lambda: count_samples(COST, b["input_ids"], b["attention_mask"], grid_thw=grid_thw_of(b)),
        "describe": lambda: describe(b, args.micro_batch, vision_start_token_id=COST.vision_start_token_id,
                                     image_counts=torch.from_numpy(counts.images[0].copy())),
        "prepare": lambda: ex.round._prepare([b]),
        "plan": lambda: plan_window(counts, COST, ex.grid, ex.round.settings, unit_bytes(layout)),
        "moves": lambda: build_moves(fields, counts, plan, 0),
        "sources": sources_of,
        "outputs": lambda: empty_shard(layout, out_counts, dev),
        "check_bounds": lambda: check_bounds(moves.assemble, [sources[0][:0]] + sources, made[1]),
        "launch_table": lambda: launch_table(moves.assemble, *addresses, 16384),
        "executor_run": lambda: executor.run(moves.assemble, [sources[0][:0]] + sources, made[1]),
    }
    res = {name: host_us(fn, args.reps) for name, fn in timed.items()}
    res["calls"] = {name: calls(fn) for name, fn in timed.items()}
    res.update({
        "segments": int(len(moves.assemble)),
        "executor": executor.name,
    })
    if dev.type == "cuda":
        res["pinned_alloc"] = host_us(lambda: torch.empty(256, dtype=torch.int64, pin_memory=True), args.reps)
        staged = torch.empty(256, dtype=torch.int64, pin_memory=True)
        res["table_copy"] = host_us(lambda: staged.to(dev, non_blocking=True), args.reps)
        res["empty_cuda"] = host_us(lambda: torch.empty(1024, device=dev), args.reps)
        if executor.name == "triton":
            table = staged.to(dev)
            table[:] = 0
            res["kernel_launch"] = host_us(lambda: executor._kernel[(1,)](table, 2, BLOCK=executor.block_bytes,
                                                                        num_warps=executor.num_warps), args.reps)
    torch.cuda.synchronize() if dev.type == "cuda" else None
    return res


def by_window_size(args, dev, batches, sizes) -> dict:
    """Host time (µs, per window and per micro-batch) and executed lines of windows of W of the
    permuted `batches`, for each W in `sizes`: what the window's fixed work costs once it is shared."""
    out = {}
    for w in sizes:
        ex = _exchanger(args, dev, w)
        k = iter(range(10**9))

        def window():
            i = next(k)
            return ex.exchange([batches[(i * w + j) % len(batches)] for j in range(w)])

        us = host_us(window, args.reps)
        out[w] = {"us_per_window": us, "us_per_micro_batch": us / w, "lines_per_window": calls(window)["lines"]}
    torch.cuda.synchronize() if dev.type == "cuda" else None
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    window_options(p, reps=200)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-copies", action="store_true", help="an executor that copies nothing (host work only)")
    p.add_argument("--window-sizes", default="1,2,4,8", help="W of the windows timed whole (by_window_size)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "host_parts.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dev = torch.device(args.device)
    batches = [syn.to_device(g, dev) for g in permuted_batches(args.micro_batch, args.seq_len, args.features,
                                                               args.mix)]
    res = parts(args, dev, batches)
    print(f"{'part':14s} {'host us':>9s} {'lines':>6s} {'python':>7s} {'numpy':>6s} {'torch':>6s} {'other':>6s}")
    for k, v in res.items():
        c = res["calls"].get(k)
        if c is not None:
            print(f"{k:14s} {v:9.1f} {c['lines']:6d} {c['python']:7d} {c['numpy']:6d} {c['torch']:6d} {c['other']:6d}")
        elif isinstance(v, float):
            print(f"{k:14s} {v:9.1f}")
        elif k not in ("calls", "by_window_size", "commit"):
            print(f"{k:14s} {v:>9}")
    res["commit"] = code_commit()
    res["by_window_size"] = by_window_size(args, dev, batches, [int(w) for w in args.window_sizes.split(",")])
    print(f"\n{'W':>3s} {'us/window':>10s} {'us/micro-batch':>15s} {'lines/window':>13s}")
    for w, r in res["by_window_size"].items():
        print(f"{w:3d} {r['us_per_window']:10.1f} {r['us_per_micro_batch']:15.1f} {r['lines_per_window']:13d}")
    if args.profile:
        profile(args, dev)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
