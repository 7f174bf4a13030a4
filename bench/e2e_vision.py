"""End-to-end vision step time on dp 2 over 2 GPUs: reorder off / on, synchronous or with overlap,
each without the cost-benefit gate, with it, and with it plus the gate backoff.

  torchrun --nproc-per-node 2 bench/e2e_vision.py [--steps 40] [--mix large] [--json out.json]

A small ViT-like encoder (patch embedding, pre-norm blocks with full attention inside each image via
scaled_dot_product_attention, MLP) runs forward + backward on each rank's images, then the gradients
are all-reduced (NCCL), as in data-parallel training. Every mode replays the same global
micro-batches (a named image-size mix, pinned host memory); every mode, off included, hands the step
the micro-batch with every tensor on the device (off: non-blocking copies of each). Reported per mode: step time mean, p50,
p90, p99 (rank 0's clock; the all-reduce makes every step as slow as the slowest rank), and the gain
predicted from the cost balance (1 - sum of max per-rank patches after / before) next to the measured
mean gain. The "+gate" modes are calibrated in the same run: each rank's own compute time is fitted
(non-negative least squares, reorder.integrations.calibrate) on patches, per-image patches^2 and images, which
gives a cost model in ms (the planner then balances the fitted time); min_saving is the synchronous
exchange's median ms (rank 0's figure, the same on both ranks), so a micro-batch moves only when its
predicted saving exceeds the exchange. The "+backoff" modes add gate_backoff (--gate-backoff). Step k
of every mode holds the same micro-batch, so "paired" reports per-step differences against off.
Without a GPU it runs on CPU/Gloo as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bench.common import init_torchrun, synchronizer
from reorder import CostModel, WindowExchanger
from reorder.cli import synthetic as syn
from reorder.runtime.buffer import ReorderingBuffer
from reorder.integrations.calibrate import fit_cost_weights
from reorder.exchange.dist import build_groups
from reorder.integrations.megatron import select_fields


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, bounds):
        h = self.qkv(self.n1(x))
        outs = []
        for a, b in bounds:  # full attention within each image
            q, k, v = h[a:b].view(1, b - a, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)  # [1, H, n, d]
            o = F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous())  # flash kernel
            outs.append(o[0].transpose(0, 1).reshape(b - a, -1))
        x = x + self.proj(torch.cat(outs) if outs else h[:, : x.shape[1]])
        return x + self.mlp(self.n2(x))


class Encoder(nn.Module):
    def __init__(self, features, dim, heads, layers):
        super().__init__()
        self.embed = nn.Linear(features, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))

    def forward(self, patches, grid_thw):
        rows = grid_thw.prod(dim=1).tolist()
        ends = np.cumsum(rows).tolist()
        bounds = list(zip([0] + ends[:-1], ends))
        x = self.embed(patches)
        for blk in self.blocks:
            x = blk(x, bounds)
        return x.float().pow(2).mean()


def percentiles(ts):
    a = np.array(ts)
    return dict(mean=float(a.mean()), p50=float(np.percentile(a, 50)), p90=float(np.percentile(a, 90)),
                p99=float(np.percentile(a, 99)))


def paired(samples, gated_mask, rounds, steps):
    """Step-by-step differences off - mode (ms, + = mode faster): every mode replays the same
    micro-batches in the same order, so step k of every mode holds the same batch and the difference
    cancels the batch's own cost. Mean and 95% half-width over (round, step) pairs; for the gated
    modes also split into steps whose window was gated and steps whose window moved samples; and the
    mean of each round ("rounds_ms": a slow spell of the machine shows as one round apart)."""
    off = np.array(samples["off"]).reshape(rounds, steps)

    def stats(d):
        d = np.asarray(d)
        half = 1.96 * d.std(ddof=1) / np.sqrt(len(d)) if len(d) > 1 else float("nan")
        return dict(n=int(len(d)), mean_ms=float(d.mean()) if len(d) else float("nan"), ci95_ms=float(half))

    out = {}
    for m in samples:
        if m == "off":
            continue
        diff = off - np.array(samples[m]).reshape(rounds, steps)
        out[m] = {"all": stats(diff.reshape(-1)), "rounds_ms": diff.mean(axis=1).tolist()}
        if "+gate" in m:
            g = np.array(gated_mask[m]).reshape(rounds, steps)
            out[m]["gated"], out[m]["moved"] = stats(diff[g]), stats(diff[~g])
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--micro-batch", type=int, default=8, help="global micro-batch B (B/2 per rank)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--mix", default="large")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--gate-backoff", type=int, default=8, help="gate_backoff of the +backoff modes")
    p.add_argument("--json")
    args = p.parse_args()
    me, world, dev = init_torchrun()  # without a GPU: a CPU/Gloo smoke run of the same code
    cuda = dev.type == "cuda"
    sync = synchronizer(dev)
    groups = build_groups({"vision": [list(range(world))]}, device=dev, overlap=True)
    torch.manual_seed(0)
    model = Encoder(1176, args.dim, 16, args.layers).to(dev, torch.bfloat16 if cuda else torch.float32)
    params = list(model.parameters())
    B, n = args.micro_batch, args.steps + args.warmup
    rng = np.random.default_rng(2024)
    globals_ = [syn.make_global_batch(rng, B, 4096, features=1176, mix=args.mix, first_id=k * B, scale=1.0)
                for k in range(n)]
    pin = syn.pin if cuda else (lambda b: b)
    shares = [pin(select_fields(syn.rank_share(g, world, me), syn.VISION_FIELDS)) for g in globals_]
    cost = CostModel()

    compute = []  # calibration: (patches, sum of per-image patches^2, images, ms) of this rank's steps

    def step(mb, calibrate=False):
        vit = mb["modality_inputs"]["images"]["vit"]
        patches = vit["hidden_states"].to(dev, params[0].dtype, non_blocking=True)
        thw = vit["grid_thw"].cpu()
        if calibrate:
            sync()
            t = time.perf_counter()
        loss = model(patches, thw)
        loss.backward()
        if calibrate:  # this rank's own compute time, before the all-reduce waits for the slower rank
            sync()
            per = thw.prod(1).double()
            compute.append([float(per.sum()), float((per * per).sum()), len(thw), (time.perf_counter() - t) * 1e3])
        flat = torch.cat([q.grad.reshape(-1) for q in params])
        dist.all_reduce(flat)
        for q in params:
            q.grad = None

    gate = {}

    def run(mode, calibrate=False):
        """Steps of one mode; returns (step ms after the warm-up steps, reports). calibrate: record
        this rank's compute time and features of every step after the warm-up steps."""
        if mode == "off":  # the batch delivered on the device as every reorder mode delivers it (and a
            it = (syn.to_device(s, dev, non_blocking=True) for s in shares)  # training step needs it)
            buf = None
        else:
            gated = "+gate" in mode
            ex = WindowExchanger(grid=groups.grid, micro_batch_size=B, cost=gate["cost"] if gated else cost,
                                 window_size=1, collectives=groups.side if mode.startswith("overlap") else groups.main,
                                 device=dev, min_saving=gate["min_saving"] if gated else None,
                                 gate_backoff=args.gate_backoff if mode.endswith("+backoff") else 0)
            buf = ReorderingBuffer(iter(shares), ex, overlap=mode.startswith("overlap"))
            it = iter(buf)
        times = []
        for k in range(n):
            sync()
            t = time.perf_counter()
            step(next(it), calibrate and k >= args.warmup)
            sync()
            times.append((time.perf_counter() - t) * 1e3)
        reports = list(buf.reports) if buf is not None else []
        if buf is not None:
            buf.close()
        return times[args.warmup:], reports

    # warm passes (every batch shape of every mode seen once), then the gate's inputs:
    # per-rank compute time ~ patches, patches^2 and images (non-negative least squares over both
    # ranks) gives a cost model in ms; the synchronous exchange's median time is the threshold
    run("off")
    _, sync_reports = run("sync")
    run("overlap")
    run("off", calibrate=True)  # on the warm model only: first-time costs would dominate the fit
    everyone = [None] * world
    dist.all_gather_object(everyone, compute, group=groups.main.meta_group)
    rows = np.array([r for rank_rows in everyone for r in rank_rows])
    fit = fit_cost_weights(rows[:, :3], rows[:, 3], names=("patches", "square_patches", "images"))
    ex_ms = torch.tensor([float(np.median([r.exchange_ms for r in sync_reports[args.warmup:]]))], dtype=torch.float64)
    dist.broadcast(ex_ms, 0, group=groups.main.meta_group)  # rank 0's figure: one threshold everywhere
    w_p, w_sq, w_img = fit.weights["patches"], fit.weights["square_patches"], fit.weights["images"]
    gate.update(cost=CostModel(encoder_weight=w_p if w_p or w_sq or w_img else 1e-12, encoder_quadratic_weight=w_sq,
                               encoder_image_weight=w_img), min_saving=float(ex_ms))
    gate_info = dict(fit_ms_per_patch=w_p, fit_ms_per_patch2=w_sq, fit_ms_per_image=fit.weights["images"],
                     fit_intercept_ms=fit.intercept, fit_r2=fit.r2, min_saving_ms=float(ex_ms))
    for mode in ("sync+gate", "overlap+gate", "sync+gate+backoff", "overlap+gate+backoff"):
        run(mode)
    per_round = []
    order = ["off", "sync", "sync+gate", "sync+gate+backoff", "overlap", "overlap+gate", "overlap+gate+backoff"]
    samples, predicted = {m: [] for m in order}, None
    gated_mask = {m: [] for m in order}  # per round: bool per timed step, its window was gated
    sync_exchange = []  # per round: exchange time inside the synchronous steps
    gated_slots = {m: 0 for m in order if "+gate" in m}
    for k in range(args.rounds):  # modes interleaved and rotated, so drift and order hit all alike
        for mode in order[k % len(order):] + order[:k % len(order)]:
            times, reports = run(mode)
            samples[mode] += times
            gated_mask[mode].append([bool(r.gated_slots) for r in reports[args.warmup:]] if reports
                                    else [False] * len(times))
            per_round.append(dict(round=k, mode=mode, mean_ms=float(np.mean(times)), max_ms=float(np.max(times))))
            if mode == "sync":
                ex_ms = [r.exchange_ms for r in reports[args.warmup:]]
                worst = max(range(len(ex_ms)), key=ex_ms.__getitem__)
                sync_exchange.append(dict(median_ms=float(np.median(ex_ms)), max_ms=ex_ms[worst],
                                          worst_stages=reports[args.warmup + worst].stage_ms))
            if mode in gated_slots:
                gated_slots[mode] += sum(r.gated_slots for r in reports[args.warmup:])
            if mode == "sync" and predicted is None:
                rep = reports[args.warmup:]
                predicted = 1 - sum(r.max_after for r in rep) / sum(r.max_before for r in rep)
    results = {m: percentiles(t) for m, t in samples.items()}
    if cuda:
        results["allocator"] = {k: torch.cuda.memory_stats(dev).get(k, 0) for k in ("num_alloc_retries", "num_ooms")}
        results["allocator"]["max_reserved_gib"] = torch.cuda.max_memory_reserved(dev) / 2**30
    off, off90 = results["off"]["mean"], results["off"]["p90"]
    out = dict(device=(torch.cuda.get_device_name(0) if cuda else "cpu") + f" x{world}", mix=args.mix,
               modes=results, predicted_gain=predicted, mean_gain=1 - results["overlap"]["mean"] / off,
               p90_gain=1 - results["overlap"]["p90"] / off90, gate=gate_info,
               gated_steps={m: f"{v} of {args.steps * args.rounds}" for m, v in gated_slots.items()})
    out["gains"] = {m: dict(mean=1 - results[m]["mean"] / off, p90=1 - results[m]["p90"] / off90)
                    for m in order[1:]}
    out["never_slower"] = {m: bool(results[m]["mean"] <= off and results[m]["p90"] <= off90) for m in order[1:]}
    out["gain_over_ideal"] = out["mean_gain"] / predicted if predicted else None
    out["paired"] = paired(samples, gated_mask, args.rounds, args.steps)
    out["sync_exchange"] = sync_exchange
    out["per_round"] = per_round
    if me == 0:
        print(f"{'mode':20} {'mean ms':>8} {'p50':>8} {'p90':>8} {'p99':>8}")
        for m, r in results.items():
            if m == "allocator":
                print("allocator:", r)
                continue
            print(f"{m:20} {r['mean']:8.2f} {r['p50']:8.2f} {r['p90']:8.2f} {r['p99']:8.2f}")
        print(f"predicted ideal gain {predicted:.1%}; gain / ideal (overlap, mean) {out['gain_over_ideal']:.2f}")
        for m, g in out["gains"].items():
            print(f"  {m:20} mean gain {g['mean']:6.1%}  p90 gain {g['p90']:6.1%}  never slower: {out['never_slower'][m]}")
        print("gate:", gate_info, "gated steps:", out["gated_steps"])
        print("synchronous exchange inside the steps:", sync_exchange)
        print("paired by step (off minus mode, ms; every mode replays the same micro-batches; + = faster):")
        for m, d in out["paired"].items():
            print(f"  {m:20} all {d['all']['mean_ms']:+6.2f} ± {d['all']['ci95_ms']:.2f} (n {d['all']['n']})"
                  + "".join(f"  {k} {d[k]['mean_ms']:+6.2f} ± {d[k]['ci95_ms']:.2f} (n {d[k]['n']})"
                            for k in ("moved", "gated") if k in d)
                  + "  by round " + " ".join(f"{x:+.2f}" for x in d["rounds_ms"]))
        for r in per_round:
            print(f"  round {r['round']} {r['mode']:20} mean {r['mean_ms']:8.2f} ms  max {r['max_ms']:8.2f} ms")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
