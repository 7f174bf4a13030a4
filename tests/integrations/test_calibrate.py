"""Cost-model calibration: recovers known weights, reports fit quality, validates input."""

import numpy as np
import pytest
import torch

from reorder.cli import synthetic as syn
from reorder.integrations.calibrate import FEATURES, fit_cost_weights, micro_batch_features
from reorder.plan.cost import CostModel


def _features(n, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        g = syn.make_global_batch(rng, 4, 512, features=2, mix="realistic")
        rows.append(micro_batch_features(g["input_ids"], g["attention_mask"]))
    return np.array(rows)


def test_recovers_known_weights_exactly_without_noise():
    x = _features(30)
    true = np.array([2e-3, 1e-7, 5e-4, 0.0, 0.3])
    fit = fit_cost_weights(x, 3.0 + x @ true)
    assert fit.r2 > 0.999999 and fit.samples == 30
    assert np.allclose([fit.weights[k] for k in FEATURES], true, rtol=1e-4, atol=1e-10)
    assert abs(fit.intercept - 3.0) < 1e-6
    model = fit.cost_model()
    assert model.encoder_quadratic_weight == pytest.approx(1e-7, rel=1e-4)
    assert model.encoder_image_weight == pytest.approx(0.3, rel=1e-4)


def test_noise_lowers_r2_and_weights_stay_non_negative():
    x = _features(40, seed=1)
    rng = np.random.default_rng(2)
    y = 1.0 + x @ np.array([1e-3, 0, 0, 0, 0]) + rng.normal(0, 2.0, len(x))
    fit = fit_cost_weights(x, y)
    assert 0 < fit.r2 < 0.999 and fit.rms_residual > 0.5
    assert all(v >= 0 for v in fit.weights.values())


def test_features_count_images_by_placeholder_runs():
    ids = torch.tensor([[9, 7, 7, 5, 9, 7, 7, 7]])  # two images (vision-start 9) of 2 and 3 placeholders
    f = micro_batch_features(ids, torch.ones_like(ids), cost=CostModel(image_token_id=7, vision_start_token_id=9))
    assert f.tolist() == [20.0, 208.0, 8.0, 64.0, 2.0]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"features has shape \(3, 2\) and times \(3,\): expected \[n, 5\]"):
        fit_cost_weights(np.zeros((3, 2)), np.zeros(3))
    with pytest.raises(ValueError, match="3 measurements cannot determine 6 parameters"):
        fit_cost_weights(np.zeros((3, 5)), np.zeros(3))
