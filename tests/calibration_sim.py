"""The calibration loop in one process (tests/runtime/test_calibration.py, tests/cli/test_calibrate_log.py):
every rank's Calibration over synthetic rows, the frames stacked by hand as an all-gather returns them."""

import numpy as np

from reorder.plan.cost import CostModel
from reorder.runtime.calibration import _HEADER, _ROW, Calibration

TRUE = np.array([0.01, 2e-4, 0.0, 0.0, 0.5])


def _row(rng, weights, noise):
    p = rng.integers(20, 400, 4)
    images = rng.integers(0, 4, 4)
    tokens = rng.integers(100, 500, 4)
    x = np.array([p.sum(), (p ** 2).sum(), tokens.sum(), (tokens ** 2).sum(), images.sum()], dtype=float)
    return x, 1.0 + x @ weights + rng.normal(0, noise)


def simulate(*, ranks=4, windows=40, window_size=2, every=3, noise=0.1, seed=0, weights=TRUE, drift_at=None,
             weights2=None, silent=None, silent_all_from=None, bad=None, permute=False, log=False, **kw):
    """Every rank's Calibration over `windows` windows of synthetic rows; the frames are stacked as
    an all-gather returns them (permute: in a shuffled rank order, rows shuffled within each frame).
    silent=(rank, window): that rank adds no rows from that window on (silent_all_from: no rank);
    bad=(rank, window, ms): that rank's first row of the window comes with ms as its time.
    log: rank 0 logs its fits. Returns (the calibrations, the cost model each window was planned with)."""
    rng, shuffle = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    cals = [Calibration(window_size=window_size, every=every, log_fits=log and r == 0, tag=0, **kw)
            for r in range(ranks)]
    cost, planned = CostModel(), []
    for j in range(windows):
        span = cals[0].due(j)
        if span is not None:
            frames = np.stack([c.frame(*span) for c in cals])
            if permute:
                frames = frames[shuffle.permutation(ranks)]
                for f in frames:
                    body = f[_HEADER:].reshape(-1, _ROW)
                    f[_HEADER:] = body[shuffle.permutation(len(body))].reshape(-1)
            outs = [c.fold(j, span[0], frames, cost) for c in cals]
            assert len({None if o is None else o for o in outs}) == 1, "ranks decided differently"
            cost = outs[0] or cost
        planned.append(cost)
        w = weights2 if drift_at is not None and j >= drift_at else weights
        for s in range(window_size):
            for r, c in enumerate(cals):
                x, ms = _row(rng, w, noise)
                if bad is not None and (r, j, s) == (bad[0], bad[1], 0):
                    ms = bad[2]
                if (silent is None or not (r == silent[0] and j >= silent[1])) and \
                        (silent_all_from is None or j < silent_all_from):
                    c.add_row(j, s, x, ms)
    return cals, planned
