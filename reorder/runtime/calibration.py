"""Online cost-model calibration: measure each rank's step time, fit the same weights on every rank,
switch every rank's cost model at the same window.

The training loop times the step of each micro-batch it takes from the buffer (`buf.timed_step()`
or `buf.record_step_ms(ms)`); each rank keeps one row per micro-batch: the features of what it ran
(`reorder.integrations.calibrate.FEATURES`, summed over its samples) and the time. Every `every`
windows, right before a window's exchange and on the thread that exchanges, the ranks of the fit
group all-gather the rows of the last `every` complete windows in one fixed-size int64 frame,
sort the pooled rows by a stable key and fit the same non-negative least squares (`fit_rows`):
every rank gets bit-identical weights from bit-identical input. The decision (switch or not) is a
pure function of the pooled rows and of the state every rank shares, so every rank switches its
cost model before the same window.

Identical plans across modules: the plan of a window depends only on the gathered counts (the same
on every module) and the cost model. The fit group decides which ranks pool their rows. The module's
DP group (the default) is enough when one module plans (colocated modules, or a single module);
with several modules give a group spanning every rank of every module (e.g. the world): then every
rank of every module fits the same pooled rows (per-rank times of all modules, one weight vector)
and switches at the same window, so the plans stay identical across modules.

Modes: "off" (nothing measured), "shadow" (measure, fit, report the predicted gain, never switch),
"on" (switch when R^2 >= min_r2 and the predicted gain >= min_gain; after a switch, re-fit when
the active weights' RMS residual drifts above (1 + drift) x its value at the switch and the new fit
again passes both thresholds; the gain threshold is the hysteresis: weights close to the active
ones never pass it, so the weights do not flap).

Predicted spread of a cost model on the pooled rows: for each (module tag, window, slot), the
per-rank residuals e of the model's time prediction; after balancing by that model the per-rank
times are about mean + e, so the predicted max/mean spread is 1 + mean over steps of
(max e - mean e) / mean time. The current weights are scaled to time by a one-parameter fit
(time ~ c + s * current cost). Predicted gain = 1 - (predicted spread new - 1) / (predicted spread current - 1).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from reorder.plan.cost import CostModel

log = logging.getLogger("reorder")

MODES = ("off", "shadow", "on")
FEATURES = ("patches", "square_patches", "tokens", "square_tokens", "images")
_WEIGHT_OF = {"patches": "encoder_weight", "square_patches": "encoder_quadratic_weight", "tokens": "language_weight",
              "square_tokens": "language_quadratic_weight", "images": "encoder_image_weight"}
# a frame row: valid, window, slot, tag, the features, ms
_ROW = 4 + len(FEATURES) + 1
_HEADER = 4  # every, window_size, lag, frame rows


def step_features(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, cost: CostModel) -> torch.Tensor:
    """float64 [5] on input_ids' device (no host synchronization): summed patches, per-image patches^2,
    real tokens, real tokens^2 and images of one micro-batch (`FEATURES`; the same numbers as
    `reorder.integrations.calibrate.micro_batch_features`)."""
    from reorder.batch.counting import _square_runs_torch

    ph = input_ids == cost.image_token_id
    merge2 = cost.spatial_merge_size ** 2
    if attention_mask is None:
        real = torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.int64, device=input_ids.device)
    else:
        real = (attention_mask != 0).sum(dim=1)
    parts = [ph.sum() * merge2, (_square_runs_torch(ph) * merge2 * merge2).sum(), real.sum(), (real * real).sum(),
             (input_ids == cost.vision_start_token_id).sum()]
    return torch.stack([p.to(torch.int64) for p in parts]).to(torch.float64)


# ---- the fit --------------------------------------------------------------------------------------

def nnls(a: np.ndarray, y: np.ndarray, *, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - y|| subject to x >= 0 (Lawson-Hanson active set), plain numpy; the same float
    operations in the same order for the same input, so the same bits on every rank."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    y = np.ascontiguousarray(y, dtype=np.float64)
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(np.float64).eps * np.linalg.norm(a, 1) * max(m, n)
    for _ in range(max_iter or 3 * n + 10):
        w = a.T @ (y - a @ x)
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, w, -np.inf)))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            bad = passive & (z <= 0)
            alpha = np.min(x[bad] / (x[bad] - z[bad]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


@dataclass(frozen=True, slots=True)
class RowFit:
    """Weights (ms per feature unit, by FEATURES name), intercept (ms), R^2 and RMS residual (ms)."""

    weights: dict
    intercept: float
    r2: float
    rms: float
    rows: int


def sort_rows(rows: np.ndarray) -> np.ndarray:
    """The rows in a stable order that does not depend on which rank sent them: by window, slot,
    tag, then every other column (lexicographic on the values)."""
    keys = [rows[:, i] for i in reversed(range(rows.shape[1]))]
    return rows[np.lexsort(keys)]


def fit_rows(features: np.ndarray, ms: np.ndarray) -> RowFit:
    """ms ~ c + features @ w, w >= 0, c >= 0, columns scaled to [0, 1] for conditioning; a feature
    that is zero on every row gets weight 0 (not identifiable)."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(ms, dtype=np.float64)
    top = x.max(axis=0) if len(x) else np.zeros(x.shape[1])
    scale = np.where(top > 0, top, 1.0)
    a = np.hstack([x / scale, np.ones((len(y), 1))])
    sol = nnls(a, y)
    pred = a @ sol
    res = y - pred
    ss_res = float(res @ res)
    dev = y - y.mean()
    ss_tot = float(dev @ dev)
    w = sol[:-1] / scale
    return RowFit(weights=dict(zip(FEATURES, w.tolist())), intercept=float(sol[-1]),
                  r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0, rms=math.sqrt(ss_res / max(len(y), 1)),
                  rows=len(y))


