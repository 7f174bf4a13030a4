"""The Megatron-Bridge drop-in (`reorder.integrations.bridge`) on a GPU, byte-exact against reorder off.

Every process runs a dp-1 module (upstream's dp-1 path: a local permutation, no collective, outputs
on the device the input lives on) with inputs on the device and on the host. Under torchrun with one
GPU per rank (or Gloo with --device cpu) every rank also runs one module of dp = world size, its
groups from `build_module_dp_process_groups` (NCCL data groups), with and without overlap; outputs
there go to the current CUDA device, as upstream.

Parity with reorder off, per micro-batch: reorder off gives rank r samples [r*B/dp, (r+1)*B/dp) of
the global micro-batch. Reordered, the report's canonical order must be a permutation of the B
samples, the same on every rank; rank r must receive, in that order, positions [r*B/dp, (r+1)*B/dp)
of it, every sample's bytes (`spec.samples.per_sample_bytes` of the global micro-batch) intact. So
each sample arrives exactly once per micro-batch, where the plan puts it. With balancer "lpt" the
order must be upstream's LPT (`spec.reference.lpt_order`) of the reference costs; "balanced" must
not exceed LPT's largest group load. Costs: a partial of `sample_cost` (vectorized) and a custom
per-sample `cost_of` (thirds: only float64 bits carry them). An overlap worker must be gone within
5 s of the source's end. The buffers run the runtime self-check (`--verify`, every window by
default), which must find every window that moved samples intact.

  python functional_tests/bridge_cuda.py                              # one GPU: dp 1
  torchrun --standalone --nproc-per-node 2 functional_tests/bridge_cuda.py   # dp 1, dp 2 (NCCL); ranks
                                                                      # beyond the GPUs share them
  python functional_tests/bridge_cuda.py --device cpu --seq-len 256 --features 8 --mix small

Rank 0 prints one RESULT line (ok, cases, micro-batches checked, mismatches, ms per micro-batch);
every rank exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import os
import sys
import time
from pathlib import Path


def _wants_cpu(argv) -> bool:
    """--device cpu (or cpu:N) among the arguments, read before argparse and torch are loaded."""
    for i, a in enumerate(argv):
        if a == "--device" and i + 1 < len(argv):
            return argv[i + 1].startswith("cpu")
        if a.startswith("--device="):
            return a.split("=", 1)[1].startswith("cpu")
    return False


# The drop-in picks its output device and its overlap data group's backend from
# torch.cuda.is_available(), as upstream does: hide the GPUs before torch loads so that --device cpu
# runs the CPU behaviour on any host.
if _wants_cpu(sys.argv[1:]):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reorder and spec from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.common import rank_device  # noqa: E402
from reorder.batch.layout import tensors  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.integrations import bridge as br  # noqa: E402
from spec.reference import group_loads, lpt_order, sample_cost as reference_cost  # noqa: E402
from spec.samples import per_sample_bytes  # noqa: E402

LANGUAGE_WEIGHT = 0.25
VECTORIZED = functools.partial(br.sample_cost, encoder_cost_weight=1.0, language_cost_weight=LANGUAGE_WEIGHT,
                               image_token_id=syn.IMAGE_TOKEN, square_merge_size=4)


def custom_cost(flat) -> float:
    """Not a partial of sample_cost, so it runs per sample; thirds and sevenths: no integer carries them."""
    return VECTORIZED(flat) / 3 + int(flat["sample_id"].item()) % 5 / 7


def reference_costs(g, kind) -> list:
    """The B costs of global micro-batch g, one sample at a time from spec.reference."""
    out = []
    for ids, mask, sid in zip(g["input_ids"].tolist(), g["attention_mask"].tolist(), g["sample_id"].tolist()):
        c = reference_cost(ids, mask, image_token_id=syn.IMAGE_TOKEN, spatial_merge_size=2, encoder_weight=1.0,
                           language_weight=LANGUAGE_WEIGHT)
        out.append(c if kind == "vectorized" else c / 3 + sid % 5 / 7)
    return out


# name, dp ("world" or 1), groups per dp rank, inputs ("device", "host"), cost, balancer, window, overlap
CASES = [
    ("dp1 W1 lpt vectorized, inputs on the device", 1, 2, "device", "vectorized", "lpt", 1, False),
    ("dp1 W2 lpt per-sample cost_of, inputs on the host", 1, 4, "host", "custom", "lpt", 2, True),
    ("dp1 W3 balanced vectorized, inputs on the device", 1, 4, "device", "vectorized", "balanced", 3, False),
    ("dpN W1 lpt vectorized, no overlap, inputs on the host", "world", 1, "host", "vectorized", "lpt", 1, False),
    ("dpN W2 lpt per-sample cost_of, overlap, inputs on the host", "world", 2, "host", "custom", "lpt", 2, True),
    ("dpN W1 balanced vectorized, overlap, inputs on the device", "world", 1, "device", "vectorized", "balanced", 1,
     True),
]


def place(batch, where, dev):
    """A rank's share where the case wants it: on `dev`, or on the host (pinned when a GPU reads it)."""
    if where == "device":
        return syn.to_device(batch, dev)
    return syn.pin(batch) if dev.type == "cuda" else batch


