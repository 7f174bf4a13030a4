"""Online cost-model calibration: measure each rank's step time, fit the same weights on every rank,
switch every rank's cost model at the same window.

Measuring. The training loop times the step of each micro-batch it takes from the buffer
(`buf.timed_step()` or `buf.record_step_ms(ms)`); each rank keeps one row per micro-batch: the
features of what it ran (`FEATURES`, summed over its samples) and the time. A time that is not a
finite number >= 0 is refused with a warning naming it (the micro-batch goes unmeasured, training
goes on).

Fitting. Every `every` windows, right before a window's exchange and on the thread that exchanges,
the ranks of the fit group all-gather the rows of the last `every` complete windows in one
fixed-size int64 frame, after a fixed-size header of every rank's settings and active weights (a
difference raises the same ValueError on every rank, naming the field and the values). Every rank sorts the
pooled rows by a stable key and fits the same non-negative least squares (`fit_rows`), whose float
operations do not depend on the platform: exactly rounded sums (`math.fsum`) of elementwise
products and a fixed-order elimination in Python floats, no BLAS. The pool holds the rows of the
last `history` fits of the current regime, so the weights sharpen as the rows accumulate. Every
decision is a pure function of the gathered frames and of the state every rank shares, so every
rank switches its cost model before the same window.

Deciding. "off": nothing measured. "shadow": measure, fit, report the predicted gain, never switch.
"on": switch when the fit's R^2 >= min_r2 and its predicted gain >= min_gain (and the predicted
spread drops by at least MIN_SPREAD_DROP, 0.1 % of a step: below that both spreads are noise). Within a regime the
active weights are refined only when the pool holds at least twice the rows of the fit they came
from (and the refined fit passes both thresholds again), so the weights settle instead of flapping.
A new regime starts when the step time drifts: the last fit (of a pool of two blocks or more)
misses two consecutive blocks of new rows, its RMS residual on each above (1 + drift) x the residual
it expects on new rows (its noise estimate, inflated for its own error). One block alone is a
suspicion, reported; its rows join the pool if the next block clears it. On the second the pool
restarts from the new rows (and the suspected ones, where a fit of the new rows predicts them
better than the last fit), provided the last fit also misses the new rows by (1 + drift) x their own
noise (from their own fit: a check independent of the last fit's noise estimate), and the re-fit
switches when it passes both thresholds.

Handled together, never raised alone: a refused time (that rank's row is missing), a rank of the
fit group that sent no time for the fit's windows (the fit holds the active weights and names the
rank), too few rows to fit (holds), a fit that is not finite (holds). Raised on every rank
together: settings or active weights that differ across the fit group.

Identical plans across modules: the plan of a window depends only on the gathered counts (the same
on every module) and the cost model. The fit group decides which ranks pool their rows. The module's
DP group is enough when one module plans (colocated modules, or a single module); with several
modules give a group spanning every rank of every module (`wrap` does): every rank of every module
then fits the same pooled rows (per-rank times of all modules, one weight vector) and switches at the
same window.

Predicted spread of a cost model on pooled rows: for each (window, slot, module tag), the per-rank
residuals e of the model's time prediction; after balancing by that model the per-rank times are
about mean + e, so the predicted max/mean spread is 1 + mean over steps of (max e - mean e) / mean
time. The active weights are scaled to time by a one-parameter fit (time ~ c + s * active cost).
Predicted gain = 1 - (predicted spread fit - 1) / (predicted spread active - 1). Each switch is
paired with what followed (`SwitchOutcome`): the measured and predicted spread of the rows the old
weights planned, the spread the new weights predict, and the spread measured on the rows they planned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
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
# the frame header: these settings (floats as their bits), then the active weights' bits and the switch count
_SETTINGS = ("mode", "every", "window_size", "lag", "history", "frame_rows", "min_r2", "min_gain", "drift")
_HEADER = len(_SETTINGS) + len(FEATURES) + 1
MIN_ROWS = len(FEATURES) + 2  # the weights, an intercept and one residual
# a switch must also lower the predicted max/mean spread by this much (0.1 % of a step): below it the
# relative gain measures the fit's own noise (both spreads at the noise floor)
MIN_SPREAD_DROP = 1e-3
RECORD = " | record "  # what precedes the JSON record of a fit in its log line


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


# ---- the fit: platform-independent float operations ------------------------------------------------

def _dot(u: np.ndarray, v: np.ndarray) -> float:
    """Exactly rounded sum of the elementwise products (one IEEE multiply each): the same bits on any
    platform, whatever the order of the rows' arrival."""
    return math.fsum((u * v).tolist())


