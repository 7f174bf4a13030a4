"""The calibration fit and decision, in one process: deterministic NNLS (the same bits whatever the
order of the rows), known answers, the decision of every rank from the same frames, the bounds that
keep weights from flapping, drift, and the messages of refused times and settings."""

import math
import threading
from pathlib import Path

import expecttest
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import faults
from calibration_sim import TRUE, simulate
from reorder.plan.cost import CostModel
from reorder.runtime.calibration import (FEATURES, MIN_ROWS, Calibration, CalibrationReport, RowFit,
                                         check_headers, fit_rows, format_report, nnls, sort_rows, with_weights)


def _kkt(a, y, x, slack=1e-7):
    """x >= 0 and the optimality conditions of min ||a x - y||, x >= 0: the gradient a^T (y - a x)
    vanishes where x > 0 and is <= 0 where x = 0 (up to `slack` of its scale)."""
    g = a.T @ (y - a @ x)
    scale = slack * (np.abs(a).sum() * (np.abs(y).max() + 1) + 1)
    assert (x >= 0).all()
    assert (np.abs(g[x > 0]) <= scale).all(), (g, x)
    assert (g[x == 0] <= scale).all(), (g, x)


@given(st.integers(0, 2**32 - 1), st.integers(1, 6), st.integers(0, 30))
def test_nnls_meets_the_optimality_conditions_and_ignores_row_order(seed, n, extra):
    rng = np.random.default_rng(seed)
    m = n + extra
    a = rng.normal(size=(m, n)) * rng.choice([1e-3, 1.0, 1e3], size=n)
    y = rng.normal(size=m) * 10
    x = nnls(a, y)
    _kkt(a, y, x)
    perm = rng.permutation(m)
    assert nnls(a[perm], y[perm]).tobytes() == x.tobytes()  # exactly rounded sums: no order effect


def test_nnls_known_answers_and_scipy():
    a = np.array([[1.0, 0], [0, 1], [1, 1]])
    np.testing.assert_allclose(nnls(a, np.array([1.0, 2, 3])), [1, 2], atol=1e-12)
    x = nnls(a, np.array([-1.0, 2, 1]))  # unconstrained answer has x0 < 0
    assert (x >= 0).all() and x[0] == 0
    assert nnls(np.zeros((4, 2)), np.ones(4)).tolist() == [0.0, 0.0]
    dependent = np.array([[1.0, 2.0], [2.0, 4.0], [3.0, 6.0]])  # column 2 = 2 x column 1
    x = nnls(dependent, np.array([1.0, 2.0, 3.0]))
    np.testing.assert_allclose(dependent @ x, [1, 2, 3], atol=1e-9)
    scipy = pytest.importorskip("scipy.optimize")
    rng = np.random.default_rng(0)
    for _ in range(50):
        a, y = rng.normal(size=(12, 4)), rng.normal(size=12)
        x = nnls(a, y)
        assert np.linalg.norm(a @ x - y) <= np.linalg.norm(a @ scipy.nnls(a, y)[0] - y) + 1e-9


def test_nnls_ends_when_a_step_to_the_boundary_underflows():
    """A fit the calibration simulation made (24 rows, `simulate(seed=928337, noise=2.0, history=1,
    mode="shadow", windows=48)`): a coordinate leaving the passive set shrank toward 0 step by step
    until its step length underflowed to 0 while it stayed a positive denormal, and the solve looped
    for ever. It must end, at the optimum."""
    d = np.load(Path(__file__).with_name("nnls_underflow.npz"))
    a, y, done = d["a"], d["y"], []
    worker = threading.Thread(target=lambda: done.append(nnls(a, y)), daemon=True)
    worker.start()
    worker.join(60)
    assert done, "nnls did not return within 60 s"
    _kkt(a, y, done[0])
    scipy = pytest.importorskip("scipy.optimize")
    assert np.linalg.norm(a @ done[0] - y) <= np.linalg.norm(a @ scipy.nnls(a, y)[0] - y) * (1 + 1e-9)


def _features(n, seed):
    rng = np.random.default_rng(seed)
    return np.column_stack([rng.integers(0, 2000, n), rng.integers(0, 10**6, n), rng.integers(100, 600, n),
                            rng.integers(10**4, 3 * 10**5, n), rng.integers(0, 9, n)]).astype(float)