def check_micro_batch(out, k, g, want, order, *, dp, rank, groups, case, expect_dev, costs) -> list:
    """Mismatches of micro-batch k on this rank (empty when it is right)."""
    name, balancer, b = case[0], case[5], len(order) // dp
    if sorted(order) != list(range(len(order))):
        return [f"{name}: micro-batch {k}: canonical order {order} is not a permutation"]
    bad = []
    if balancer == "lpt" and order != lpt_order(costs, groups):
        bad.append(f"{name}: micro-batch {k}: order {order} is not upstream's LPT {lpt_order(costs, groups)}")
    if balancer == "balanced" and max(group_loads(costs, order, groups)) > max(
            group_loads(costs, lpt_order(costs, groups), groups)):
        bad.append(f"{name}: micro-batch {k}: balanced's max load exceeds LPT's")
    wrong = sorted({str(t.device) for t in tensors(out) if t.device != expect_dev})
    if wrong:
        bad.append(f"{name}: micro-batch {k}: tensors on {wrong}, expected {expect_dev}")
    got = per_sample_bytes(syn.to_device(out, "cpu"), vision_start_token_id=syn.VISION_START)
    if got != [want[i] for i in order[rank * b:(rank + 1) * b]]:
        bad.append(f"{name}: micro-batch {k}: rank {rank}'s samples differ from reorder off's bytes in canonical "
                   "order")
    return bad


def run_case(case, globals_, wants, costs, *, dp, rank, groups, dev, inject=False, verify=0):
    """(mismatches, micro-batches checked, ms per micro-batch, canonical orders) of one case on this rank;
    `inject` changes one token of the first micro-batch received (the check must then fail); `verify`:
    the buffer's runtime self-check every N-th window, which must then have found every checked window
    that moved samples intact."""
    name, _, span, where, kind, balancer, window, overlap = case
    n_groups = span * dp
    gloo, data = groups.get(overlap, (None, None)) if dp > 1 else (None, None)
    shares = [place(syn.rank_share(g, dp, rank), where, dev) for g in globals_]
    expect_dev = torch.device("cuda", torch.cuda.current_device()) if dp > 1 and torch.cuda.is_available() \
        else shares[0]["input_ids"].device
    buf = br.ReorderingBuffer(iter(shares), dp_rank=rank, dp_size=dp, n_groups=n_groups,
                              cost_of=VECTORIZED if kind == "vectorized" else custom_cost, dp_group_gloo=gloo,
                              dp_group_nccl=data, overlap=overlap, image_count_of=br.image_count_of,
                              window_size=window, balancer=balancer, verify=verify)
    sync(dev)
    t0 = time.perf_counter()
    out = list(buf)
    sync(dev)
    ms = (time.perf_counter() - t0) * 1e3 / max(1, len(out))
    if inject and out:
        out[0] = dict(out[0], input_ids=out[0]["input_ids"].clone())
        out[0]["input_ids"][0, 0] += 1
    bad = []
    if buf._thread is not None:  # the overlap worker ends with the source, within 5 s
        buf._thread.join(5.0)
        if buf._thread.is_alive():
            bad.append(f"{name}: the overlap worker is alive 5 s after the source ended")
    orders = [o.tolist() for rep in buf.reports for o in rep.orders]
    moved = [bool((rep.orders != np.arange(rep.orders.shape[1])).any()) for rep in buf.reports]
    checked = sum(m for k, m in enumerate(moved) if verify and k % verify == 0)
    if buf.verified_windows != checked:
        bad.append(f"{name}: the self-check found {buf.verified_windows} windows intact, expected {checked}")
    if len(out) != len(globals_) or len(orders) != len(globals_):
        return bad + [f"{name}: {len(out)} micro-batches and {len(orders)} orders for {len(globals_)} read"], 0, ms, []
    for k, (mb, g) in enumerate(zip(out, globals_)):
        bad += check_micro_batch(mb, k, g, wants[k], orders[k], dp=dp, rank=rank, groups=n_groups, case=case,
                                 expect_dev=expect_dev, costs=costs[kind][k])
    return bad, len(out), ms, orders


