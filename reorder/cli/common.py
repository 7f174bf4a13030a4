"""Shared bits of the command line: the user-facing error type, layouts from flags, JSON output."""

from __future__ import annotations

import json
import sys


class CliError(Exception):
    """A problem the user can fix (bad flag, bad input file): printed as one line, no traceback.
    `code` is the exit status (2 = bad input or usage, 1 = the run itself failed)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def human_stream(args):
    """Where tables and progress go: stderr when the JSON summary takes stdout (--json -)."""
    return sys.stderr if getattr(args, "json", None) == "-" else sys.stdout


def write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    text = json.dumps(data, indent=2, sort_keys=False, default=_plain)
    if path == "-":
        print(text, flush=True)
        return
    try:
        with open(path, "w") as f:
            f.write(text + "\n")
    except OSError as e:
        raise CliError(f"cannot write --json {path}: {e.strerror}") from None


def _plain(x):
    import numpy as np

    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, np.floating):
        return float(x)
    if isinstance(x, np.ndarray):
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def make_plot(fn, path: str, *args) -> None:
    """Draw with reorder.cli.plots.<fn>; a missing matplotlib or an unwritable path is a CliError."""
    from reorder.cli import plots

    try:
        getattr(plots, fn)(path, *args)
    except plots.PlotUnavailable as e:
        raise CliError(str(e)) from None
    except OSError as e:
        raise CliError(f"cannot write --plot {path}: {e.strerror or e}") from None


def check_plot_path(path: str | None) -> None:
    """Fail fast (before a long run) when --plot cannot work."""
    if not path:
        return
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs matplotlib: pip install 'reorder[plot]' (or pip install matplotlib)")
    if not path.lower().endswith(".png"):
        raise CliError(f"--plot {path}: give a .png file name")


def layout_from_args(args) -> dict:
    """Module name -> DP size from --dp LIST or --vision-dp / --language-dp."""
    dp_list = getattr(args, "dp", None)
    if dp_list is not None:
        if args.vision_dp is not None or args.language_dp is not None:
            raise CliError("give either --dp or --vision-dp/--language-dp, not both")
        try:
            sizes = [int(x) for x in dp_list.replace(",", " ").split()]
        except ValueError:
            raise CliError(f"--dp {dp_list!r}: expected comma-separated integers, e.g. --dp 2,4") from None
        if not sizes:
            raise CliError("--dp is empty: give the DP size of every module, e.g. --dp 2,4")
        names = {1: ["model"], 2: ["vision", "language"]}.get(len(sizes), [f"module{i}" for i in range(len(sizes))])
        dps = dict(zip(names, sizes))
    else:
        dps = {"vision": 2 if args.vision_dp is None else args.vision_dp,
               "language": 4 if args.language_dp is None else args.language_dp}
    for name, d in dps.items():
        if d < 1:
            raise CliError(f"{name} dp {d} is invalid: every module's DP size must be >= 1")
    return dps
