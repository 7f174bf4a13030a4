"""Online calibration on real Gloo processes: a synthetic model whose step time is a hidden function of
what a rank ran (ms = base + a * patches + b * patches^2 per image + c * images, plus noise): slept
(rather than busy-waited, so oversubscribed CPU cores distort it less) and timed with
`buf.timed_step()` (timing="slept"), or handed over with `buf.record_step_ms` (timing="given").

`launch(...)` runs it on forked processes (reorder.cli.processes) and returns, from rank 0: every
rank's calibration reports (weights as float64 bytes, to compare bit for bit), the switch windows,
every rank's orders and served sample ids, and the hidden-time spreads (max/mean per step) of the
plans of the default cost, the true weights and the calibrated run after its first switch.
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
from reorder.runtime.buffer import ReorderingBuffer
from reorder.runtime.calibration import FEATURES, Calibration, step_features

COST = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)


def hidden_ms(feats: np.ndarray, true: dict, base: float) -> float:
    return base + sum(true.get(f, 0.0) * float(feats[..., i].sum()) for i, f in enumerate(FEATURES))


def global_batches(seed, count, batch, seq_len, drift_at=None):
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


def run(rank, world, opts) -> dict:
    dv, dl = opts["vision_dp"], opts["language_dp"]
    b, w, n = opts["micro_batch"], opts["window"], opts["micro_batches"]
    modules = {"vision": [list(range(dv))], "language": [list(range(dv, dv + dl))]}
    if dv == 0:
        del modules["vision"]
    groups = build_groups(modules, overlap=False, timeout=datetime.timedelta(seconds=60))
    grid = groups.grid
    ex = WindowExchanger(grid=grid, micro_batch_size=b, cost=COST, window_size=w, collectives=groups.main)
    fit_group = groups.main if dv == 0 else TorchCollectives(dist.group.WORLD, dist.group.WORLD)
    cal = Calibration(mode=opts["mode"], window_size=w, every=opts["every"], min_r2=opts["min_r2"],
                      min_gain=opts["min_gain"], drift=opts["drift"], collectives=fit_group,
                      tag=int(groups.module == "language"))
    batches = list(global_batches(opts["seed"], n, b, opts["seq_len"]))
    source = (syn.rank_share(g, grid.dp, grid.rank) for g in batches)
    buf = ReorderingBuffer(source, ex)
    buf.calibrate(cal)
    rng = np.random.default_rng(1000 + rank)
    ids = []
    for k, mb in enumerate(buf):
        ids.append(mb["sample_id"].tolist())
        window = k // w
        true = opts["true2"] if opts.get("drift_at") is not None and window >= opts["drift_at"] else opts["true"]
        f = step_features(mb["input_ids"], mb["attention_mask"], COST).numpy()
        ms = max(hidden_ms(f, true, opts["base"]) + rng.normal(0, opts["noise"]), 0.0)
        if opts["timing"] == "slept":
            with buf.timed_step():
                time.sleep(ms / 1e3)
        else:  # "given": the hidden time itself, as a training loop that measures its own passes it
            assert buf.record_step_ms(ms)
        if k == 0:
            assert not buf.record_step_ms(float("nan"))  # refused, training goes on
    buf.close()
    mine = dict(rank=rank, module=groups.module, dp_rank=grid.rank, ids=ids,
                orders=[r.orders.tolist() for r in buf.reports], switches=list(cal.switches),
                weights=[np.array([r.weights.get(f, np.nan) for f in FEATURES]).tobytes() for r in cal.reports],
                active=[np.array([r.active[f] for f in FEATURES]).tobytes() for r in cal.reports],
                reports=[(r.window, r.r2, r.weights, r.predicted_gain, r.predicted_spread_current,
                          r.predicted_spread_fit, r.measured_spread, r.switched, r.reason) for r in cal.reports],
                rejected=cal.rejected)
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    # hidden-time spreads of the default, true and calibrated plans, per micro-batch after the first switch
    dp, groups_n = (dl, None), None
    lang = [e for e in everyone if e["module"] == "language" and e["dp_rank"] == 0][0]
    first = mine["switches"][0] if mine["switches"] else n // w
    sp = {"default": [], "true": [], "calibrated": []}
    g_count = int(np.lcm(dv, dl)) if dv else dl
    true_cost = CostModel(encoder_weight=opts["true"].get("patches", 0.0),
                          encoder_quadratic_weight=opts["true"].get("square_patches", 0.0),
                          encoder_image_weight=opts["true"].get("images", 0.0))
    for k in range(first * w, (opts.get("drift_at") or n // w) * w):
        g = batches[k]
        feats = sample_features(g)
        counts = [feats[:, 0] / 4, feats[:, 1], feats[:, 4]]
        base_c = COST.costs(counts[0], np.zeros(b))
        true_c = true_cost.costs(counts[0], np.zeros(b), counts[1], counts[2])
        sp["default"].append(spread_of(balanced(base_c, g_count), feats, dl, opts["true"], opts["base"]))
        sp["true"].append(spread_of(balanced(true_c, g_count), feats, dl, opts["true"], opts["base"]))
        sp["calibrated"].append(spread_of(np.array(lang["orders"][k // w][k % w]), feats, dl, opts["true"],
                                          opts["base"]))
    return dict(everyone=everyone, spreads={k: float(np.mean(v)) if v else float("nan") for k, v in sp.items()})


def launch(opts: dict, timeout: float = 120.0) -> dict:
    from reorder.cli.processes import run_processes

    return run_processes(run, opts["vision_dp"] + opts["language_dp"], (opts,), timeout=timeout)


DEFAULTS = dict(vision_dp=0, language_dp=4, micro_batch=16, window=2, micro_batches=32, seq_len=512, seed=3,
                every=3, mode="on", min_r2=0.8, min_gain=0.05, drift=0.25, base=0.5, noise=0.03, timing="slept",
                true={"patches": 0.002, "square_patches": 4e-5, "images": 0.15})

if __name__ == "__main__":
    import json

    out = launch(dict(DEFAULTS))
    print(json.dumps(out["spreads"]), [e["reports"] for e in out["everyone"][:1]])
