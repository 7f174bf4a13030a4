"""Calibrate the cost model from measured per-rank step times (least squares, non-negative).

Log, for each rank and step, the features of the micro-batch that rank ran (`micro_batch_features`)
and its measured compute time; `fit_cost_weights` fits time ~ intercept + sum_k w_k * feature_k
with w_k >= 0 and reports the fit quality (R^2, RMS residual). `Fit.cost_model()` turns the weights
into a CostModel (the intercept is a per-step constant: it cannot be balanced away and is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from reorder.plan.cost import CostModel
from reorder.batch.counting import square_patches, token_counts

FEATURES = ("patches", "square_patches", "tokens", "square_tokens", "images")


def micro_batch_features(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                         cost: CostModel | None = None) -> np.ndarray:
    """float64 [5]: summed patches, per-image patches^2, real tokens, tokens^2 and images
    (vision-start tokens) of one micro-batch."""
    cost = cost or CostModel()
    p, r, images = token_counts(CostModel(encoder_weight=1.0, image_token_id=cost.image_token_id,
                                          vision_start_token_id=cost.vision_start_token_id,
                                          spatial_merge_size=cost.spatial_merge_size), input_ids, attention_mask)
    sq = square_patches(cost, input_ids)
    merge2 = cost.spatial_merge_size ** 2
    r = r.to(torch.float64)
    return np.array([float(p.sum()) * merge2, float(sq.sum()), float(r.sum()), float((r * r).sum()),
                     float(images.sum())])


@dataclass(frozen=True, slots=True, kw_only=True)
class Fit:
    """Fitted non-negative weights (time units per feature unit), intercept, and fit quality."""

    weights: dict
    intercept: float
    r2: float
    rms_residual: float
    samples: int

    def cost_model(self, **kwargs) -> CostModel:
        w = self.weights
        return CostModel(encoder_weight=w.get("patches", 0.0), encoder_quadratic_weight=w.get("square_patches", 0.0),
                         language_weight=w.get("tokens", 0.0), language_quadratic_weight=w.get("square_tokens", 0.0),
                         encoder_image_weight=w.get("images", 0.0),
                         **kwargs)


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    try:
        from scipy.optimize import nnls
    except ImportError:  # active set by refitting without the columns that went negative
        keep = np.ones(a.shape[1], dtype=bool)
        while True:
            x = np.zeros(a.shape[1])
            x[keep] = np.linalg.lstsq(a[:, keep], y, rcond=None)[0]
            neg = keep & (x < 0)
            if not neg.any():
                return x
            keep &= ~neg
    return nnls(a, y)[0]


def fit_cost_weights(features, times, *, names=FEATURES, intercept: bool = True) -> Fit:
    """Fit times[i] ~ c + features[i] @ w with w >= 0 (and c >= 0). features: [n, k]; times: [n]."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(times, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[1] != len(names):
        raise ValueError(f"features has shape {x.shape} and times {y.shape}: expected [n, {len(names)}] and [n]")
    if x.shape[0] < x.shape[1] + int(intercept):
        raise ValueError(f"{x.shape[0]} measurements cannot determine {x.shape[1] + int(intercept)} parameters")
    scale = np.where(x.max(axis=0) > 0, x.max(axis=0), 1.0)  # conditioning: patches^2 is ~1e8
    a = x / scale
    if intercept:
        a = np.hstack([a, np.ones((len(y), 1))])
    sol = _nnls(a, y)
    pred = a @ sol
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    w = sol[:x.shape[1]] / scale
    return Fit(weights=dict(zip(names, w.tolist())), intercept=float(sol[-1]) if intercept else 0.0,
               r2=1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0, rms_residual=float(np.sqrt(ss_res / len(y))),
               samples=len(y))


def enable_calibration(buffer, config, *, group=None, collectives=None, tag: int = 0, **settings):
    """Attach online calibration (`reorder.runtime.calibration`) to a buffer `wrap` returned, or to the
    Megatron-Bridge drop-in (`reorder.integrations.bridge.ReorderingBuffer`), from a `ReorderConfig`
    (its `megatron_mimo_reorder_calibrate*` fields) or a mode string; call it on every rank before the
    first next(). Returns the `Calibration` (also `buffer.calibration`), or None with calibration off
    or reordering off (a PassThroughBuffer).

    `settings` override the config's (`every=`, `min_r2=`, `min_gain=`, `drift=`, `history=`); the
    window size is always the buffer's.

    `wrap` already attaches the config's calibration (on a group spanning every module): then, given
    neither `group` nor `collectives`, this returns that one.

    The fit group: `collectives` (a `reorder.exchange.collectives.Collectives`), or `group` (a
    torch.distributed group, wrapped with a Gloo metadata group over its ranks: create it on every
    rank), else the module's DP group (enough when one module plans). With several modules, give a
    group spanning every rank of every module (e.g. `torch.distributed.group.WORLD`) so that every
    module fits the same rows and switches at the same window; `tag` is then this rank's module index.
    With overlap the group is used on the overlap thread: give one no other thread uses."""
    from reorder.integrations.bridge import ReorderingBuffer as BridgeBuffer
    from reorder.runtime.buffer import ReorderingBuffer
    from reorder.runtime.calibration import Calibration

    bridge = isinstance(buffer, BridgeBuffer)
    if not isinstance(buffer, ReorderingBuffer) and not bridge:
        return None
    window = buffer._window_size if bridge else buffer._ex.window_size
    settings = {**(dict(mode=config) if isinstance(config, str) else config.calibration_settings()), **settings,
                "window_size": window}
    if settings["mode"] == "off":
        return None
    if buffer.calibration is not None and group is None and collectives is None:
        return buffer.calibration
    if collectives is None and group is not None:
        import torch.distributed as dist

        from reorder.exchange.dist import TorchCollectives

        ranks = dist.get_process_group_ranks(group)
        meta = group if dist.get_backend(group) == "gloo" else dist.new_group(ranks, backend="gloo")
        collectives = TorchCollectives(meta, group)
    if collectives is None and not bridge:
        collectives = buffer._ex.collectives
    cal = Calibration(collectives=collectives, tag=tag, **settings)  # the drop-in fills in its DP group
    buffer.calibrate(cal)
    return cal
