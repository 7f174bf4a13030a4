"""Online calibration on real Gloo processes: a synthetic model whose step time is a hidden function of
what a rank ran (ms = base + a * patches + b * patches^2 per image + c * images, plus noise): slept
(rather than busy-waited, so oversubscribed CPU cores distort it less) and timed with
`buf.timed_step()` (timing="slept"), or handed over with `buf.record_step_ms` (timing="given").

Options (DEFAULTS): the layout (vision_dp 0 = one module), B, W, micro-batches, the calibration
settings, the hidden function `true` (and `true2` from window `drift_at` on: a drift), `cost`: the cost
the exchanger starts from ("default", or "true": the hidden weights themselves, for a reference run),
`silent_rank` / `silent_from`: a global rank that stops timing its steps from that window on,
`build`: "direct" (WindowExchanger + ReorderingBuffer + Calibration by hand), "wrap" (the Megatron
adapter reads the calibration from the config, `overlap` as given) or "bridge" (the Megatron-Bridge
drop-in with `enable_calibration`, one module).

`launch(...)` runs it on forked processes (reorder.cli.processes) and returns, from rank 0: every
rank's calibration reports (weights as float64 bytes, to compare bit for bit), the switch windows,
every rank's orders, served sample ids and step times, and per micro-batch: the max/mean of the step
times the language ranks measured, and the hidden-time max/mean of the plans of the default cost,
the true weights and this run.
"""

from __future__ import annotations

import datetime
import time

import numpy as np
import torch
import torch.distributed as dist

from reorder import CostModel, WindowExchanger
from reorder.cli import synthetic as syn
from reorder.exchange.dist import TorchCollectives, build_groups
from reorder.plan.balancers import balanced
from reorder.runtime.buffer import CalibratedWindowReport, ReorderingBuffer
from reorder.runtime.calibration import FEATURES, Calibration, step_features, with_weights

COST = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)


def hidden_ms(feats: np.ndarray, true: dict, base: float) -> float:
    return base + sum(true.get(f, 0.0) * float(feats[..., i].sum()) for i, f in enumerate(FEATURES))


def true_at(opts: dict, window: int) -> dict:
    """The hidden weights in force at `window`."""
    return opts["true2"] if opts.get("drift_at") is not None and window >= opts["drift_at"] else opts["true"]


def global_batches(seed, count, batch, seq_len):
    rng = np.random.default_rng(seed)
    for k in range(count):
        yield syn.make_global_batch(rng, batch, seq_len, features=4, mix="small", first_id=k * batch)


def sample_features(g) -> np.ndarray:
    ids, mask = g["input_ids"], g["attention_mask"]
    return np.stack([step_features(ids[i:i + 1], mask[i:i + 1], COST).numpy() for i in range(len(ids))])


def spread_of(order, feats, dp, true, base) -> float:
    per = len(order) // dp
    t = [hidden_ms(feats[order[r * per:(r + 1) * per]], true, base) for r in range(dp)]
    return max(t) / (sum(t) / dp)


def _config(opts, modules):
    from reorder.integrations.config import ReorderConfig

    return ReorderConfig(megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=True,
                         megatron_mimo_reorder_overlap=opts.get("overlap", False),
                         megatron_mimo_reorder_window_size=opts["window"],
                         megatron_mimo_reorder_image_token_id=syn.IMAGE_TOKEN,
                         megatron_mimo_reorder_vision_start_token_id=syn.VISION_START,
                         megatron_mimo_reorder_calibrate=opts["mode"],
                         megatron_mimo_reorder_calibrate_every=opts["every"],
                         megatron_mimo_reorder_calibrate_min_r2=opts["min_r2"],
                         megatron_mimo_reorder_calibrate_min_gain=opts["min_gain"],
                         megatron_mimo_reorder_calibrate_drift=opts["drift"],
                         megatron_mimo_reorder_calibrate_history=opts["history"])


def _buffer(rank, opts, modules, source):
    """(buffer, module, DP rank, DP size, calibration)."""
    if opts["build"] == "wrap":
        from reorder.integrations.megatron import wrap

        module = next(m for m, ranks in modules.items() if rank in ranks[0])
        from reorder.integrations.calibrate import enable_calibration

        buf = wrap(source, config=_config(opts, modules), module=module, grids=modules,
                   micro_batch_size=opts["micro_batch"], fixed_width_padding=True,
                   timeout=datetime.timedelta(seconds=120))
        assert enable_calibration(buf, _config(opts, modules)) is buf.calibration  # wrap's, not a second one
        return buf, module, buf._ex.grid.rank, buf._ex.grid.dp, buf.calibration
    if opts["build"] == "bridge":  # the Megatron-Bridge drop-in, one module, fit on its DP group
        import functools

        from reorder.integrations import bridge as br
        from reorder.integrations.calibrate import enable_calibration

        dp_rank, dp_size, gloo, data = br.build_module_dp_process_groups(dist.group.WORLD, overlap=False)
        cost_of = functools.partial(br.sample_cost, encoder_cost_weight=1.0, image_token_id=syn.IMAGE_TOKEN,
                                    square_merge_size=4)
        buf = br.ReorderingBuffer(source, dp_rank=dp_rank, dp_size=dp_size, n_groups=dp_size, cost_of=cost_of,
                                  dp_group_gloo=gloo, dp_group_nccl=data, overlap=False,
                                  window_size=opts["window"], balancer="balanced", image_count_of=br.image_count_of)
        cal = enable_calibration(buf, opts["mode"], every=opts["every"], min_r2=opts["min_r2"],
                                 min_gain=opts["min_gain"], drift=opts["drift"], history=opts["history"])
        assert (cal.every, cal.history, cal.window_size) == (opts["every"], opts["history"], opts["window"])
        return buf, "language", dp_rank, dp_size, cal
    groups = build_groups(modules, overlap=False, timeout=datetime.timedelta(seconds=120))
    grid = groups.grid
    cost = COST if opts["cost"] == "default" else with_weights(COST, {f: opts["true"].get(f, 0.0) for f in FEATURES})
    ex = WindowExchanger(grid=grid, micro_batch_size=opts["micro_batch"], cost=cost, window_size=opts["window"],
                         collectives=groups.main)
    fit_group = groups.main if len(modules) == 1 else TorchCollectives(dist.group.WORLD, dist.group.WORLD)
    cal = Calibration(mode=opts["mode"], window_size=opts["window"], every=opts["every"], min_r2=opts["min_r2"],
                      min_gain=opts["min_gain"], drift=opts["drift"], history=opts["history"],
                      collectives=fit_group, tag=list(modules).index(groups.module))
    buf = ReorderingBuffer(source, ex)
    buf.calibrate(cal)
    return buf, groups.module, grid.rank, grid.dp, cal