def _solve(g: list, b: list) -> list:
    """g z = b for a small symmetric positive semi-definite g: elimination in Python floats in a fixed
    order (no pivoting, stable for such g); a pivot that vanishes (a column dependent on earlier ones)
    gets coefficient 0."""
    n = len(b)
    a = [list(g[i]) + [b[i]] for i in range(n)]
    top = max((a[i][i] for i in range(n)), default=0.0)
    skip = [False] * n
    for k in range(n):
        if not a[k][k] > 1e-13 * top:
            skip[k] = True
            continue
        for i in range(k + 1, n):
            f = a[i][k] / a[k][k]
            for j in range(k, n + 1):
                a[i][j] = a[i][j] - f * a[k][j]
    z = [0.0] * n
    for k in reversed(range(n)):
        if not skip[k]:
            z[k] = (a[k][n] - math.fsum(a[k][j] * z[j] for j in range(k + 1, n))) / a[k][k]
    return z


def nnls(a: np.ndarray, y: np.ndarray, *, max_iter: int | None = None) -> np.ndarray:
    """min ||a x - y|| subject to x >= 0 (Lawson-Hanson active set on the normal equations, columns
    scaled to unit norm). The Gram matrix and a^T y are exactly rounded sums, the solves run in
    Python floats in a fixed order: the same bits on every rank and platform for the same rows, in
    whatever order they come."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    y = np.ascontiguousarray(y, dtype=np.float64)
    m, n = a.shape
    cols = [a[:, i].copy() for i in range(n)]
    raw = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i, n):
            raw[i][j] = raw[j][i] = _dot(cols[i], cols[j])
    d = [math.sqrt(raw[i][i]) if raw[i][i] > 0 else 1.0 for i in range(n)]
    g = [[raw[i][j] / d[i] / d[j] for j in range(n)] for i in range(n)]
    b = [_dot(cols[i], y) / d[i] for i in range(n)]
    tol = 10 * np.finfo(np.float64).eps * max(m, n, 1) * max(math.sqrt(_dot(y, y)), 1e-300)
    x = [0.0] * n
    passive = [False] * n
    blocked = [False] * n  # entered and left at once with x unchanged: not again until x moves
    for _ in range(max_iter or 3 * n + 10):
        w = [b[i] - math.fsum(g[i][j] * x[j] for j in range(n)) for i in range(n)]
        candidates = [i for i in range(n) if not passive[i] and not blocked[i] and w[i] > tol]
        if not candidates:
            break
        t = max(candidates, key=lambda i: (w[i], -i))
        passive[t] = True
        start = x
        while True:
            idx = [i for i in range(n) if passive[i]]
            if not idx:
                break
            zs = _solve([[g[i][j] for j in idx] for i in idx], [b[i] for i in idx])
            z = [0.0] * n
            for k, i in enumerate(idx):
                z[i] = zs[k]
            if all(z[i] > 0 for i in idx):
                x = z
                break
            # the step to the first passive coordinate that reaches 0 on the way to z; that one leaves
            # exactly (by index, not by the rounded value: a step that underflows would leave it a
            # positive denormal for ever), with any other the rounding put at or below 0
            alpha, out = min((x[i] / (x[i] - z[i]) if x[i] - z[i] > 0 else 0.0, i) for i in idx if z[i] <= 0)
            x = [x[i] + alpha * (z[i] - x[i]) for i in range(n)]
            x[out] = 0.0
            for i in idx:
                if not x[i] > 0:
                    passive[i] = False
                    x[i] = 0.0
        if x == start:
            blocked[t] = True
        else:
            blocked = [False] * n
    return np.array([x[i] / d[i] for i in range(n)], dtype=np.float64)


def _combine(x: np.ndarray, coef, intercept: float) -> np.ndarray:
    """intercept + x @ coef, one elementwise step per column in column order (no BLAS)."""
    out = np.full(len(x), float(intercept))
    for k, c in enumerate(coef):
        out = out + x[:, k] * float(c)
    return out


@dataclass(frozen=True, slots=True)
class RowFit:
    """Weights (ms per feature unit, by FEATURES name), intercept (ms), R^2 and RMS residual (ms)."""

    weights: dict
    intercept: float
    r2: float
    rms: float
    rows: int
    params: int = 0  # coefficients > 0, the intercept included

    @property
    def expected_rms(self) -> float:
        """The RMS residual to expect on new rows of the same step time: the noise estimate
        sqrt(ss_res / (rows - params)), inflated by sqrt(1 + params / rows) for the fit's own error."""
        n, p = self.rows, self.params
        sigma = self.rms * math.sqrt(n / max(n - p, 1))
        return sigma * math.sqrt(1.0 + p / max(n, 1))

    def predict(self, features: np.ndarray) -> np.ndarray:
        return _combine(np.asarray(features, dtype=np.float64), [self.weights[f] for f in FEATURES], self.intercept)