def cost_weights(cost: CostModel) -> np.ndarray:
    """The cost model's weights in FEATURES order."""
    return np.array([getattr(cost, _WEIGHT_OF[f]) for f in FEATURES], dtype=np.float64)


def with_weights(cost: CostModel, weights: dict) -> CostModel:
    """`cost` with the fitted weights (token ids and merge size kept)."""
    return dataclasses.replace(cost, **{_WEIGHT_OF[f]: float(weights[f]) for f in FEATURES})


def predicted_spread(rows: np.ndarray, pred: np.ndarray) -> float:
    """1 + mean over steps (tag, window, slot) of (max - mean of the per-rank residuals) / mean time."""
    res = rows[:, -1] - pred
    key = rows[:, 1:4]
    _, step = np.unique(key, axis=0, return_inverse=True)
    step = step.reshape(-1)
    total = 0.0
    count = 0
    for s in range(int(step.max()) + 1 if len(step) else 0):
        pick = step == s
        if pick.sum() < 2:
            continue
        r = res[pick]
        total += (r.max() - r.mean()) / max(rows[pick, -1].mean(), 1e-12)
        count += 1
    return 1.0 + total / count if count else 1.0


def measured_spread(rows: np.ndarray) -> float:
    """Mean over steps (tag, window, slot) of max/mean of the measured per-rank times."""
    _, step = np.unique(rows[:, 1:4], axis=0, return_inverse=True)
    step = step.reshape(-1)
    vals = []
    for s in range(int(step.max()) + 1 if len(step) else 0):
        t = rows[step == s, -1]
        if len(t) >= 2 and t.mean() > 0:
            vals.append(t.max() / t.mean())
    return float(np.mean(vals)) if vals else 1.0


def scaled_prediction(rows: np.ndarray, cost: CostModel) -> tuple[np.ndarray, float]:
    """(time predicted by `cost` scaled to ms by time ~ c + s * cost, s, c >= 0; its RMS residual)."""
    c = rows[:, 4:4 + len(FEATURES)] @ cost_weights(cost)
    top = c.max() if len(c) and c.max() > 0 else 1.0
    a = np.stack([c / top, np.ones(len(c))], axis=1)
    sol = nnls(a, rows[:, -1])
    pred = a @ sol
    res = rows[:, -1] - pred
    return pred, math.sqrt(float(res @ res) / max(len(res), 1))


@dataclass(frozen=True, slots=True)
class CalibrationReport:
    """One fit: at the exchange of `window`, from the rows of windows [first, window - lag)."""

    window: int
    first: int
    rows: int
    weights: dict  # fitted, ms per feature unit
    intercept: float
    r2: float
    rms: float
    predicted_spread_current: float  # of the active cost model on these rows
    predicted_spread_fit: float  # of the fitted weights on these rows
    predicted_gain: float
    measured_spread: float  # mean over steps of max/mean measured per-rank time, these rows
    switched: bool  # the fitted weights are active from `window` on
    reason: str
    active: dict  # the weights in force from `window` on (FEATURES order names)


# ---- the online loop ------------------------------------------------------------------------------

