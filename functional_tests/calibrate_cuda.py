"""`buf.timed_step()` on a GPU: the CUDA-event branch of online calibration.

One process, a dp-1 exchanger on the device (grid size 2), micro-batches of the synthetic Qwen-VL
data on the device, calibration on. Each step is `torch.cuda._sleep` for a hidden time of what the
micro-batch holds (ms = base + a * patches + c * images), inside `with buf.timed_step():`, and the
host never waits for it. Checks:
- every micro-batch of the windows the fits cover is a row, timed by the two CUDA events around its
  step, and the fits cover all but the last `every + lag` windows;
- the event times are the hidden ones: the fits explain them (R^2 >= 0.98) and the last fit's
  prediction of each micro-batch is within 5 % of its hidden time on average;
- timing adds no host sync: the host leaves the `with` block (median) in under half of the step's
  device time (a sync there would wait for the step's own sleep, so it would take all of it).

  python functional_tests/calibrate_cuda.py [--micro-batches 48]
  python functional_tests/calibrate_cuda.py --device cpu     # rehearsal: perf_counter around sleeps (rows only)

Prints one RESULT line (a dict with ok) and exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reorder import CostModel, Grid, WindowExchanger  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.runtime.buffer import ReorderingBuffer  # noqa: E402
from reorder.runtime.calibration import FEATURES, Calibration, step_features  # noqa: E402

COST = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
TRUE = {"patches": 0.004, "images": 0.3}  # ms per patch, per image
BASE = 0.5


def hidden_ms(feats: np.ndarray) -> float:
    return BASE + sum(TRUE.get(f, 0.0) * float(feats[i]) for i, f in enumerate(FEATURES))


def cycles_per_ms(dev) -> float:
    """torch.cuda._sleep's clock: cycles per millisecond, from one long sleep between events."""
    n = 50_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1_000_000)  # warm
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return n / start.elapsed_time(end)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--micro-batches", type=int, default=48)
    p.add_argument("--micro-batch", type=int, default=4)
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    rate = cycles_per_ms(dev) if cuda else None
    rng = np.random.default_rng(11)
    batches = [syn.to_device(syn.make_global_batch(rng, a.micro_batch, 512, features=4, mix="small",
                                                   first_id=k * a.micro_batch), dev)
               for k in range(a.micro_batches)]
    window = 2
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=a.micro_batch, cost=COST,
                         window_size=window, device=dev)
    cal = Calibration(mode="on", window_size=window, every=4, min_r2=0.5, history=8)
    buf = ReorderingBuffer(iter(batches), ex, calibration=cal)
    hidden, host_ms = [], []
    for mb in buf:
        f = step_features(mb["input_ids"], mb["attention_mask"], COST).cpu().numpy()
        ms = hidden_ms(f)
        hidden.append((f, ms))
        t0 = time.perf_counter()
        with buf.timed_step():
            if cuda:
                torch.cuda._sleep(int(ms * rate))
            else:
                time.sleep(ms / 1e3)
        host_ms.append((time.perf_counter() - t0) * 1e3)
    buf.close()
    if cuda:
        torch.cuda.synchronize()
    rows = sum(r.rows for r in cal.reports)
    expect = sum((r.window - cal.lag + 1 - r.first) * window for r in cal.reports)  # the fits' windows, whole
    last = cal.reports[-1] if cal.reports else None
    feats = np.stack([f for f, _ in hidden])
    truth = np.array([m for _, m in hidden])
    pred = (last.intercept + feats @ np.array([last.weights.get(f, 0.0) for f in FEATURES])) if last else truth * 0
    err = float(np.mean(np.abs(pred - truth) / truth))
    host_over_device = float(np.median(host_ms) / np.median(truth))
    covered = cal.reports[-1].window - cal.lag + 1 if cal.reports else 0
    checks = {"rows": rows == expect and covered >= a.micro_batches // window - cal.every - cal.lag}
    if cuda:  # host sleeps overshoot on a busy CPU: the rehearsal checks the rows only
        checks.update(r2=bool(last) and all(r.r2 >= 0.98 for r in cal.reports), prediction=err <= 0.05,
                      no_host_sync=host_over_device < 0.5)
    result = {"ok": all(checks.values()), "checks": checks, "device": torch.cuda.get_device_name(dev) if cuda
              else "cpu", "lag": cal.lag, "fits": len(cal.reports), "rows": rows, "rows_expected": expect,
              "r2": [round(r.r2, 4) for r in cal.reports], "mean_rel_error": round(err, 4),
              "weights": {k: round(v, 6) for k, v in (last.weights if last else {}).items()},
              "intercept": round(last.intercept, 4) if last else None, "true": TRUE, "base": BASE,
              "host_ms_median": round(float(np.median(host_ms)), 4),
              "device_ms_median": round(float(np.median(truth)), 4), "host_over_device": round(host_over_device, 4)}
    print("RESULT", result)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