def sync(dev):
    """Wait for `dev`'s queued work (timings cover the copies and kernels a window launched)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def setup(args):
    """(world, rank, device, {overlap: module groups} for dp = world, a Gloo world group or None)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = args.device.startswith("cuda")
    dev = rank_device(cuda)  # ranks beyond the GPU count share them (one NCCL host id each)
    if cuda:
        torch.cuda.set_device(dev)
    if world == 1:
        return world, rank, dev, {}, None
    dist.init_process_group("nccl" if cuda else "gloo")
    report = dist.new_group(backend="gloo")  # results, as Python objects
    # every rank, the same calls in the same order (new_group is a world collective)
    groups = {ov: br.build_module_dp_process_groups(dist.group.WORLD, overlap=ov)[2:] for ov in (False, True)}
    return world, rank, dev, groups, report


def main():
    """Every case on every rank, then `finish`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--micro-batch", type=int, default=16, help="global micro-batch B (a multiple of 4 x world)")
    p.add_argument("--steps", type=int, default=5, help="micro-batches per case (5: short last windows)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--features", type=int, default=1176)
    p.add_argument("--mix", default="realistic", choices=sorted(syn.SIZE_MIXES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds before a stuck run prints every thread's stack and exits 1")
    p.add_argument("--verify", type=int, default=1, help="the buffers' runtime self-check every N-th window "
                                                          "(0: off)")
    p.add_argument("--inject-mismatch", action="store_true",
                   help="change one received token in the first case: checks the check (exits 1)")
    args = p.parse_args()
    # a collective that waits on a lost peer would otherwise hold the GPUs until the group's timeout
    faulthandler.dump_traceback_later(args.timeout, exit=True)
    world, rank, dev, groups, report = setup(args)
    rng = np.random.default_rng(args.seed)  # the same global micro-batches on every rank
    globals_ = [syn.make_global_batch(rng, args.micro_batch, args.seq_len, features=args.features, mix=args.mix,
                                      first_id=k * args.micro_batch) for k in range(args.steps)]
    wants = [per_sample_bytes(g, vision_start_token_id=syn.VISION_START) for g in globals_]
    costs = {kind: [reference_costs(g, kind) for g in globals_] for kind in ("vectorized", "custom")}
    bad, checked, timings, orders = [], 0, {}, {}
    # untimed: the first launch of each Triton kernel compiles it (about half a second on an H200),
    # which would otherwise count in the first case's time per micro-batch
    try:
        run_case(CASES[0], globals_[:1], wants[:1], {k: v[:1] for k, v in costs.items()}, dp=1, rank=0,
                 groups=groups, dev=dev)
    except Exception:  # noqa: BLE001 - the timed run of the same case reports it
        pass
    for case in CASES:
        dp = world if case[1] == "world" else 1
        if case[1] == "world" and world == 1:
            continue
        name = case[0].replace("dpN", f"dp{dp}")
        try:
            b, n, ms, o = run_case(case, globals_, wants, costs, dp=dp, rank=rank if dp > 1 else 0, groups=groups,
                                   dev=dev, inject=args.inject_mismatch and case is CASES[0], verify=args.verify)
        except Exception as e:  # noqa: BLE001 - a failed case is a mismatch; the others still run
            b, n, ms, o = [f"{name}: raised {type(e).__name__}: {e}"], 0, float("nan"), []
        bad += [f"rank {rank}: {x}" for x in b]
        checked, timings[name] = checked + n, round(ms, 3)
        if dp > 1:
            orders[name] = o
    finish(args, world, rank, dev, report, bad, checked, timings, orders)


def finish(args, world, rank, dev, report, bad, checked, timings, orders):
    """Gather every rank's findings (and check that all ranks of a dp-world module agree on the
    orders), print the RESULT line on rank 0, exit 1 on any mismatch on any rank."""
    every = [(bad, checked, orders)]
    if report is not None:
        every = [None] * world
        dist.all_gather_object(every, (bad, checked, orders), group=report)
    bad = [x for b, _, _ in every for x in b]
    for name in every[0][2]:
        if any(o[name] != every[0][2][name] for _, _, o in every):
            bad.append(f"{name}: the ranks' canonical orders differ")
    ok = not bad and sum(n for _, n, _ in every) > 0
    if rank == 0:
        label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
        print("RESULT", dict(ok=ok, device=f"{label} x{world}", micro_batch=args.micro_batch, steps=args.steps,
                             checked=sum(n for _, n, _ in every), mismatches=bad[:10], n_mismatches=len(bad),
                             ms_per_micro_batch=timings), flush=True)
    if report is not None:
        dist.barrier(group=report)
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
