"""`python -m reorder simulate --calibrate LOG`: the calibration of a logged run (rank 0's INFO lines,
whatever the logging format prefixes), fit by fit and switch by switch; a log of two runs; the
errors (no record, a cut line, a record of another version, flags that do not go with it)."""

from __future__ import annotations

import json
import logging

import expecttest
import numpy as np

from calibration_sim import simulate
from reorder.__main__ import main


def _log(path, **kw):
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s [%(name)s] %(levelname)s %(message)s"))
    logger = logging.getLogger("reorder")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        simulate(log=True, **kw)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        handler.close()


class TestCalibrateLog(expecttest.TestCase):
    def setUp(self):
        import tempfile
        from pathlib import Path

        self.dir = tempfile.TemporaryDirectory()
        self.tmp = Path(self.dir.name)

    def tearDown(self):
        self.dir.cleanup()

    def run_cli(self, *args, capsys=None):
        import contextlib
        import io

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["simulate", *map(str, args)])
        return code, out.getvalue(), err.getvalue()

    def test_a_run_with_a_drift(self):
        log = self.tmp / "run.log"
        _log(log, seed=1, windows=33, mode="on", drift_at=18, weights2=np.array([0.02, 2e-5, 0.0, 0.0, 1.5]))
        code, out, err = self.run_cli("--calibrate", log, "--json", self.tmp / "cal.json")
        assert code == 0 and not err
        self.assertExpectedInline(out.replace(str(log), "run.log"), """\
reorder simulate --calibrate run.log: 10 fits

the run: 10 fits (mode on), windows 3..30; switches at windows 3, 21; drift confirmed at 21

window  rows fitted    R^2   patches patches^2    tokens  tokens^2    images intercept spread active -> fit   gain measured  decision
     3    24     24  1.000   0.00968    0.0002         0         0     0.507      1.12      1.128 ->  1.002  0.987    1.378  switched
     6    24     48  1.000   0.00982    0.0002  1.15e-05         0     0.499      1.11      1.001 ->  1.001  0.059    1.285  predicted spread 1.0015 -> 1.0014: a drop under 0.001 (both at the noise floor)
     9    24     72  1.000   0.00976    0.0002  4.77e-05         0     0.497      1.07      1.001 ->  1.001  0.034    1.295  predicted gain 0.034 < min_gain 0.05
    12    24     96  1.000   0.00995    0.0002   9.6e-05         0     0.497     0.926      1.002 ->  1.002  0.068    1.535  predicted spread 1.0018 -> 1.0016: a drop under 0.001 (both at the noise floor)
    15    24    120  1.000   0.00994    0.0002  0.000114         0     0.496     0.922      1.002 ->  1.002  0.081    1.441  predicted spread 1.0018 -> 1.0017: a drop under 0.001 (both at the noise floor)
    18    24     24  1.000    0.0103  0.000199  0.000139         0     0.491     0.836      1.002 ->  1.002 -0.005    1.395  drift suspected: the last fit's RMS residual on windows 15..17 is 0.123 ms > (1 + drift) x the 0.09528 ms expected; a re-fit follows if the next windows confirm it
    21    24     24  1.000    0.0198  2.05e-05         0   3.7e-08      1.48      1.11      1.116 ->  1.003  0.972    1.287  drift confirmed (pool restarted without the suspected windows, closer to the last fit); re-fitted after drift
    24    24     48  1.000    0.0197  2.09e-05  4.03e-05         0      1.49      1.12      1.003 ->  1.003  0.026    1.234  predicted gain 0.026 < min_gain 0.05
    27    24     72  1.000    0.0195  2.12e-05         0   5.1e-09      1.49      1.21      1.004 ->  1.003  0.071    1.268  predicted spread 1.0038 -> 1.0035: a drop under 0.001 (both at the noise floor)
    30    24     96  1.000    0.0197  2.07e-05         0  1.11e-08      1.49      1.17      1.004 ->  1.003  0.039    1.123  predicted gain 0.039 < min_gain 0.05

switch steps before measured predicted old predicted new steps after measured predicted new
     3           24    1.378         1.128         1.002          24    1.285         1.001
    21           24    1.287         1.116         1.003          24    1.234         1.003

last fit (window 30): patches 0.01969, square_patches 2.073e-05, tokens 0, square_tokens 1.107e-08, images 1.489 ms per unit, intercept 1.167 ms, R^2 1.000

rows = new per-rank step times of the fit's windows; fitted = rows of the regime's pool; spread = mean over steps of max/mean per-rank step time: predicted with the active and the fitted weights, measured on the new rows; gain = 1 - (fit - 1) / (active - 1)
switch table: the steps the old weights planned (measured, and predicted by the old and the new weights), then the steps the new weights planned (measured, and what the new weights predicted there)
""")
        data = json.loads((self.tmp / "cal.json").read_text())
        (run,) = data["runs"]
        assert run["summary"]["switches"] == [3, 21] and run["summary"]["drifts"] == [21]
        assert [o["window"] for o in run["summary"]["outcomes"]] == [3, 21] and len(run["fits"]) == 10

    def test_two_runs_in_one_log_and_shadow(self):
        log = self.tmp / "two.log"
        _log(log, seed=2, windows=10, mode="shadow")
        with open(log, "a") as f:
            f.write("an unrelated line | record of something else\n")
        _log(log, seed=3, windows=13, mode="on", silent=(2, 6))
        code, out, err = self.run_cli("--calibrate", log, "--json", "-")
        assert code == 0
        data = json.loads(out)
        first, second = (r["summary"] for r in data["runs"])
        assert (first["mode"], first["switches"], first["fits"]) == ("shadow", [], 3)
        assert (second["mode"], second["switches"], second["held"]) == ("on", [3], 2)
        assert "run 2 of 2: 4 fits (mode on), windows 3..12; switches at windows 3" in err
        assert "rank 2 of the fit group sent 0 step times for windows 6..8" in err

    def test_errors(self):
        empty = self.tmp / "empty.log"
        empty.write_text("INFO reorder dp rank 0 of 4, window 1: spread 1.2 -> 1.0\n")
        cut = self.tmp / "cut.log"
        cut.write_text('x\nINFO reorder calibration (on) at window 3: switched | record {"window": 3, "rows"\n')
        old = self.tmp / "old.log"
        old.write_text('reorder calibration | record {"window": 3}\n')
        msgs = []
        for args in (["--calibrate", empty], ["--calibrate", cut], ["--calibrate", old],
                     ["--calibrate", self.tmp / "missing.log"], ["--calibrate", empty, "--mix", "small"]):
            code, out, err = self.run_cli(*args)
            assert code == 2 and not out and "Traceback" not in err
            prog = err.index("simulate: error: ")  # the program's name follows how it was run
            msgs.append(err[prog:].replace(str(self.tmp) + "/", ""))
        self.assertExpectedInline("".join(msgs), """\
simulate: error: empty.log: no calibration records (lines with '| record {...}'); log the run at INFO on rank 0 with megatron_mimo_reorder_calibrate shadow or on
simulate: error: cut.log:2: the calibration record is not valid JSON (Expecting ':' delimiter at column 82): is the line cut?
simulate: error: old.log:1: the calibration record has no rows, pooled, weights, intercept, r2, predicted_spread_current, predicted_spread_fit, predicted_gain, measured_spread, switched, reason, active, outcome, drift, mode: written by another version of reorder?
simulate: error: cannot read --calibrate missing.log: No such file or directory
simulate: error: --calibrate LOG reports a logged run's calibration: give no input FILE or --mix with it
""")