@given(st.lists(st.sampled_from([0.0, 1e-6, 1e-4, 0.01, 0.3, 2.0]), min_size=5, max_size=5),
       st.floats(0.0, 5.0), st.integers(0, 100))
def test_fit_recovers_noise_free_weights(weights, intercept, seed):
    x = _features(40, seed)
    true = np.array(weights)
    y = intercept + x @ true
    if not np.ptp(y) > 0:  # a constant time (every weight zero) leaves R^2 undefined; its std is not always 0
        return
    fit = fit_rows(x, y)
    got = np.array([fit.weights[f] for f in FEATURES])
    assert (got >= 0).all() and fit.intercept >= 0
    np.testing.assert_allclose(x @ got + fit.intercept, y, rtol=1e-7, atol=1e-7 * y.max())
    top = x.max(axis=0)  # each weight as the largest time its feature carries: what can be identified
    np.testing.assert_allclose(got * top, true * top, rtol=1e-6, atol=1e-7 * y.max())
    assert fit.r2 > 0.999999


def test_fit_is_bitwise_deterministic_whatever_the_row_order():
    x = _features(40, 1)
    y = 0.7 + x @ np.array([0.01, 2e-5, 0.0, 0.0, 0.3]) + np.random.default_rng(2).normal(0, 0.5, 40)
    rows = np.column_stack([np.ones(40), np.arange(40) // 4, np.arange(40) % 4, np.zeros(40), x, y])
    ref = None
    for seed in range(5):
        shuffled = rows[np.random.default_rng(seed).permutation(40)]
        for r in (shuffled, sort_rows(shuffled)):
            fit = fit_rows(r[:, 4:9], r[:, -1])
            got = np.array([*(fit.weights[f] for f in FEATURES), fit.intercept, fit.r2, fit.rms]).tobytes()
            ref = ref or got
            assert got == ref


def test_with_weights_keeps_token_ids():
    c = with_weights(CostModel(image_token_id=5, vision_start_token_id=6), dict(zip(FEATURES, [1.0, 2, 0, 0, 3])))
    assert (c.encoder_weight, c.encoder_quadratic_weight, c.encoder_image_weight, c.image_token_id) == (1, 2, 3, 5)


# ---- the loop in one process: every rank's Calibration, frames stacked by hand ----------------------

def _bits(cal):
    return [(r.record(), np.array([r.weights.get(f, np.nan) for f in FEATURES]).tobytes()) for r in cal.reports]


@settings(max_examples=15)
@given(st.integers(0, 10**6), st.booleans())
def test_every_rank_decides_the_same_whatever_the_gather_order(seed, drift):
    kw = dict(seed=seed, mode="on", drift_at=18 if drift else None, weights2=TRUE[::-1] * [1, 1e-4, 1, 1, 1e-4])
    cals, _ = simulate(**kw)
    shuffled, _ = simulate(permute=True, **kw)
    assert all(_bits(c) == _bits(cals[0]) for c in cals + shuffled)
    assert all(c.switches == cals[0].switches for c in cals + shuffled)


@settings(max_examples=20)
@given(st.integers(0, 10**6), st.sampled_from([0.01, 0.1, 0.5, 2.0]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from([None, 12, 24]), st.sampled_from(["on", "shadow"]))
def test_switches_pass_both_thresholds_and_settle_within_a_regime(seed, noise, history, drift_at, mode):
    """No flapping: within a regime (between confirmed drifts) the weights switch at most
    1 + log2(history) times (refinement waits for the pool to double); each switch passed R^2 and
    gain; shadow never switches; the cost of a window changes only at a fit that switched."""
    cals, planned = simulate(seed=seed, noise=noise, history=history, drift_at=drift_at, mode=mode, windows=48,
                             weights2=np.array([0.02, 2e-5, 0.0, 0.0, 1.5]))
    cal = cals[0]
    regimes = [[]]
    for r in cal.reports:
        if r.drift:
            regimes.append([])
        regimes[-1].append(r)
        if r.switched:
            assert r.r2 >= cal.min_r2 and r.predicted_gain >= cal.min_gain and mode == "on"
    for reports in regimes:
        assert sum(r.switched for r in reports) <= 1 + int(math.log2(history))
    switched_at = {r.window for r in cal.reports if r.switched}
    assert [j for j in range(1, len(planned)) if planned[j] != planned[j - 1]] == sorted(switched_at)
    assert cal.switches == sorted(switched_at)


def test_stationary_noise_never_confirms_a_drift():
    for seed in range(12):
        cal = simulate(seed=seed, windows=60, mode="on")[0][0]
        assert not any(r.drift for r in cal.reports), [r.reason for r in cal.reports]


def test_drift_is_suspected_then_confirmed_and_the_refit_switches():
    cal = simulate(seed=1, windows=60, mode="on", drift_at=30, weights2=np.array([0.02, 2e-5, 0.0, 0.0, 1.5]))[0][0]
    by_window = {r.window: r for r in cal.reports}
    assert by_window[33].reason.startswith("drift suspected") and not by_window[33].switched
    assert by_window[36].drift and by_window[36].switched and by_window[36].pooled == 48
    assert by_window[36].reason == "drift confirmed (pool restarted); re-fitted after drift"
    assert cal.active_since >= 36 and all(w < 30 or w >= 36 for w in cal.switches)
    got = by_window[max(by_window)].weights
    assert abs(got["images"] / 1.5 - 1) < 0.05 and abs(got["patches"] / 0.02 - 1) < 0.1


def test_a_scale_only_drift_restarts_the_pool_without_a_switch():
    """All weights doubled: the balance the active weights give is unchanged, so the re-fit predicts
    no gain and does not switch."""
    cal = simulate(seed=2, windows=60, mode="on", noise=0.05, drift_at=30, weights2=TRUE * 2)[0][0]
    assert any(r.drift for r in cal.reports)
    assert all(w < 30 for w in cal.switches)


def test_the_outcome_pairs_each_switch_with_what_followed():
    cal = simulate(seed=0, windows=24, mode="on")[0][0]
    first = cal.outcomes[0]
    assert first.window == cal.switches[0] == 3 and first.rows_before == 24 and first.rows_after == 24
    assert first.predicted_after < first.predicted_before
    assert all(math.isfinite(v) for v in (first.measured_before, first.measured_after, first.predicted_after_seen))
    report = next(r for r in cal.reports if r.outcome is not None)
    assert report.window == 6 and report.record()["outcome"]["window"] == 3


def test_held_fits_lose_nothing_and_keep_the_active_weights():
    cals, planned = simulate(seed=0, windows=30, mode="on", silent=(1, 9))
    cal = cals[0]
    held = [r for r in cal.reports if r.window >= 12]
    assert held and all(r.reason.startswith("rank 1 of the fit group sent 0 step times") for r in held)
    assert all(p == planned[9] for p in planned[9:])
    assert cal.last.active == cal.reports[1].active


# ---- refused times and settings: the messages -------------------------------------------------------

class TestMessages(expecttest.TestCase):
    def test_refused_times_name_the_value_and_the_micro_batch(self):
        cal = Calibration(mode="on", window_size=2)
        with self.assertLogs("reorder", "WARNING") as logs:
            assert not cal.record_step_ms(1.0, CostModel())
            cal.served(0, 1, {"input_ids": torch.zeros(2, 4, dtype=torch.int64)})
            for bad in (math.nan, math.inf, -1.0, "x", True):
                assert not cal.record_step_ms(bad, CostModel())
            cal.served(0, 1, {"pixels": torch.zeros(1)})
            assert not cal.record_step_ms(2.0, CostModel())
            with cal.timed_step(CostModel()):
                pass
        self.assertExpectedInline("\n".join(logs.output), """\
WARNING:reorder:reorder calibration: record_step_ms(ms=1.0) refused: no micro-batch taken from the buffer yet (time a step after next()); this micro-batch goes unmeasured, training goes on
WARNING:reorder:reorder calibration: record_step_ms(ms=nan) refused (window 0, slot 1): the step time must be a finite number >= 0; this micro-batch goes unmeasured, training goes on
WARNING:reorder:reorder calibration: record_step_ms(ms=inf) refused (window 0, slot 1): the step time must be a finite number >= 0; this micro-batch goes unmeasured, training goes on
WARNING:reorder:reorder calibration: record_step_ms(ms=-1.0) refused (window 0, slot 1): the step time must be a finite number >= 0; this micro-batch goes unmeasured, training goes on
WARNING:reorder:reorder calibration: record_step_ms(ms='x') refused (window 0, slot 1): the step time must be a finite number >= 0; this micro-batch goes unmeasured, training goes on
WARNING:reorder:reorder calibration: record_step_ms(ms=True) refused (window 0, slot 1): the step time must be a finite number >= 0; this micro-batch goes unmeasured, training goes on
WARNING:reorder:reorder calibration: record_step_ms(ms=2.0) refused: the micro-batch of window 0, slot 1 has no 'input_ids' tensor to count; this micro-batch goes unmeasured, training goes on
WARNING:reorder:reorder calibration: timed_step() has nothing to time: the micro-batch of window 0, slot 1 has no 'input_ids' tensor to count; this micro-batch goes unmeasured, training goes on""")
        assert cal.rejected == 8
        cal.served(0, 0, {"input_ids": torch.zeros(2, 4, dtype=torch.int64)})
        assert cal.record_step_ms(1.5, CostModel())

    def _frames(self, **per_rank):
        return np.stack([Calibration(mode="on", **kw).header() for kw in per_rank.values()])

    def err(self, heads):
        with pytest.raises(ValueError) as e:
            check_headers(heads)
        return str(e.value)

    def test_settings_and_weights_that_differ_across_the_fit_group(self):
        self.assertExpectedInline(self.err(self._frames(a=dict(every=4), b=dict(every=4), c=dict(every=3))), """reorder calibration: the calibration settings differ across the fit group: every = 4 on ranks 0, 1; 3 on rank 2""")
        self.assertExpectedInline(self.err(self._frames(a=dict(min_r2=0.8), b=dict(min_r2=0.9))), """reorder calibration: the calibration settings differ across the fit group: min_r2 = 0.8 on rank 0; 0.9 on rank 1""")
        a, b = Calibration(mode="on"), Calibration(mode="shadow")
        self.assertExpectedInline(self.err(np.stack([a.header(), b.header()])), """reorder calibration: the calibration settings differ across the fit group: mode = 'on' on rank 0; 'shadow' on rank 1""")
        b = Calibration(mode="on")
        b._active_bits = np.array([0.5, 0, 0, 0, 0.25]).view(np.int64)
        self.assertExpectedInline(self.err(np.stack([a.header(), b.header()])), """reorder calibration: the active cost weights differ across the fit group (every rank must fit the same rows to the same bits): active weight patches = 0.0 on rank 0; 0.5 on rank 1""")

    def test_held_fits_say_why(self):
        cal = Calibration(mode="on", window_size=1, every=2, log_fits=False)
        frames = np.stack([cal.frame(0, 2), cal.frame(0, 2)])
        cal.fold(2, 0, frames, CostModel())
        self.assertExpectedInline(cal.last.reason, """no step times in windows 0..1 from any rank: time each step with buf.timed_step() or buf.record_step_ms(ms)""")
        for w in range(2, 4):
            cal.add_row(w, 0, [1.0, 1, 1, 1, 1], 1.0)
        cal.fold(4, 2, np.stack([cal.frame(2, 4)] * 3), CostModel())
        self.assertExpectedInline(cal.last.reason, """rows=6 for windows 2..3: too few to fit (at least 7: 5 weights, an intercept and one residual); they join the next fit's rows, the active weights hold""")
        assert MIN_ROWS == 7 and cal.last.rows == 6 and not cal.last.weights

    def test_a_report_line_and_its_record(self):
        r = CalibrationReport(window=6, first=3, rows=24, weights=dict(zip(FEATURES, [0.01, 2e-4, 0.0, 0.0, 0.5])),
                              intercept=1.0, r2=0.99, rms=0.1, predicted_spread_current=1.08,
                              predicted_spread_fit=1.01, predicted_gain=0.875, measured_spread=1.09, switched=True,
                              reason="switched", active={}, pooled=48)
        self.assertExpectedInline(format_report(r), """reorder calibration (on) at window 6, windows 3..: 24 new rows, 48 fitted: weights patches 0.01, square_patches 0.0002, tokens 0, square_tokens 0, images 0.5 ms, intercept 1 ms, R^2 0.990; predicted spread 1.080 -> 1.010 (gain 0.875), measured 1.090: switched""")
        assert r.record()["outcome"] is None and r.record()["pooled"] == 48


@pytest.mark.parametrize("kw", [dict(mode="auto"), dict(every=0), dict(min_r2=-1), dict(drift=math.nan),
                                dict(history=0)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        Calibration(**kw)


def test_expected_rms_inflates_the_noise_estimate():
    fit = RowFit(weights=dict.fromkeys(FEATURES, 0.0), intercept=0.0, r2=1.0, rms=1.0, rows=24, params=6)
    assert fit.expected_rms == pytest.approx(math.sqrt(24 / 18) * math.sqrt(1 + 6 / 24))


# ---- attached to a buffer ------------------------------------------------------------------------------

def _buffer(overlap, n=12, **kw):
    from reorder import Grid, WindowExchanger
    from reorder.cli import synthetic as syn
    from reorder.runtime.buffer import ReorderingBuffer

    rng = np.random.default_rng(0)
    source = [syn.make_global_batch(rng, 4, 64, features=2, mix="small", first_id=4 * k) for k in range(n)]
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, cost=cost, window_size=2)
    return ReorderingBuffer(iter(source), ex, overlap=overlap, **kw)


def test_overlap_takes_the_calibration_before_its_worker_starts():
    """With overlap over an iterator the worker exchanges from the constructor on: a calibration
    attached later could miss windows on some ranks (their fits would gather at different windows and
    hang), so `calibrate` refuses and the constructor takes it."""
    from reorder.runtime.buffer import CalibratedWindowReport

    buf = _buffer(True)
    with pytest.raises(RuntimeError, match="pass ReorderingBuffer"):
        buf.calibrate(Calibration(mode="on", window_size=2, every=2))
    buf.close()
    cal = Calibration(mode="shadow", window_size=2, every=2, log_fits=False)
    buf = _buffer(True, calibration=cal)
    assert cal.lag == 2 and buf.calibration is cal
    for mb in buf:
        buf.record_step_ms(1.0 + float((mb["input_ids"] >= 0).sum()) * 1e-3)
    assert all(isinstance(r, CalibratedWindowReport) for r in buf.reports)
    fits = [r.calibration.window for r in buf.reports if r.calibration is not None]
    assert fits == [r.window for r in cal.reports if r.window < 6] == [3, 5]  # stop = window - lag + 1 = 2, 4
    sync = Calibration(mode="shadow", window_size=2, every=2, log_fits=False)
    buf = _buffer(False)
    buf.calibrate(sync)
    list(buf)
    assert sync.lag == 1 and [r.window for r in sync.reports] == [2, 4, 6]


# ---- the fault records (tests/faults.py, docs/faults.md) ---------------------------------------------

@pytest.mark.parametrize("case", faults.cases("calibration"), ids=faults.name)
def test_calibration_fault_case(case, caplog):
    """Every rank sees what the record says; planning goes on every window and every rank keeps the
    same active weights, bit for bit."""
    if "per_rank" in case.params:  # the header all-gather: every rank checks the same gathered headers
        heads = np.stack([Calibration(mode="on", **kw).header() for kw in case.params["per_rank"]])
        (seen,) = case.sees
        with pytest.raises(ValueError) as e:  # every rank runs this same check on the same headers
            check_headers(heads)
        seen.check(e.value)
        return
    sim = dict(seed=0, windows=30, mode="on", **case.params["sim"])
    with caplog.at_level("WARNING", logger="reorder"):
        cals, planned = simulate(**sim)
    assert len(planned) == sim["windows"]
    active = {tuple(np.array([r.active[f] for f in FEATURES]).tobytes() for r in c.reports) for c in cals}
    assert len(active) == 1
    for seen in case.sees:
        if seen.who == "every rank":
            for c in cals:
                seen.check(None, " | ".join(r.reason for r in c.reports))
        else:
            rank = int(seen.who.split()[1])
            seen.check(None, "\n".join(caplog.messages))
            assert [c.rejected for c in cals] == [int(i == rank) for i in range(len(cals))]
