"""The calibration fit: deterministic NNLS, known answers, stable row order, refused measurements."""

import math

import numpy as np
import pytest
import torch

from reorder.plan.cost import CostModel
from reorder.runtime.calibration import FEATURES, Calibration, fit_rows, nnls, sort_rows, with_weights


def test_nnls_known_answers_and_non_negative():
    a = np.array([[1.0, 0], [0, 1], [1, 1]])
    np.testing.assert_allclose(nnls(a, np.array([1.0, 2, 3])), [1, 2], atol=1e-12)
    x = nnls(a, np.array([-1.0, 2, 1]))  # unconstrained answer has x0 < 0
    assert (x >= 0).all() and x[0] == 0
    rng = np.random.default_rng(0)
    scipy = pytest.importorskip("scipy.optimize")
    for _ in range(50):
        a, y = rng.normal(size=(12, 4)), rng.normal(size=12)
        x = nnls(a, y)
        assert (x >= 0).all()
        assert np.linalg.norm(a @ x - y) <= np.linalg.norm(a @ scipy.nnls(a, y)[0] - y) + 1e-9


def test_fit_recovers_noise_free_weights_and_is_bitwise_deterministic():
    rng = np.random.default_rng(1)
    x = np.column_stack([rng.integers(0, 2000, 40), rng.integers(0, 10**6, 40), rng.integers(100, 600, 40),
                         rng.integers(10**4, 3 * 10**5, 40), rng.integers(0, 9, 40)]).astype(float)
    true = np.array([0.01, 2e-5, 0.0, 0.0, 0.3])
    fit = fit_rows(x, 0.7 + x @ true)
    np.testing.assert_allclose([fit.weights[f] for f in FEATURES], true, rtol=1e-6, atol=1e-12)
    assert fit.r2 > 0.999999 and abs(fit.intercept - 0.7) < 1e-6
    rows = np.column_stack([np.ones(40), np.arange(40) // 4, np.arange(40) % 4, np.zeros(40), x, 0.7 + x @ true])
    ref = None
    for seed in range(5):  # the order rows arrive in never changes a bit of the result
        shuffled = sort_rows(rows[np.random.default_rng(seed).permutation(40)])
        got = np.array([fit_rows(shuffled[:, 4:9], shuffled[:, -1]).weights[f] for f in FEATURES]).tobytes()
        ref = ref or got
        assert got == ref


def test_with_weights_keeps_token_ids():
    c = with_weights(CostModel(image_token_id=5, vision_start_token_id=6), dict(zip(FEATURES, [1.0, 2, 0, 0, 3])))
    assert (c.encoder_weight, c.encoder_quadratic_weight, c.encoder_image_weight, c.image_token_id) == (1, 2, 3, 5)


def test_bad_times_are_refused_by_value_and_training_goes_on(caplog):
    cal = Calibration(mode="on", window_size=1)
    cal.served(0, 0, {"input_ids": torch.zeros(2, 4, dtype=torch.int64)})
    for bad in (math.nan, math.inf, -1.0, "x"):
        assert not cal.record_step_ms(bad, CostModel())
        assert repr(bad) in caplog.text
    assert cal.rejected == 4 and cal.record_step_ms(1.5, CostModel())


@pytest.mark.parametrize("kw", [dict(mode="auto"), dict(every=0), dict(min_r2=-1), dict(drift=math.nan)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        Calibration(**kw)