def run(rank, world, opts) -> dict:
    dv, dl = opts["vision_dp"], opts["language_dp"]
    b, w, n = opts["micro_batch"], opts["window"], opts["micro_batches"]
    modules = {"vision": [list(range(dv))], "language": [list(range(dv, dv + dl))]}
    if dv == 0:
        del modules["vision"]
    batches = list(global_batches(opts["seed"], n, b, opts["seq_len"]))
    dp_of = {m: len(r[0]) for m, r in modules.items()}
    module = next(m for m, ranks in modules.items() if rank in ranks[0])
    me = modules[module][0].index(rank)
    source = (syn.rank_share(g, dp_of[module], me) for g in batches)
    buf, module, dp_rank, dp, cal = _buffer(rank, opts, modules, source)
    rng = np.random.default_rng(1000 + rank)
    ids, ms_of = [], []
    for k, mb in enumerate(buf):
        ids.append(mb["sample_id"].tolist())
        window = k // w
        f = step_features(mb["input_ids"], mb["attention_mask"], COST).numpy()
        ms = max(hidden_ms(f, true_at(opts, window), opts["base"]) + rng.normal(0, opts["noise"]), 0.0)
        ms_of.append(ms)
        if rank == opts.get("silent_rank") and window >= opts.get("silent_from", 0):
            continue  # this rank stops timing its steps
        if opts["timing"] == "slept":
            with buf.timed_step():
                time.sleep(ms / 1e3)
        else:  # "given": the hidden time itself, as a training loop that measures its own passes it
            assert buf.record_step_ms(ms) == (cal is not None and cal.mode != "off")
        if k == 0:
            assert not buf.record_step_ms(float("nan"))  # refused, training goes on
    buf.shutdown() if opts["build"] == "bridge" else buf.close()
    reports = [] if cal is None else cal.reports
    fits_in_window_reports = [r.calibration.window for r in buf.reports
                              if isinstance(r, CalibratedWindowReport) and r.calibration is not None]
    mine = dict(rank=rank, module=module, dp_rank=dp_rank, ids=ids, ms=ms_of,
                orders=[r.orders.tolist() for r in buf.reports], switches=[] if cal is None else list(cal.switches),
                weights=[np.array([r.weights.get(f, np.nan) for f in FEATURES]).tobytes() for r in reports],
                active=[np.array([r.active[f] for f in FEATURES]).tobytes() for r in reports],
                records=[r.record() for r in reports], fits_in_window_reports=fits_in_window_reports,
                rejected=0 if cal is None else cal.rejected)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    lang = sorted((e for e in everyone if e["module"] == "language"), key=lambda e: e["dp_rank"])
    measured = [max(e["ms"][k] for e in lang) / (sum(e["ms"][k] for e in lang) / dl) for k in range(n)]
    hidden = {"default": [], "true": [], "run": []}
    for k in range(n):
        g, true = batches[k], true_at(opts, k // w)
        feats = sample_features(g)
        true_cost = with_weights(COST, {f: true.get(f, 0.0) for f in FEATURES})
        counts = (feats[:, 0] / 4, feats[:, 2], feats[:, 1], feats[:, 4])
        g_count = int(np.lcm(dv, dl)) if dv else dl
        hidden["default"].append(spread_of(balanced(COST.costs(*counts), g_count), feats, dl, true, opts["base"]))
        hidden["true"].append(spread_of(balanced(true_cost.costs(*counts), g_count), feats, dl, true, opts["base"]))
        hidden["run"].append(spread_of(np.array(lang[0]["orders"][k // w][k % w]), feats, dl, true, opts["base"]))
    return dict(everyone=everyone, measured=measured, hidden=hidden)


def launch(opts: dict, timeout: float = 240.0) -> dict:
    from reorder.cli.processes import run_processes

    opts = dict(DEFAULTS, **opts)
    return run_processes(run, opts["vision_dp"] + opts["language_dp"], (opts,), timeout=timeout, pg_timeout=180)


DEFAULTS = dict(vision_dp=0, language_dp=4, micro_batch=16, window=2, micro_batches=32, seq_len=512, seed=3,
                every=3, mode="on", min_r2=0.8, min_gain=0.05, drift=0.25, history=8, base=0.5, noise=0.03,
                timing="slept", cost="default", build="direct",
                true={"patches": 0.002, "square_patches": 4e-5, "images": 0.15})

if __name__ == "__main__":
    import json

    out = launch({})
    r0 = out["everyone"][0]
    print(json.dumps(dict(switches=r0["switches"], measured=float(np.mean(out["measured"])),
                          hidden={k: float(np.mean(v)) for k, v in out["hidden"].items()})))