def sort_rows(rows: np.ndarray) -> np.ndarray:
    """The rows in a stable order that does not depend on which rank sent them: by window, slot,
    tag, then every other column (lexicographic on the values)."""
    keys = [rows[:, i] for i in reversed(range(rows.shape[1]))]
    return rows[np.lexsort(keys)]


def _rms(res: np.ndarray) -> float:
    return math.sqrt(_dot(res, res) / max(len(res), 1))


def fit_rows(features: np.ndarray, ms: np.ndarray) -> RowFit:
    """ms ~ c + features @ w, w >= 0, c >= 0, columns scaled to [0, 1] for conditioning; a feature
    that is zero on every row gets weight 0 (not identifiable)."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(ms, dtype=np.float64)
    top = x.max(axis=0) if len(x) else np.zeros(x.shape[1])
    scale = np.where(top > 0, top, 1.0)
    a = np.hstack([x / scale, np.ones((len(y), 1))])
    sol = nnls(a, y)
    res = y - _combine(a[:, :-1], sol[:-1], sol[-1])
    ss_res = _dot(res, res)
    dev = y - math.fsum(y.tolist()) / max(len(y), 1)
    ss_tot = _dot(dev, dev)
    w = sol[:-1] / scale
    return RowFit(weights=dict(zip(FEATURES, w.tolist())), intercept=float(sol[-1]),
                  r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 0.0, rms=math.sqrt(ss_res / max(len(y), 1)),
                  rows=len(y), params=int((sol > 0).sum()))


def cost_weights(cost: CostModel) -> np.ndarray:
    """The cost model's weights in FEATURES order."""
    return np.array([getattr(cost, _WEIGHT_OF[f]) for f in FEATURES], dtype=np.float64)


def with_weights(cost: CostModel, weights: dict) -> CostModel:
    """`cost` with the fitted weights (token ids and merge size kept)."""
    return dataclasses.replace(cost, **{_WEIGHT_OF[f]: float(weights[f]) for f in FEATURES})


def _steps(rows: np.ndarray) -> list:
    """Index arrays of the rows of each step (window, slot, tag), in key order."""
    if not len(rows):
        return []
    order = np.lexsort((rows[:, 3], rows[:, 2], rows[:, 1]))
    keys = rows[order, 1:4]
    cuts = np.flatnonzero((keys[1:] != keys[:-1]).any(axis=1)) + 1
    return np.split(order, cuts)


def predicted_spread(rows: np.ndarray, pred: np.ndarray) -> float:
    """1 + mean over steps (window, slot, tag) of (max - mean of the per-rank residuals) / mean time."""
    res = rows[:, -1] - pred
    terms = []
    for pick in _steps(rows):
        if len(pick) < 2:
            continue
        r = res[pick]
        mean_t = math.fsum(rows[pick, -1].tolist()) / len(pick)
        terms.append((float(r.max()) - math.fsum(r.tolist()) / len(pick)) / max(mean_t, 1e-12))
    return 1.0 + math.fsum(terms) / len(terms) if terms else 1.0


def measured_spread(rows: np.ndarray) -> float:
    """Mean over steps (window, slot, tag) of max/mean of the measured per-rank times (1.0 without a
    step measured on two ranks)."""
    vals = []
    for pick in _steps(rows):
        t = rows[pick, -1]
        mean_t = math.fsum(t.tolist()) / len(t)
        if len(t) >= 2 and mean_t > 0:
            vals.append(float(t.max()) / mean_t)
    return math.fsum(vals) / len(vals) if vals else 1.0


def scaled_prediction(rows: np.ndarray, cost: CostModel) -> tuple[np.ndarray, float]:
    """(time predicted by `cost` scaled to ms by time ~ c + s * cost, s, c >= 0; its RMS residual)."""
    c = _combine(rows[:, 4:4 + len(FEATURES)], cost_weights(cost), 0.0)
    top = float(c.max()) if len(c) and c.max() > 0 else 1.0
    a = np.stack([c / top, np.ones(len(c))], axis=1)
    sol = nnls(a, rows[:, -1])
    pred = _combine(a[:, :1], sol[:1], sol[1])
    return pred, _rms(rows[:, -1] - pred)


def _gain(rows: np.ndarray, pred_cur: np.ndarray, pred_fit: np.ndarray) -> tuple:
    """(predicted spread of the active weights, of the fit, the fit's predicted gain) on `rows`."""
    s_cur, s_fit = predicted_spread(rows, pred_cur), predicted_spread(rows, pred_fit)
    return s_cur, s_fit, (1.0 - (s_fit - 1.0) / (s_cur - 1.0) if s_cur - 1.0 > 1e-9 else 0.0)


