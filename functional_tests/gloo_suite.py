"""Multi-process functional suite: a heterogeneous world (vision ranks then language ranks, one
process each) streams synthetic micro-batches through real ReorderingBuffers over torch.distributed
(Gloo on CPU, NCCL with --device cuda) and checks, every window, I1-I8 across modules and
byte-exact payloads against the spec; fault cases check that all ranks raise together.

Launch with torchrun (env:// rendezvous), e.g.
  torchrun --nproc-per-node 6 functional_tests/gloo_suite.py --vision-dp 2 --language-dp 4 --window 2
or from Python with `launch(...)` (fork start, FileStore), as tests/test_functional_gloo.py does.

--report-dir DIR: every rank writes DIR/rank<N>.json (module, DP rank, micro-batches served, error)
as soon as its stream ends, before its buffer closes and any world-wide step, so a test sees every
rank, even when peers die.
--bridge: after each micro-batch, every vision rank sends the sample ids it holds to the language
ranks it feeds, by position (point-to-point on the world group, fan-out language dp / vision dp), as
MIMO's BridgeCommunicator sends embeddings; each language rank checks they are its own (I4).
--uncaught: a rank's error ends the process with its traceback, as in a training script (no report
back to rank 0); with --bridge the other module then waits in its next bridge receive.
--verify N: the runtime self-check on every N-th window; --case corrupt (with it) flips one bit of
what language rank 0's executor writes in the window of micro-batch --fault-at, which every rank of
the module must report.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from bench.common import init_torchrun
from reorder import CostModel, WindowExchanger
from reorder.cli import synthetic as syn
from reorder.exchange.dist import build_groups
from reorder.exchange.executors import TorchExecutor
from reorder.integrations.megatron import select_fields
from reorder.plan.grid import canonical_grid
from reorder.runtime.buffer import ReorderingBuffer
from support import checks
from support.harness import module_costs, module_fields
from spec import reference as ref

CASES = ("ok", "source_raises", "bad_input", "lost_peer", "early_end", "corrupt")


def global_batches(seed, count, batch, seq_len, features):
    """The same global micro-batch stream on every rank (seeded)."""
    rng = np.random.default_rng(seed)
    for k in range(count):
        yield syn.make_global_batch(rng, batch, seq_len, features=features, mix="small", first_id=k * batch)


def faulty_module(args):
    """Where a fault case injects its fault: source errors on language, bad input on vision (when present)."""
    if args.case in ("source_raises", "corrupt") or args.vision_dp == 0:
        return "language"
    return "vision"


def rank_source(args, module, dp, rank, device):
    fields = module_fields(module, CostModel(language_weight=args.language_weight))
    for k, g in enumerate(global_batches(args.seed, args.micro_batches, args.micro_batch, args.seq_len, args.features)):
        if args.case == "source_raises" and k == args.fault_at and module == faulty_module(args) and rank == dp - 1:
            raise OSError(f"disk read failed at micro-batch {k}")
        if args.case == "early_end" and k == args.fault_at and module == faulty_module(args) and rank == 0:
            return
        share = select_fields(syn.rank_share(g, dp, rank), fields)
        if device is not None:
            share = place_inputs(share, args.inputs, k, device)
        if args.case == "bad_input" and k == args.fault_at and module == faulty_module(args) and rank == 0:
            share = dict(share, input_ids=share["input_ids"][:, :-1])  # wrong width on one rank only
        yield share


class Corrupting(TorchExecutor):
    """The torch executor, which flips one bit of the first buffer it writes bytes into in window
    `at` (counted as the round counts them): a corrupted exchange the self-check must report."""

    def __init__(self, rnd, at: int):
        super().__init__()
        self.rnd, self.at, self.done = rnd, at, False

    def run(self, segments, sources, destinations, held=None):
        super().run(segments, sources, destinations)
        written = [d for d in destinations if d.numel()]
        if not self.done and written and self.rnd._windows - 1 == self.at:
            written[0].view(-1).view(torch.uint8)[0] ^= 1
            self.done = True


def place_inputs(share: dict, inputs: str, k: int, device: torch.device) -> dict:
    """Micro-batch k of a CUDA run where --inputs puts it: on the device, in pinned or pageable host
    memory, or (mixed) every other one pinned, the others pageable."""
    if inputs == "device":
        return syn.to_device(share, device)
    if inputs == "pinned" or (inputs == "mixed" and k % 2):
        return syn.pin(share)
    return share


def rank_groups(args):
    """(device or None, this rank's groups): world-wide, so built once per run of the suite."""
    dv, dl = args.vision_dp, args.language_dp
    assert dist.get_world_size() == dv + dl, f"world size {dist.get_world_size()} != vision dp {dv} + language dp {dl}"
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else None
    modules = {"vision": [list(range(dv))], "language": [list(range(dv, dv + dl))]}
    if dv == 0:  # single-module world
        del modules["vision"]
    return device, build_groups(modules, device=device or torch.device("cpu"), overlap=args.overlap,
                                timeout=datetime.timedelta(seconds=args.timeout))


def run(args, placed=None) -> dict:
    """One stream through a ReorderingBuffer on every rank, checked; placed: `rank_groups(args)` when
    already built (a matrix run reuses one set of groups for every combination)."""
    world, me = dist.get_world_size(), dist.get_rank()
    dv, dl = args.vision_dp, args.language_dp
    device, groups = placed or rank_groups(args)
    module, grid = groups.module, groups.grid
    cost = CostModel(language_weight=args.language_weight)
    coll = groups.side if args.overlap else groups.main
    if coll is not None and args.launch_rendezvous:
        coll.launch_rendezvous = True
    ex = WindowExchanger(grid=grid, micro_batch_size=args.micro_batch, cost=cost, balancer=args.balancer,
                         window_size=args.window, collectives=coll, device=device, verify=args.verify)
    if args.case == "corrupt" and module == faulty_module(args) and grid.rank == 0:
        ex.round._executors[device or torch.device("cpu")] = Corrupting(ex.round, args.fault_at // args.window)
    source = rank_source(args, module, grid.dp, grid.rank, device)
    if args.case == "lost_peer":
        dist.barrier()  # every rank has finished connecting its groups (Gloo connects at creation)
        if me == world - 1:
            os._exit(0)  # this rank dies before its first exchange
    outs, seen_error = [], None
    buf = ReorderingBuffer(source, ex, overlap=args.overlap)
    t0 = time.perf_counter()
    try:
        try:
            for mb in buf:
                outs.append(mb)
                if args.bridge and dv:
                    bridge(mb, module, grid.rank, dv, dl)
        except Exception as e:  # noqa: BLE001 - checked below
            seen_error = e
        report = dict(rank=me, module=module, dp_rank=grid.rank, n=len(outs),
                      error=None if seen_error is None else f"{type(seen_error).__name__}: {seen_error}")
        if args.report_dir:  # before the close, which waits for the worker: a launcher's SIGTERM may end that wait
            with open(os.path.join(args.report_dir, f"rank{me}.json"), "w") as f:
                json.dump(report, f)
    finally:
        buf.close()
    elapsed = time.perf_counter() - t0
    if args.overlap:
        assert not buf.worker_alive, "overlap worker thread still alive after the stream ended"
    # everyone reports what it saw; rank 0 compares across modules
    summary = dict(report, ids=[o["sample_id"].tolist() for o in outs],
                   orders=[r.orders.tolist() for r in buf.reports], elapsed=elapsed, verified=ex.verified_windows)
    if args.uncaught and seen_error is not None:
        raise seen_error
    if args.case == "lost_peer":  # the last rank died: its module's survivors raise, in time
        if module == "language":
            assert seen_error is not None and elapsed < args.timeout * 3, (seen_error, elapsed)
        return dict(case="lost_peer", error=summary["error"], elapsed=elapsed)
    if args.case == "ok" and seen_error is None:
        check_own(args, module, grid, outs, cost)
    everyone = [None] * world
    dist.all_gather_object(everyone, summary)
    return check_world(args, everyone)


def bridge(mb, module, rank, dv, dl):
    """Vision rank v sends the sample ids of its micro-batch to language ranks v*k .. v*k+k-1 (k = dl/dv),
    slice j to rank v*k+j, as BridgeCommunicator routes embeddings by position; every language rank
    receives from vision rank r // k and checks the ids are the ones it holds (I4 across processes)."""
    k = dl // dv
    ids = mb["sample_id"].to(torch.int64).contiguous()
    if module == "vision":
        b = len(ids) // k
        for w in [dist.isend(ids[j * b:(j + 1) * b].clone(), dst=dv + rank * k + j) for j in range(k)]:
            w.wait()
        return
    got = torch.empty_like(ids)
    dist.recv(got, src=rank // k)
    if not torch.equal(got, ids):
        raise AssertionError(f"bridge misaligned on language rank {rank}: vision rank {rank // k} sent "
                             f"{got.tolist()}, this rank holds {ids.tolist()}")


def check_own(args, module, grid, outs, cost):
    """I3-I5 on this rank: held samples are the canonical positions of the reference plan, byte-exact."""
    fields = module_fields(module, cost)
    batches = list(global_batches(args.seed, args.micro_batches, args.micro_batch, args.seq_len, args.features))
    costs = module_costs(batches, module, cost)
    for k, g in enumerate(batches):
        order = ref.lpt_order([float(c) for c in costs[k]], grid.size) if args.balancer == "lpt" else None
        checks.check_rank(g, outs[k], order, grid.dp, grid.rank, fields=fields, vision_start_token_id=syn.VISION_START)
    assert len(batches) == len(outs), f"rank served {len(outs)} micro-batches, source had {len(batches)}"


def check_world(args, everyone) -> dict:
    dv, dl = args.vision_dp, args.language_dp
    errors = [s["error"] for s in everyone if s is not None]
    if args.case != "ok":  # every rank of the faulty module's DP group raised the same error
        faulty = faulty_module(args)
        alive = [s for s in everyone if s["module"] == faulty]
        assert all(s["error"] for s in alive), f"case {args.case}: some ranks did not raise: {errors}"
        msgs = {s["error"] for s in alive}
        if args.case in ("source_raises", "bad_input", "early_end", "corrupt"):
            assert len(msgs) == 1, f"ranks raised different errors: {msgs}"
            msg = msgs.pop()
            assert msg.startswith("ReorderError"), errors
            assert args.case != "corrupt" or "self-check failed" in msg, msg
        return dict(case=args.case, errors=sorted({s["error"] for s in alive}))
    assert not any(errors), errors
    n = everyone[0]["n"]
    assert n == args.micro_batches and all(s["n"] == n for s in everyone), [s["n"] for s in everyone]
    # I1-I8 from every rank's sample ids and orders (one row per micro-batch), against the natural stream
    dps = {m: d for m, d in (("vision", dv), ("language", dl)) if d}
    ranks = {m: sorted((s for s in everyone if s["module"] == m), key=lambda s: s["dp_rank"]) for m in dps}
    batches = list(global_batches(args.seed, args.micro_batches, args.micro_batch, args.seq_len, args.features))
    cost = CostModel(language_weight=args.language_weight)
    checks.check_world(batches, {m: [s["ids"] for s in rs] for m, rs in ranks.items()},
                       {m: [[row for window in s["orders"] for row in window] for s in rs] for m, rs in ranks.items()},
                       {m: module_costs(batches, m, cost) for m in dps}, dps, groups=canonical_grid(list(dps.values())),
                       balancer=args.balancer)
    verified = [s["verified"] for s in everyone]
    assert not args.verify or min(verified) > 0, f"--verify {args.verify}: windows verified per rank {verified}"
    return dict(case="ok", micro_batches=n, max_elapsed_s=max(s["elapsed"] for s in everyone),
                verified_windows=verified if args.verify else None)


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--vision-dp", type=int, default=2)
    p.add_argument("--language-dp", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--micro-batches", type=int, default=7)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--inputs", default="mixed", choices=["mixed", "device", "pinned", "pageable"],
                   help="with --device cuda: where the source's micro-batches live")
    p.add_argument("--matrix", action="store_true",
                   help="run every combination of --windows x --overlaps x --input-kinds in one launch (case ok)")
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--overlaps", type=lambda s: s == "on", nargs="+", default=[True, False])
    p.add_argument("--input-kinds", nargs="+", default=["device", "pinned", "pageable"])
    p.add_argument("--seq-len", type=int, default=160)
    p.add_argument("--features", type=int, default=4)
    p.add_argument("--language-weight", type=float, default=0.0)
    p.add_argument("--balancer", default="lpt")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--case", default="ok", choices=CASES)
    p.add_argument("--fault-at", type=int, default=3)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report-dir", default=None, help="every rank writes rank<N>.json here when its stream ends")
    p.add_argument("--bridge", action="store_true", help="send sample ids vision -> language after each micro-batch")
    p.add_argument("--launch-rendezvous", action="store_true",
                   help="the overlap pair meets before each all_to_all as it does with NCCL payloads")
    p.add_argument("--uncaught", action="store_true", help="a rank's error ends its process (as in training)")
    p.add_argument("--verify", type=int, default=0, help="the runtime self-check on every N-th window (0: off)")
    args = p.parse_args(argv)
    if args.case == "corrupt" and not args.verify:
        p.error("--case corrupt needs --verify N: without the self-check nothing reports the corruption")
    if args.bridge and args.vision_dp and args.language_dp % args.vision_dp:
        p.error(f"--bridge needs language dp a multiple of vision dp; got --vision-dp {args.vision_dp} "
                f"--language-dp {args.language_dp}")
    if args.bridge and args.case != "ok" and not args.uncaught:
        p.error(f"--bridge with --case {args.case} needs --uncaught: the other module would wait in the bridge "
                f"while the faulty one reports")
    return args


def _rank_main(rank, world, argv):
    return run(parse(argv))


def launch(argv, world: int, timeout: float = 300.0) -> dict:
    """Run the suite on `world` forked Gloo processes (reorder.cli.processes: one intra-op thread per
    child, so a parent's OpenMP pool cannot hang them; the whole run is bounded by `timeout`);
    returns rank 0's result, raises ProcessesFailed on any failure."""
    from reorder.cli.processes import run_processes

    return run_processes(_rank_main, world, (argv,), timeout=timeout)


def main():
    args = parse()
    print(f"gloo_suite rank {os.environ.get('RANK')} pid {os.getpid()}", flush=True)
    init_torchrun(cuda=args.device == "cuda", timeout=datetime.timedelta(seconds=args.timeout))
    if args.matrix:
        result = run_matrix(args)
    else:
        result = run(args)
    if dist.get_rank() == 0:
        print("RESULT", result, flush=True)
    dist.destroy_process_group()


def run_matrix(args) -> dict:
    """Every combination of window size, overlap and input placement, one stream each, over one set
    of groups (built with overlap: main and side pairs); stops at the first failure (which raises)."""
    if args.case != "ok":
        raise SystemExit("--matrix runs case ok only")
    args.overlap = True
    placed = rank_groups(args)
    done = []
    for w in args.windows:
        for overlap in args.overlaps:
            for inputs in args.input_kinds if args.device == "cuda" else ["host"]:
                combo = argparse.Namespace(**{**vars(args), "window": w, "overlap": overlap, "inputs": inputs})
                result = run(combo, placed)
                done.append(f"W{w} overlap={'on' if overlap else 'off'} inputs={inputs}")
                if dist.get_rank() == 0:
                    print(f"passed {done[-1]}: {result}", flush=True)
    return dict(case="ok", matrix=len(done), combinations=done)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()  # under torchrun: a rank's exception is the job summary's "Root Cause", message included
    sys.exit(0)
