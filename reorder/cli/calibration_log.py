"""`python -m reorder simulate --calibrate LOG`: the online calibration of a logged run, fit by fit.

Rank 0 of the fit group logs one INFO line per fit (logger "reorder"), which ends in its JSON record
(`reorder.runtime.calibration.RECORD`); any log holding those lines works, whatever prefixes the
logging format adds. The report: per fit the weights, R^2, the predicted max/mean spread of per-rank
step time with the active weights and with the fitted ones, the measured spread and the decision;
per switch the spread measured before it, what the old and new weights predicted on those steps,
and the spread measured on the steps the new weights planned. A log of several runs (the window
index starting over) is reported run by run.
"""

from __future__ import annotations

import json
import math

from reorder.cli.common import CliError, human_stream, plural, write_json
from reorder.runtime.calibration import FEATURES, RECORD

_NEEDED = ("window", "rows", "pooled", "weights", "intercept", "r2", "predicted_spread_current",
           "predicted_spread_fit", "predicted_gain", "measured_spread", "switched", "reason", "active", "outcome",
           "drift", "mode")
_SHORT = {"patches": "patches", "square_patches": "patches^2", "tokens": "tokens", "square_tokens": "tokens^2",
          "images": "images"}


def read_records(path: str) -> list:
    """The fit records of LOG in order, each a dict (`CalibrationReport.record()`); CliError naming
    the line of a record that does not parse or lacks a field."""
    marker = RECORD + "{"
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError as e:
        raise CliError(f"cannot read --calibrate {path}: {e.strerror}") from None
    out = []
    for n, line in enumerate(lines, 1):
        at = line.find(marker)
        if at < 0:
            continue
        text = line[at + len(RECORD):].strip()
        try:
            rec = json.loads(text)
        except json.JSONDecodeError as e:
            raise CliError(f"{path}:{n}: the calibration record is not valid JSON ({e.msg} at column "
                           f"{at + len(RECORD) + e.colno}): is the line cut?") from None
        missing = [k for k in _NEEDED if k not in rec] if isinstance(rec, dict) else list(_NEEDED)
        if missing:
            raise CliError(f"{path}:{n}: the calibration record has no {', '.join(missing)}: written by another "
                           f"version of reorder?")
        out.append(rec)
    if not out:
        raise CliError(f"{path}: no calibration records (lines with '{RECORD.strip()} {{...}}'); log the run at INFO "
                       f"on rank 0 with megatron_mimo_reorder_calibrate shadow or on")
    return out


def split_runs(records: list) -> list:
    """Runs in the order logged: a new one starts where the window index does not grow."""
    runs = [[records[0]]]
    for r in records[1:]:
        if r["window"] <= runs[-1][-1]["window"]:
            runs.append([])
        runs[-1].append(r)
    return runs


def _f(v, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if v is None or (isinstance(v, float) and not math.isfinite(v)) else \
        f"{v:{width}{spec}}"


def summary(run: list) -> dict:
    """What one run's fits add up to: switch windows, drifts, the last fit's weights, the switch
    outcomes (before/after spreads)."""
    fitted = [r for r in run if r["weights"]]
    return dict(fits=len(run), mode=run[-1]["mode"], windows=[run[0]["window"], run[-1]["window"]],
                switches=[r["window"] for r in run if r["switched"]], drifts=[r["window"] for r in run if r["drift"]],
                held=sum(not r["weights"] for r in run),
                last_fit=None if not fitted else dict(window=fitted[-1]["window"], weights=fitted[-1]["weights"],
                                                      intercept=fitted[-1]["intercept"], r2=fitted[-1]["r2"]),
                active=run[-1]["active"], outcomes=[r["outcome"] for r in run if r["outcome"]])


def print_run(out, run: list, index: int, runs: int) -> dict:
    s = summary(run)
    head = f"run {index + 1} of {runs}: " if runs > 1 else "the run: "
    switches = ", ".join(map(str, s["switches"])) or "none"
    print(f"{head}{plural(s['fits'], 'fit')} (mode {s['mode']}), windows {s['windows'][0]}..{s['windows'][1]}; "
          f"switches at windows {switches}" + (f"; drift confirmed at {', '.join(map(str, s['drifts']))}"
                                                if s["drifts"] else ""), file=out)
    cols = "".join(f"{_SHORT[f]:>10}" for f in FEATURES)
    print(f"\n{'window':>6} {'rows':>5} {'fitted':>6} {'R^2':>6}{cols} {'intercept':>9} {'spread active -> fit':>20} "
          f"{'gain':>6} {'measured':>8}  decision", file=out)
    for r in run:
        w = "".join(_f(r["weights"].get(f), ".3g", 10) for f in FEATURES)
        print(f"{r['window']:6d} {r['rows']:5d} {r['pooled']:6d} {_f(r['r2'], '.3f', 6)}{w} "
              f"{_f(r['intercept'], '.3g', 9)} {_f(r['predicted_spread_current'], '.3f', 10)} -> "
              f"{_f(r['predicted_spread_fit'], '.3f', 6)} {_f(r['predicted_gain'], '.3f', 6)} "
              f"{_f(r['measured_spread'], '.3f', 8)}  {r['reason']}", file=out)
    if s["outcomes"]:
        print(f"\n{'switch':>6} {'steps before':>12} {'measured':>8} {'predicted old':>13} {'predicted new':>13} "
              f"{'steps after':>11} {'measured':>8} {'predicted new':>13}", file=out)
        for o in s["outcomes"]:
            print(f"{o['window']:6d} {o['rows_before']:12d} {_f(o['measured_before'], '.3f', 8)} "
                  f"{_f(o['predicted_before'], '.3f', 13)} {_f(o['predicted_after'], '.3f', 13)} "
                  f"{o['rows_after']:11d} {_f(o['measured_after'], '.3f', 8)} "
                  f"{_f(o['predicted_after_seen'], '.3f', 13)}", file=out)
    if s["last_fit"]:
        lf = s["last_fit"]
        weights = ", ".join(f"{k} {lf['weights'][k]:.4g}" for k in FEATURES if k in lf["weights"])
        print(f"\nlast fit (window {lf['window']}): {weights} ms per unit, intercept {lf['intercept']:.4g} ms, "
              f"R^2 {lf['r2']:.3f}", file=out)
    return s


LEGEND = ("rows = new per-rank step times of the fit's windows; fitted = rows of the regime's pool; spread = mean "
          "over steps of max/mean per-rank step time: predicted with the active and the fitted weights, measured on "
          "the new rows; gain = 1 - (fit - 1) / (active - 1)\nswitch table: the steps the old weights planned "
          "(measured, and predicted by the old and the new weights), then the steps the new weights planned "
          "(measured, and what the new weights predicted there)")


def run(args) -> dict:
    out = human_stream(args)
    records = read_records(args.calibrate)
    runs = split_runs(records)
    print(f"reorder simulate --calibrate {args.calibrate}: {plural(len(records), 'fit')}"
          + (f" in {len(runs)} runs" if len(runs) > 1 else ""), file=out)
    summaries = []
    for i, r in enumerate(runs):
        print("", file=out)
        summaries.append(print_run(out, r, i, len(runs)))
    print(f"\n{LEGEND}", file=out, flush=True)
    data = dict(log=args.calibrate, runs=[dict(summary=s, fits=r) for s, r in zip(summaries, runs)])
    write_json(args.json, data)
    return data
