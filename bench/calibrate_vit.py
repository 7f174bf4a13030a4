"""Calibration on the benchmark ViT: the fitted cost model's predicted gain against the gain measured.

  python bench/calibrate_vit.py [--device cuda] [--dp 4] [--fit-windows 24] [--eval-windows 24]
                                [--json bench/results/calibrate_vit.json]

One process, the data-parallel ranks in sequence on one device: each rank's share of a global
micro-batch runs forward + backward through the ViT-like encoder of `bench/e2e_vision.py`, timed alone
(the device synchronized around it) after `--warm` untimed passes of the same share, so a rank's time
is what it ran and nothing else (not the first-seen-shape costs training pays once).

1. Fit: `--fit-windows` global micro-batches in their natural split; every rank's time and the
   features of what it ran (`reorder.runtime.calibration.step_features`) are the rows of one fit
   (`fit_rows`, the non-negative least squares every rank runs online): weights, R^2.
2. Evaluate, on `--eval-windows` new global micro-batches, three plans of each (`plan_window`): the
   natural split, the plan of the default cost model (patches) and the plan of the fitted one. Each
   rank's share under each plan is run and timed. Per plan: the measured max/mean spread of the
   per-rank times (mean over windows) and the step time a data-parallel step would take (the max
   over ranks, summed over windows); and the spread the fitted model predicts for it. A fit whose
   every weight is 0 (times no feature explains) plans nothing: its plan is the natural split.
3. The gains of the fitted plan over the default one: predicted (from the fitted model's predictions
   of both plans' per-rank times) and measured (from the timed runs), of the summed step time and of
   the spread.

Prints a table and writes JSON. Without a GPU it runs on the CPU (a smoke run: CPU times).
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
from bench.common import code_commit, cpu_name  # noqa: E402
from bench.e2e_vision import Encoder  # noqa: E402
from reorder.batch.counting import count_samples  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.plan.cost import CostModel  # noqa: E402
from reorder.plan.counts import SampleCounts  # noqa: E402
from reorder.plan.grid import Grid  # noqa: E402
from reorder.plan.window import PlanSettings, plan_window  # noqa: E402
from reorder.runtime.calibration import FEATURES, fit_rows, step_features, with_weights  # noqa: E402

DEFAULT = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)


def counts_of(batch: dict) -> SampleCounts:
    """The window counts of one global micro-batch (every column the cost model can weigh)."""
    c, _ = count_samples(DEFAULT, batch["input_ids"], batch.get("attention_mask"), squares=True)
    return SampleCounts.of(placeholders=c[0][None], real_tokens=c[1][None], images=c[2][None],
                           square_patches=c[3][None])


class Timer:
    """Forward + backward of one micro-batch through the encoder, timed alone (ms), after `warm`
    untimed passes of the same micro-batch: a shape seen for the first time costs allocator growth
    and kernel selection that training pays once, not every step."""

    def __init__(self, model, device, warm: int = 1):
        self.model, self.device, self.warm = model, device, warm
        self.dtype = next(model.parameters()).dtype

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, mb: dict) -> float:
        vit = mb["modality_inputs"]["images"]["vit"]
        patches = vit["hidden_states"].to(self.device, self.dtype)
        thw = vit["grid_thw"].cpu()
        for _ in range(self.warm + 1):  # the last pass is the timed one
            self.sync()
            t = time.perf_counter()
            if len(thw):
                self.model(patches, thw).backward()
            self.sync()
            ms = (time.perf_counter() - t) * 1e3
            for p in self.model.parameters():
                p.grad = None
        return ms


def rank_shares(batch: dict, order: np.ndarray, dp: int) -> list:
    """Each rank's micro-batch under the canonical order `order` (natural indices)."""
    b = len(order) // dp
    return [syn.take_samples(batch, order[r * b:(r + 1) * b]) for r in range(dp)]


def features_of(mb: dict) -> np.ndarray:
    return step_features(mb["input_ids"], mb.get("attention_mask"), DEFAULT).numpy()