class Calibration:
    """Measurements and fits of one rank (see the module docstring).

    mode: "off" / "shadow" / "on"; window_size: W (rows per window); every: K windows per fit;
    min_r2, min_gain, drift: thresholds of "on"; collectives: the fit group (None: this rank alone);
    lag: complete windows a fit waits for (the buffer sets it: 1, ahead + 1 with overlap, + 1 on
    CUDA so the events are done); tag: this rank's module index in the fit group."""

    def __init__(self, *, mode: str = "shadow", window_size: int = 1, every: int = 4, min_r2: float = 0.8,
                 min_gain: float = 0.05, drift: float = 0.25, collectives=None, lag: int = 1, tag: int = 0,
                 log_fits: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid: expected one of {MODES}")
        for name, v, lo in (("window_size", window_size, 1), ("every", every, 1), ("lag", lag, 1), ("tag", tag, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ValueError(f"{name}={v!r} is invalid: must be an integer >= {lo}")
        for name, v in (("min_r2", min_r2), ("min_gain", min_gain), ("drift", drift)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r} is invalid: must be a finite number >= 0")
        self.mode, self.window_size, self.every, self.lag, self.tag = mode, window_size, every, lag, tag
        self.min_r2, self.min_gain, self.drift = float(min_r2), float(min_gain), float(drift)
        self.collectives = collectives
        self.log_fits = log_fits
        self.reports: list[CalibrationReport] = []
        self.switches: list[int] = []  # windows from which new weights were active
        self.rejected = 0  # measurements refused (not finite, negative)
        self._rows: dict = {}  # window -> {slot: (features, ms or (start, end) events)}
        self._lock = threading.Lock()
        self._calls = 0  # exchanges seen (the window index of the next exchange)
        self._active_rms = None  # RMS residual of the active fitted weights when they were switched to
        self._served = None  # (window, slot, micro-batch) last taken from the buffer
        self._cost_of = None  # current cost model getter (set by the buffer)

    @property
    def rank0(self) -> bool:
        return self.collectives is None or self.collectives.rank == 0

    @property
    def last(self) -> CalibrationReport | None:
        return self.reports[-1] if self.reports else None

    # ---- measuring (training thread) ------------------------------------------------------------

    def served(self, window: int, slot: int, micro_batch) -> None:
        self._served = (window, slot, micro_batch)

    def _features_of_served(self, cost: CostModel):
        if self._served is None:
            raise RuntimeError("no micro-batch taken from the buffer yet: time the step of a micro-batch after next()")
        window, slot, mb = self._served
        ids = mb.get("input_ids") if isinstance(mb, dict) else None
        if not isinstance(ids, torch.Tensor):
            raise ValueError("the micro-batch has no 'input_ids' tensor: its features cannot be computed")
        return window, slot, step_features(ids, mb.get("attention_mask"), cost)

    def record_step_ms(self, ms, cost: CostModel) -> bool:
        """Record the step time of the micro-batch last taken; False (and a warning naming the value)
        when the time is not a finite number >= 0 (training goes on, the sample is dropped)."""
        if self.mode == "off":
            return False
        try:
            v = float(ms)
        except (TypeError, ValueError):
            v = math.nan
        if isinstance(ms, bool) or not math.isfinite(v) or v < 0:
            self.rejected += 1
            log.warning("reorder calibration: step time %r ms refused (must be a finite number >= 0); "
                        "the measurement is dropped", ms)
            return False
        window, slot, feats = self._features_of_served(cost)
        with self._lock:
            self._rows.setdefault(window, {})[slot] = (feats, v)
        return True

    @contextlib.contextmanager
    def timed_step(self, cost: CostModel):
        """Time the body (forward + backward of the micro-batch last taken): perf_counter on the CPU,
        CUDA events on a CUDA micro-batch (read back at the fit, no synchronization here)."""
        if self.mode == "off":
            yield
            return
        window, slot, feats = self._features_of_served(cost)
        if feats.is_cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            with self._lock:
                self._rows.setdefault(window, {})[slot] = (feats, (start, end))
            return
        t0 = time.perf_counter()
        yield
        with self._lock:
            self._rows.setdefault(window, {})[slot] = (feats, (time.perf_counter() - t0) * 1e3)

    # ---- fitting (exchange thread) --------------------------------------------------------------

    def frame_rows(self) -> int:
        return self.every * self.window_size

    def _frame(self, first: int, stop: int) -> np.ndarray:
        """This rank's fixed-size frame (int64 words: header, then rows as float64 bits)."""
        rows = np.zeros((self.frame_rows(), _ROW), dtype=np.float64)
        with self._lock:
            taken = {w: self._rows.pop(w) for w in list(self._rows) if w < stop}
        i = 0
        for w in range(first, stop):
            for slot, (feats, ms) in sorted(taken.get(w, {}).items()):
                if slot >= self.window_size:
                    continue
                if isinstance(ms, tuple):
                    ms[1].synchronize()  # done long ago (lag): no stall in practice
                    ms = float(ms[0].elapsed_time(ms[1]))
                f = feats.cpu().numpy()
                ok = math.isfinite(ms) and ms >= 0 and np.isfinite(f).all()
                rows[i] = [1.0 if ok else 0.0, w, slot, self.tag, *f.tolist(), ms if ok else 0.0]
                i += 1
        head = np.array([self.every, self.window_size, self.lag, self.frame_rows()], dtype=np.int64)
        return np.concatenate([head, rows.reshape(-1).view(np.int64)])

    def _gather(self, frame: np.ndarray) -> np.ndarray:
        if self.collectives is None:
            return frame[None]
        return self.collectives.all_gather(torch.from_numpy(frame)).numpy()

    def before_window(self, cost: CostModel) -> CostModel | None:
        """Called on every rank of the fit group before each exchange (empty end-of-stream windows
        included, so every rank calls it equally often). Returns the cost model to use from this
        window on when it changes, else None."""
        j = self._calls
        self._calls += 1
        if self.mode == "off":
            return None
        stop = j - self.lag + 1  # windows < stop are complete
        if stop < self.every or stop % self.every:
            return None
        frames = self._gather(self._frame(stop - self.every, stop))
        heads = frames[:, :_HEADER]
        if not (heads == heads[0]).all():
            raise ValueError(f"calibration settings differ across the fit group (every, window_size, lag, rows): "
                             f"{heads.tolist()}")
        rows = frames[:, _HEADER:].copy().view(np.float64).reshape(-1, _ROW)
        rows = sort_rows(rows[rows[:, 0] == 1.0])
        return self._decide(j, stop - self.every, rows, cost)

    def _decide(self, window: int, first: int, rows: np.ndarray, cost: CostModel) -> CostModel | None:
        nfeat = len(FEATURES)
        if len(rows) < nfeat + 2:
            self._report(window, first, rows, None, cost, False, f"{len(rows)} measurements: too few to fit")
            return None
        fit = fit_rows(rows[:, 4:4 + nfeat], rows[:, -1])
        pred_fit = rows[:, 4:4 + nfeat] @ np.array([fit.weights[f] for f in FEATURES]) + fit.intercept
        pred_cur, rms_cur = scaled_prediction(rows, cost)
        s_cur, s_fit = predicted_spread(rows, pred_cur), predicted_spread(rows, pred_fit)
        gain = 1.0 - (s_fit - 1.0) / (s_cur - 1.0) if s_cur > 1.0 else 0.0
        new = None
        if self.mode == "shadow":
            reason = "shadow: never switches"
        elif fit.r2 < self.min_r2:
            reason = f"R^2 {fit.r2:.3f} < min_r2 {self.min_r2}"
        elif gain < self.min_gain:
            reason = f"predicted gain {gain:.3f} < min_gain {self.min_gain}"
        elif self._active_rms is not None and rms_cur <= (1.0 + self.drift) * self._active_rms:
            reason = f"active weights hold (RMS residual {rms_cur:.4g} <= (1 + drift) x {self._active_rms:.4g})"
        else:
            try:
                new = with_weights(cost, fit.weights)
            except ValueError as e:  # every weight zero: nothing to balance
                reason = f"fitted weights unusable: {e}"
            else:
                reason = "switched" if self._active_rms is None else "re-fitted after drift"
                self._active_rms = fit.rms
                self.switches.append(window)
        self._report(window, first, rows, fit, new or cost, new is not None, reason, s_cur, s_fit, gain)
        return new

    def _report(self, window, first, rows, fit, active, switched, reason, s_cur=math.nan, s_fit=math.nan,
                gain=math.nan):
        nan = math.nan
        r = CalibrationReport(window=window, first=first, rows=len(rows),
                              weights={} if fit is None else fit.weights,
                              intercept=nan if fit is None else fit.intercept, r2=nan if fit is None else fit.r2,
                              rms=nan if fit is None else fit.rms, predicted_spread_current=s_cur,
                              predicted_spread_fit=s_fit, predicted_gain=gain,
                              measured_spread=measured_spread(rows) if len(rows) else nan, switched=switched,
                              reason=reason, active=dict(zip(FEATURES, cost_weights(active).tolist())))
        self.reports.append(r)
        if self.log_fits and self.rank0:
            log.info("reorder calibration (%s) at window %d, %d rows: weights %s, intercept %.4g ms, R^2 %.3f, "
                     "predicted spread %.3f -> %.3f (gain %.3f), measured spread %.3f: %s", self.mode, window, r.rows,
                     {k: float(f"{v:.4g}") for k, v in r.weights.items()}, r.intercept, r.r2,
                     s_cur, s_fit, gain, r.measured_spread, reason)
