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


# ---- the online calibration's config fields and flags ------------------------------------------------

class TestCalibrationConfig:
    def test_fields_flags_and_settings(self):
        import argparse

        from reorder.integrations.config import ReorderConfig, add_reorder_args

        d = ReorderConfig()
        assert d.calibration_settings() == dict(mode="off", window_size=1, every=4, min_r2=0.8, min_gain=0.05,
                                                drift=0.25, history=8)
        args = add_reorder_args(argparse.ArgumentParser()).parse_args(
            ["--reorder-calibrate", "on", "--reorder-calibrate-every", "3", "--reorder-calibrate-min-r2", "0.9",
             "--reorder-calibrate-min-gain", "0.1", "--reorder-calibrate-drift", "0.5",
             "--reorder-calibrate-history", "16", "--reorder-window-size", "2"])
        cfg = ReorderConfig.from_args(args)
        assert cfg.calibration_settings() == dict(mode="on", window_size=2, every=3, min_r2=0.9, min_gain=0.1,
                                                  drift=0.5, history=16)
        from reorder.runtime.calibration import Calibration

        cal = Calibration(**cfg.calibration_settings())  # every setting is one Calibration takes
        assert (cal.mode, cal.every, cal.history, cal.window_size) == ("on", 3, 16, 2)

    def test_bad_values_name_the_field(self):
        from reorder.integrations.config import ReorderConfig

        msgs = []
        for field, value in (("megatron_mimo_reorder_calibrate", "auto"), ("megatron_mimo_reorder_calibrate_every", 0),
                             ("megatron_mimo_reorder_calibrate_history", 0),
                             ("megatron_mimo_reorder_calibrate_min_r2", 1.5),
                             ("megatron_mimo_reorder_calibrate_min_gain", 1.0),
                             ("megatron_mimo_reorder_calibrate_drift", float("nan"))):
            with pytest.raises(ValueError) as e:
                ReorderConfig(**{field: value})
            msgs.append(str(e.value))
        assert msgs == [
            "megatron_mimo_reorder_calibrate='auto': must be one of off, shadow, on",
            "megatron_mimo_reorder_calibrate_every=0: must be an integer >= 1",
            "megatron_mimo_reorder_calibrate_history=0: must be an integer >= 1",
            "megatron_mimo_reorder_calibrate_min_r2=1.5: must be a finite number >= 0 and <= 1",
            "megatron_mimo_reorder_calibrate_min_gain=1.0: must be a finite number >= 0 and < 1",
            "megatron_mimo_reorder_calibrate_drift=nan: must be a finite number >= 0"]

    def test_off_and_reordering_off_attach_nothing(self):
        from reorder.integrations.calibrate import enable_calibration
        from reorder.integrations.config import ReorderConfig
        from reorder.runtime.buffer import PassThroughBuffer

        buf = PassThroughBuffer(iter([]), micro_batch_size=4)
        assert enable_calibration(buf, ReorderConfig(megatron_mimo_reorder_calibrate="on")) is None
        assert enable_calibration(buf, "on") is None and buf.calibration is None
        assert not buf.record_step_ms(1.0)
        with buf.timed_step():
            pass

    def test_the_drop_in_refuses_calibration_with_a_custom_cost(self):
        from reorder.integrations import bridge as br
        from reorder.integrations.calibrate import enable_calibration

        buf = br.ReorderingBuffer(iter([]), dp_rank=0, dp_size=1, n_groups=1, cost_of=lambda flat: 1.0,
                                  dp_group_gloo=None, dp_group_nccl=None, overlap=False)
        with pytest.raises(ValueError, match="give cost_of as a functools.partial of sample_cost"):
            enable_calibration(buf, "on")
        assert not buf.record_step_ms(1.0) and buf.calibration is None