# ---- reports ---------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class SwitchOutcome:
    """A switch at `window` and what followed: the rows the old weights planned (windows since they
    became active, up to the switch) measured `measured_before` (mean over steps of max/mean per-rank
    step time); on those rows the old weights predicted `predicted_before`, the new ones
    `predicted_after`; the rows the new weights planned (the windows >= `window` of the next fit)
    measured `measured_after`, where the new weights predicted `predicted_after_seen`."""

    window: int
    rows_before: int
    measured_before: float
    predicted_before: float
    predicted_after: float
    rows_after: int = 0
    measured_after: float = math.nan
    predicted_after_seen: float = math.nan


@dataclass(frozen=True, slots=True)
class CalibrationReport:
    """One fit: at the exchange of `window`, `rows` new rows of windows [first, window - lag] joined
    the pool, and `pooled` rows were fitted."""

    window: int
    first: int
    rows: int  # new rows (every rank's micro-batches of the fit's windows)
    weights: dict  # fitted, ms per feature unit ({} without a fit)
    intercept: float
    r2: float
    rms: float
    predicted_spread_current: float  # of the active cost model on the pooled rows
    predicted_spread_fit: float  # of the fitted weights on the pooled rows
    predicted_gain: float
    measured_spread: float  # mean over steps of max/mean measured per-rank time, the new rows
    switched: bool  # the fitted weights are active from `window` on
    reason: str
    active: dict  # the weights in force from `window` on (FEATURES order names)
    pooled: int = 0  # rows fitted (this regime's last `history` fits)
    active_since: int = 0  # the window the active weights hold since (0: the configured ones)
    drift: bool = False  # a drift was confirmed at this fit: the pool restarted
    outcome: SwitchOutcome | None = None  # the last switch's outcome, completed at this fit
    mode: str = "on"

    def record(self) -> dict:
        """JSON-ready (floats as Python floats, NaN as null)."""
        def clean(v):
            if isinstance(v, float):
                return v if math.isfinite(v) else None
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return v

        out = {f.name: clean(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "outcome"}
        out["outcome"] = None if self.outcome is None else clean(dataclasses.asdict(self.outcome))
        return out


# ---- the online loop ------------------------------------------------------------------------------

def _check_settings(name, v, lo):
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name}={v!r} is invalid: must be an integer >= {lo}")


