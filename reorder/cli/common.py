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


def plural(n: int, word: str) -> str:
    """'1 micro-batch', '2 micro-batches', '1 window', '12 windows'."""
    return f"{n} {word}" if n == 1 else f"{n} {word}es" if word.endswith(("ch", "sh", "s", "x")) else f"{n} {word}s"


def worse_note(module: str, dp: int, saved: float, balancer: str, groups: int) -> str | None:
    """One line when reordering made a module's straggler cost worse than the natural split (else None)."""
    if saved >= 0:
        return None
    return (f"note: balancer {balancer} made {module} (dp {dp}) {-saved:.1%} worse than without reordering: one plan "
            f"over the G={groups} groups serves every module, and a module with fewer ranks can lose where one with "
            "more gains")


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


PLOT_FORMATS = (".png", ".pdf", ".svg")  # what matplotlib writes from the file name


def check_plot_path(path: str | None) -> None:
    """Fail fast (before a long run) when --plot cannot work."""
    if not path:
        return
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise CliError("--plot needs matplotlib: pip install 'reorder[plot]' (or pip install matplotlib)")
    if not path.lower().endswith(PLOT_FORMATS):
        raise CliError(f"--plot {path}: give a file name ending in {', '.join(PLOT_FORMATS)} (the format follows it)")


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