def spread(times) -> float:
    t = np.asarray(times, dtype=np.float64)
    return float(t.max() / t.mean()) if t.mean() > 0 else 1.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dp", type=int, default=4)
    p.add_argument("--per-rank", type=int, default=4, help="samples per rank in a global micro-batch")
    p.add_argument("--fit-windows", type=int, default=24)
    p.add_argument("--eval-windows", type=int, default=24)
    p.add_argument("--warmup", type=int, default=3, help="untimed micro-batches first (kernels, allocator)")
    p.add_argument("--warm", type=int, default=1, help="untimed passes of each micro-batch before its timed one")
    p.add_argument("--mix", default="large")
    p.add_argument("--scale", type=float, default=1.0, help="image size scale of the mix")
    p.add_argument("--dim", type=int, default=384)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default="bench/results/calibrate_vit.json")
    args = p.parse_args()
    dev = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = Encoder(1176, args.dim, 16, args.layers).to(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
    timer = Timer(model, dev, args.warm)
    rng = np.random.default_rng(args.seed)
    B, dp = args.per_rank * args.dp, args.dp
    grid = Grid(size=dp, dp=dp, rank=0)

    def draw(k):
        return syn.make_global_batch(rng, B, 4096, features=1176, mix=args.mix, first_id=k * B, scale=args.scale)

    for k in range(args.warmup):
        timer(draw(-1 - k))
    rows, ms = [], []
    for k in range(args.fit_windows):  # natural split, every rank in turn
        for mb in rank_shares(draw(k), np.arange(B), dp):
            rows.append(features_of(mb))
            ms.append(timer(mb))
    fit = fit_rows(np.array(rows), np.array(ms))
    try:
        fitted = with_weights(DEFAULT, fit.weights)
    except ValueError:  # every weight 0 (times that no feature explains): no cost to plan by, natural order
        fitted = None

    plans = {"natural": None, "default cost": DEFAULT, "fitted cost": fitted}
    measured = {name: [] for name in plans}  # per window: per-rank ms
    predicted = {name: [] for name in plans}
    for k in range(args.eval_windows):
        g = draw(args.fit_windows + k)
        counts = counts_of(g)
        names = list(plans)
        for name in names[k % 3:] + names[:k % 3]:  # each plan first in a third of the windows
            cost = plans[name]
            order = np.arange(B) if cost is None else plan_window(counts, cost, grid, PlanSettings()).orders[0]
            shares = rank_shares(g, np.asarray(order), dp)
            measured[name].append([timer(mb) for mb in shares])
            predicted[name].append(fit.predict(np.array([features_of(mb) for mb in shares])).tolist())

    def figures(per_window):
        return {"spread": float(np.mean([spread(t) for t in per_window])),
                "step_ms": float(np.sum([max(t) for t in per_window]))}

    res = {"commit": code_commit(), "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_name(),
           "args": vars(args), "fit": {"weights": fit.weights, "intercept_ms": fit.intercept, "r2": fit.r2,
                                       "rms_ms": fit.rms, "rows": fit.rows, "usable": fitted is not None},
           "default_weights": {f: float(getattr(DEFAULT, w)) for f, w in zip(FEATURES, (
               "encoder_weight", "encoder_quadratic_weight", "language_weight", "language_quadratic_weight",
               "encoder_image_weight"))},
           "plans": {name: {"measured": figures(measured[name]), "predicted": figures(predicted[name])}
                     for name in plans}}
    d, f = res["plans"]["default cost"], res["plans"]["fitted cost"]
    res["gain_fitted_over_default"] = {
        kind: {"step_time": 1 - f[kind]["step_ms"] / d[kind]["step_ms"],
               "spread": 1 - (f[kind]["spread"] - 1) / (d[kind]["spread"] - 1) if d[kind]["spread"] > 1 else 0.0}
        for kind in ("predicted", "measured")}
    print(f"fit on {fit.rows} rows: R^2 {fit.r2:.3f}, intercept {fit.intercept:.3f} ms, "
          + ", ".join(f"{k} {v:.3g}" for k, v in fit.weights.items()))
    print(f"{'plan':>13} {'measured spread':>16} {'predicted spread':>17} {'measured step ms':>17} "
          f"{'predicted step ms':>18}")
    for name, r in res["plans"].items():
        print(f"{name:>13} {r['measured']['spread']:16.3f} {r['predicted']['spread']:17.3f} "
              f"{r['measured']['step_ms']:17.1f} {r['predicted']['step_ms']:18.1f}")
    for kind, g in res["gain_fitted_over_default"].items():
        print(f"fitted over default, {kind}: step time {100 * g['step_time']:+.1f} %, spread excess "
              f"{100 * g['spread']:+.1f} %")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
        print("wrote", args.json)


if __name__ == "__main__":
    main()