class Calibration:
    """Measurements and fits of one rank (see the module docstring).

    mode: "off" / "shadow" / "on"; window_size: W (rows per window); every: K windows per fit;
    min_r2, min_gain, drift: thresholds of "on"; history: fits whose rows the pool keeps;
    collectives: the fit group (None: this rank alone); lag: complete windows a fit waits for (the
    buffer sets it: 1, ahead + 1 with overlap, + 1 on CUDA so the events are done); tag: this rank's
    module index in the fit group."""

    def __init__(self, *, mode: str = "shadow", window_size: int = 1, every: int = 4, min_r2: float = 0.8,
                 min_gain: float = 0.05, drift: float = 0.25, history: int = 8, collectives=None, lag: int = 1,
                 tag: int = 0, log_fits: bool = True):
        if mode not in MODES:
            raise ValueError(f"mode={mode!r} is invalid: expected one of {MODES}")
        for name, v, lo in (("window_size", window_size, 1), ("every", every, 1), ("lag", lag, 1), ("tag", tag, 0),
                            ("history", history, 1)):
            _check_settings(name, v, lo)
        for name, v in (("min_r2", min_r2), ("min_gain", min_gain), ("drift", drift)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r} is invalid: must be a finite number >= 0")
        self.mode, self.window_size, self.every, self.lag, self.tag = mode, window_size, every, lag, tag
        self.history = history
        self.min_r2, self.min_gain, self.drift = float(min_r2), float(min_gain), float(drift)
        self.collectives = collectives
        self.log_fits = log_fits
        self.reports: list[CalibrationReport] = []
        self.switches: list[int] = []  # windows from which new weights were active
        self.outcomes: list[SwitchOutcome] = []  # completed switch outcomes
        self.rejected = 0  # measurements refused (not finite, negative, nothing to attribute them to)
        self._rows: dict = {}  # window -> {slot: (features, ms or (start, end) events)}
        self._lock = threading.Lock()
        self._calls = 0  # exchanges seen (the window index of the next exchange)
        self._pool: list = []  # row blocks of this regime's last `history` fits
        self._pending = None  # a block under drift suspicion
        self._ref: RowFit | None = None  # the last fit of the pool
        self._switch_rows = None  # pooled rows of the fit the active weights came from, this regime
        self._active_since = 0
        self._active_fit: RowFit | None = None
        self._open: SwitchOutcome | None = None  # the last switch, waiting for the rows it planned
        self._active_bits = None  # the active weights' float64 bits as int64 (None: the configured ones)
        self._served = None  # (window, slot, micro-batch) last taken from the buffer
        self._carry = None  # (first window, rows) of a fit with too few rows, for the next one

    @property
    def rank0(self) -> bool:
        return self.collectives is None or self.collectives.rank == 0

    @property
    def active_since(self) -> int:
        """The window the active cost weights hold since (0: the configured ones)."""
        return self._active_since

    @property
    def last(self) -> CalibrationReport | None:
        return self.reports[-1] if self.reports else None

    # ---- measuring (training thread) ------------------------------------------------------------

    def served(self, window: int, slot: int, micro_batch) -> None:
        self._served = (window, slot, micro_batch)

    def _refuse(self, what: str) -> bool:
        self.rejected += 1
        log.warning("reorder calibration: %s; this micro-batch goes unmeasured, training goes on", what)
        return False

    def _features_of_served(self, cost: CostModel):
        """(window, slot, features) of the micro-batch last taken, or a str saying why there are none."""
        if self._served is None:
            return "no micro-batch taken from the buffer yet (time a step after next())"
        window, slot, mb = self._served
        ids = mb.get("input_ids") if isinstance(mb, dict) else None
        if not isinstance(ids, torch.Tensor):
            return f"the micro-batch of window {window}, slot {slot} has no 'input_ids' tensor to count"
        return window, slot, step_features(ids, mb.get("attention_mask"), cost)

    def record_step_ms(self, ms, cost: CostModel) -> bool:
        """Record the step time of the micro-batch last taken; False (and a warning naming the value)
        when the time is not a finite number >= 0 (training goes on, that micro-batch is unmeasured)."""
        if self.mode == "off":
            return False
        try:
            v = float(ms)
        except (TypeError, ValueError):
            v = math.nan
        served = self._served[:2] if self._served is not None else None
        if isinstance(ms, bool) or not math.isfinite(v) or v < 0:
            where = "" if served is None else f" (window {served[0]}, slot {served[1]})"
            return self._refuse(f"record_step_ms(ms={ms!r}) refused{where}: the step time must be a finite "
                                f"number >= 0")
        got = self._features_of_served(cost)
        if isinstance(got, str):
            return self._refuse(f"record_step_ms(ms={ms!r}) refused: {got}")
        window, slot, feats = got
        return self.add_row(window, slot, feats, v)

    def add_row(self, window: int, slot: int, features, ms: float) -> bool:
        """Record one row directly: the FEATURES of what this rank ran in slot `slot` of window `window`
        and its step time (what `record_step_ms` does for the micro-batch last taken)."""
        if self.mode == "off":
            return False
        v = float(ms)
        if not math.isfinite(v) or v < 0:
            return self._refuse(f"add_row(ms={ms!r}) refused (window {window}, slot {slot}): the step time must be a "
                                f"finite number >= 0")
        feats = features if isinstance(features, torch.Tensor) else torch.as_tensor(features, dtype=torch.float64)
        with self._lock:
            self._rows.setdefault(int(window), {})[int(slot)] = (feats, v)
        return True

    @contextlib.contextmanager
    def timed_step(self, cost: CostModel):
        """Time the body (forward + backward of the micro-batch last taken): perf_counter on the CPU,
        CUDA events on a CUDA micro-batch (read back at the fit, no synchronization here)."""
        if self.mode == "off":
            yield
            return
        got = self._features_of_served(cost)
        if isinstance(got, str):
            self._refuse(f"timed_step() has nothing to time: {got}")
            yield
            return
        window, slot, feats = got
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

    def header(self) -> np.ndarray:
        """int64 words every rank of the fit group must agree on: the settings, then the active
        weights' bits and the number of switches."""
        floats = np.array([self.min_r2, self.min_gain, self.drift], dtype=np.float64).view(np.int64)
        settings = [MODES.index(self.mode), self.every, self.window_size, self.lag, self.history, self.frame_rows(),
                    *floats.tolist()]
        bits = (self._active_bits if self._active_bits is not None else np.zeros(len(FEATURES), dtype=np.int64))
        return np.array([*settings, *bits.tolist(), len(self.switches)], dtype=np.int64)

    def frame(self, first: int, stop: int) -> np.ndarray:
        """This rank's fixed-size frame (int64 words: header, then rows as float64 bits)."""
        rows = np.zeros((self.frame_rows(), _ROW), dtype=np.float64)
        with self._lock:
            taken = {w: self._rows.pop(w) for w in list(self._rows) if w < stop}
        i = 0
        for w in range(first, stop):
            for slot, (feats, ms) in sorted(taken.get(w, {}).items()):
                if slot >= self.window_size:
                    continue
                try:
                    if isinstance(ms, tuple):
                        ms[1].synchronize()  # done long ago (lag): no stall in practice
                        ms = float(ms[0].elapsed_time(ms[1]))
                    f = feats.cpu().numpy()
                except Exception as e:  # noqa: BLE001 - this row is lost, not the run (no rank raises alone)
                    log.warning("reorder calibration: the step time of window %d, slot %d could not be read (%s); "
                                "it is left out", w, slot, e)
                    continue
                ok = math.isfinite(ms) and ms >= 0 and np.isfinite(f).all()
                rows[i] = [1.0 if ok else 0.0, w, slot, self.tag, *f.tolist(), ms if ok else 0.0]
                i += 1
        return np.concatenate([self.header(), rows.reshape(-1).view(np.int64)])

    def _gather(self, frame: np.ndarray) -> np.ndarray:
        if self.collectives is None:
            return frame[None]
        return self.collectives.all_gather(torch.from_numpy(frame)).numpy()

    def due(self, window: int) -> tuple[int, int] | None:
        """(first, stop) of the windows the fit before exchange `window` pools, or None: no fit there."""
        stop = window - self.lag + 1  # windows < stop are complete
        if self.mode == "off" or stop < self.every or stop % self.every:
            return None
        return stop - self.every, stop

    def before_window(self, cost: CostModel) -> CostModel | None:
        """Called on every rank of the fit group before each exchange (empty end-of-stream windows
        included, so every rank calls it equally often). Returns the cost model to use from this
        window on when it changes, else None."""
        j = self._calls
        self._calls += 1
        span = self.due(j)
        if span is None:
            return None
        check_headers(self._gather(self.header()))  # fixed size whatever the settings: agree first
        frames = self._gather(self.frame(*span))
        return self.fold(j, span[0], frames, cost)

    def fold(self, window: int, first: int, frames: np.ndarray, cost: CostModel) -> CostModel | None:
        """Decide from every rank's frame [ranks, words] (the all-gather's result); the same on every
        rank. Returns the cost model to use from `window` on when it changes, else None."""
        check_headers(frames[:, :_HEADER])
        body = frames[:, _HEADER:].copy().view(np.float64).reshape(len(frames), -1, _ROW)
        per_rank = (body[:, :, 0] == 1.0).sum(axis=1)
        rows = sort_rows(body.reshape(-1, _ROW)[body.reshape(-1, _ROW)[:, 0] == 1.0])
        return self._decide(window, first, rows, per_rank, cost)

    # ---- the decision (identical on every rank) -------------------------------------------------

    def _decide(self, window: int, first: int, rows: np.ndarray, per_rank: np.ndarray,
                cost: CostModel) -> CostModel | None:
        nfeat = len(FEATURES)
        last = window - self.lag
        carried = self._carry is not None and not (per_rank == 0).any()
        if carried:  # the last fit's too few rows come along
            first, rows = self._carry[0], sort_rows(np.concatenate([self._carry[1], rows]))
        self._carry = None
        span = f"windows {first}..{last}"
        outcome = self._close_outcome(rows)
        silent = [int(i) for i in np.flatnonzero(per_rank == 0)]
        if silent and len(silent) == len(per_rank):
            return self._hold(window, first, rows, cost, outcome, warn=True,
                              reason=f"no step times in {span} from any rank: time each step with buf.timed_step() "
                                     f"or buf.record_step_ms(ms)")
        if silent:
            return self._hold(window, first, rows, cost, outcome, warn=True,
                              reason=f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} of the "
                                     f"fit group sent 0 step times for {span} (every rank must time its steps); "
                                     f"the active weights hold")
        if len(rows) < MIN_ROWS:  # a small fit group: they join the next fit's rows (no rank silent there)
            self._carry = (first, rows)
            return self._hold(window, first, rows, cost, outcome, warn=not carried,  # once per run of them
                              reason=f"rows={len(rows)} for {span}: too few to fit (at least {MIN_ROWS}: "
                                     f"{nfeat} weights, an intercept and one residual); they join the next fit's "
                                     f"rows, the active weights hold")
        feats = rows[:, 4:4 + nfeat]
        drift, dropped = False, False
        seen = None
        if self._ref is not None and (self._pending is not None or len(self._pool) >= 2):
            seen = _rms(rows[:, -1] - self._ref.predict(feats))  # the last fit on new rows (of 2+ blocks)
            expected = max(self._ref.expected_rms, self._tiny(rows))
        own = None
        if self._pending is not None and seen > (1.0 + self.drift) * expected:
            # the new rows' own noise, independent of the last fit's estimate of it
            own = fit_rows(feats, rows[:, -1])
            noise = own.rms * math.sqrt(own.rows / max(own.rows - own.params, 1))
            if not seen > (1.0 + self.drift) * max(noise * math.sqrt(1.0 + self._ref.params / max(self._ref.rows, 1)),
                                                   self._tiny(rows)):
                own = None
        if own is not None:
            # confirmed: a new regime from these rows on, from the suspected ones too where the new rows'
            # fit predicts them better than the last fit does
            old = self._pending[:, 4:4 + nfeat]
            dropped = not (_rms(self._pending[:, -1] - own.predict(old)) * (1.0 + self.drift)
                           < _rms(self._pending[:, -1] - self._ref.predict(old)))
            self._pool = [] if dropped else [self._pending]
            self._pending = None
            self._switch_rows = None
            drift = True
        elif self._pending is None and seen is not None and seen > (1.0 + self.drift) * expected:
            self._pending = rows
            fit = fit_rows(feats, rows[:, -1])
            return self._finish(window, first, rows, fit, None, cost, outcome, pooled=len(rows),
                                s=self._spreads(rows, fit, cost),
                                reason=f"drift suspected: the last fit's RMS residual on {span} is {seen:.4g} ms > "
                                       f"(1 + drift) x the {expected:.4g} ms expected; a re-fit follows if the next "
                                       f"windows confirm it")
        note = ("drift confirmed (pool restarted" + (" without the suspected windows, closer to the last fit"
                                                     if dropped else "") + "); ") if drift else ""
        if not drift and self._pending is not None:
            self._pool.append(self._pending)  # a false alarm: those rows are good
            note = "drift not confirmed (the suspected windows join the pool); "
        self._pending = None
        self._pool = (self._pool + [rows])[-self.history:]
        pool = np.concatenate(self._pool)  # sorted: sorted blocks of growing windows
        fit = fit_rows(pool[:, 4:4 + nfeat], pool[:, -1])
        self._ref = fit
        pred_fit = fit.predict(pool[:, 4:4 + nfeat])
        pred_cur, _ = scaled_prediction(pool, cost)
        s_cur, s_fit, gain = _gain(pool, pred_cur, pred_fit)
        verdict = self._verdict(fit, s_cur, s_fit, gain, len(pool))
        new = None
        if verdict is None and self.mode == "on":
            try:
                new = with_weights(cost, fit.weights)
            except ValueError as e:  # every weight zero: nothing to balance
                verdict = f"fitted weights unusable: {e}"
        if new is None:
            reason = verdict or "shadow: would switch"
            if self.mode == "shadow":
                reason = reason if reason.startswith("shadow") else f"shadow (never switches): {reason}"
            reason = note + reason
            return self._finish(window, first, rows, fit, None, cost, outcome, pooled=len(pool), reason=reason,
                                s=(s_cur, s_fit, gain), drift=drift)
        before = pool[:, 1] >= self._active_since
        if not before.any():
            before[:] = True
        self._open = SwitchOutcome(window=window, rows_before=int(before.sum()),
                                   measured_before=measured_spread(pool[before]),
                                   predicted_before=predicted_spread(pool[before], pred_cur[before]),
                                   predicted_after=predicted_spread(pool[before], pred_fit[before]))
        reason = note + ("re-fitted after drift" if drift else "refined" if self._switch_rows is not None else "switched")
        self._switch_rows = len(pool)
        self._active_since = window
        self._active_fit = fit
        self._active_bits = cost_weights(new).view(np.int64).copy()
        self.switches.append(window)
        return self._finish(window, first, rows, fit, new, cost, outcome, pooled=len(pool), reason=reason,
                            s=(s_cur, s_fit, gain), drift=drift)

    @staticmethod
    def _tiny(rows) -> float:
        """A residual too small to call a drift (a noise-free step time fits to rounding)."""
        return 1e-9 * abs(math.fsum(rows[:, -1].tolist())) / max(len(rows), 1)

    @staticmethod
    def _spreads(rows, fit, cost):
        return _gain(rows, scaled_prediction(rows, cost)[0], fit.predict(rows[:, 4:4 + len(FEATURES)]))

    def _verdict(self, fit: RowFit, s_cur: float, s_fit: float, gain: float, pooled: int) -> str | None:
        """Why the fit does not switch, or None when it passes."""
        values = [*fit.weights.values(), fit.intercept, fit.r2, gain]
        if not all(math.isfinite(v) for v in values):
            return f"the fit is not finite (R^2 {fit.r2}, gain {gain}, weights {fit.weights}); the active weights hold"
        if fit.r2 < self.min_r2:
            return f"R^2 {fit.r2:.3f} < min_r2 {self.min_r2}"
        if gain < self.min_gain:
            return f"predicted gain {gain:.3f} < min_gain {self.min_gain}"
        if s_cur - s_fit < MIN_SPREAD_DROP:
            return (f"predicted spread {s_cur:.4f} -> {s_fit:.4f}: a drop under {MIN_SPREAD_DROP} (both at the noise "
                    f"floor)")
        if self._switch_rows is not None and pooled < 2 * self._switch_rows:
            return (f"active weights (window {self._active_since}) hold: refined only once the pool has twice the "
                    f"{self._switch_rows} rows they were fitted on ({pooled} now)")
        return None

    def _close_outcome(self, rows: np.ndarray) -> SwitchOutcome | None:
        """Complete the last switch's outcome with the rows its weights planned, when these rows have any."""
        if self._open is None:
            return None
        after = rows[rows[:, 1] >= self._open.window]
        if not len(after):
            return None
        done = dataclasses.replace(self._open, rows_after=len(after), measured_after=measured_spread(after),
                                   predicted_after_seen=predicted_spread(
                                       after, self._active_fit.predict(after[:, 4:4 + len(FEATURES)])))
        self._open = None
        self.outcomes.append(done)
        return done

    def _hold(self, window, first, rows, cost, outcome, *, reason, warn=False):
        if warn and self.rank0:
            log.warning("reorder calibration at window %d: %s", window, reason)
        return self._finish(window, first, rows, None, None, cost, outcome, pooled=0, reason=reason)

    def _finish(self, window, first, rows, fit, new, cost, outcome, *, pooled, reason, s=(math.nan,) * 3,
                drift=False):
        nan = math.nan
        active = new or cost
        r = CalibrationReport(window=window, first=first, rows=len(rows),
                              weights={} if fit is None else fit.weights,
                              intercept=nan if fit is None else fit.intercept, r2=nan if fit is None else fit.r2,
                              rms=nan if fit is None else fit.rms, predicted_spread_current=s[0],
                              predicted_spread_fit=s[1], predicted_gain=s[2],
                              measured_spread=measured_spread(rows) if len(rows) else nan, switched=new is not None,
                              reason=reason, active=dict(zip(FEATURES, cost_weights(active).tolist())),
                              pooled=pooled, active_since=self._active_since, drift=drift, outcome=outcome,
                              mode=self.mode)
        self.reports.append(r)
        if self.log_fits and self.rank0:
            log.info("%s", format_report(r) + RECORD + json.dumps(r.record(), sort_keys=True))
        return new


def check_headers(heads: np.ndarray) -> None:
    """Every rank of the fit group sent the same header, else the same ValueError on every rank
    naming the first field that differs and each rank's value."""
    if (heads == heads[0]).all():
        return
    names = [*_SETTINGS, *(f"active weight {f}" for f in FEATURES), "switches"]
    col = int(np.flatnonzero((heads != heads[0]).any(axis=0))[0])
    name = names[col]

    def shown(v):
        if name == "mode":
            return repr(MODES[v]) if 0 <= v < len(MODES) else str(v)
        if name in ("min_r2", "min_gain", "drift") or name.startswith("active weight"):
            return repr(float(np.int64(v).view(np.float64)))
        return str(v)

    values = {}
    for rank, v in enumerate(heads[:, col].tolist()):
        values.setdefault(shown(v), []).append(rank)
    listed = "; ".join(f"{v} on rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}" for v, r in values.items())
    what = ("the active cost weights differ across the fit group (every rank must fit the same rows to the same "
            "bits)" if col >= len(_SETTINGS) else "the calibration settings differ across the fit group")
    raise ValueError(f"reorder calibration: {what}: {name} = {listed}")


def format_report(r: CalibrationReport) -> str:
    """One line for the log: the fit, the predicted and measured spreads and the decision."""
    head = f"reorder calibration ({r.mode}) at window {r.window}, windows {r.first}..: {r.rows} new rows"
    if not r.weights:
        return f"{head}: {r.reason}"
    weights = ", ".join(f"{k} {v:.4g}" for k, v in r.weights.items())
    text = (f"{head}, {r.pooled} fitted: weights {weights} ms, intercept {r.intercept:.4g} ms, R^2 {r.r2:.3f}; "
            f"predicted spread {r.predicted_spread_current:.3f} -> {r.predicted_spread_fit:.3f} (gain "
            f"{r.predicted_gain:.3f}), measured {r.measured_spread:.3f}: {r.reason}")
    if r.outcome is not None:
        o = r.outcome
        text += (f"; switch at window {o.window}: spread before measured {o.measured_before:.3f} (predicted "
                 f"{o.predicted_before:.3f}), after predicted {o.predicted_after:.3f}, measured "
                 f"{o.measured_after:.3f}")
    return text
