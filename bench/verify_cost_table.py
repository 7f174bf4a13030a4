"""The self-check's cost table, as the README gives it, from the JSONs of `bench/verify_cost.py`
(`ci/selfcheck_cost.sh` writes one per setting: cost_{device,early,pinned}_w{1,4,8}.json).

  python bench/verify_cost_table.py DIR [DIR ...] [--path kernel]

With one DIR, one row per JSON: where the micro-batches are, W, the off row's host and device ms, then every
window's and every 100th's host and device time over off, and, where the JSON has them
(`--device-busy`), the GPU's busy ms off and every window's busy time over off. --path: the checksum
path whose rows are read from JSONs that time several (`bench/verify_cost.py --paths kernel,torch`
names them "every window (kernel)"); a JSON of one path has its rows without the name.

With several DIRs (runs of the same settings, each in its own processes), one row per setting: every
window's host and device time over off, lowest and highest of the runs, and in how many runs both
were within the target (`TARGET_HOST`, `TARGET_DEVICE`). A ratio moves between runs of the same code
by a few points, so one run cannot tell a setting that meets the target from one that is near it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

INPUTS = {"pinned": "pinned host memory, read in place", "early": "pinned host memory, copied early (`early_copy`)",
          "device": "on the GPU"}
TARGET_HOST, TARGET_DEVICE = 1.10, 1.05  # every window over off: what the check may add to a window alone


def kind(result: dict) -> str:
    if result["inputs"] == "pinned":
        return "early" if result["early_copy"] else "pinned"
    return result["inputs"]


def setting(result: dict, name: str, path: str | None) -> dict:
    """The row of setting `name` ("every window", ...) of `path` in `result` (the row named without
    a path where the JSON times one path)."""
    rows = result["settings"]
    if name in rows:
        return rows[name]
    if path is None:
        paths = sorted({r["path"] for r in rows.values() if r["path"]})
        raise ValueError(f"the JSON of {kind(result)} W {result['window']} times the paths {', '.join(paths)}: "
                         f"name one with --path")
    return rows[f"{name} ({path})"]


def _order(key: tuple) -> tuple:
    """Sort key of a setting (kind, W): as INPUTS, then by W."""
    kinds = list(INPUTS)
    return (kinds.index(key[0]) if key[0] in kinds else len(kinds), key[0], key[1])


def table(results: list, path: str | None = None) -> str:
    """The markdown table of `results` (parsed JSONs), ordered as INPUTS, then by W; `path`: see --path."""
    results = sorted(results, key=lambda r: _order((kind(r), r["window"])))
    busy = any("busy_ms" in r["settings"]["off"] for r in results)
    head = ["micro-batches", "W", "off: host / device ms", "every window: host, device", "every 100th: host, device"]
    head += ["off: GPU busy ms", "every window: GPU busy"] if busy else []
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(head) - 2)]
    for r in results:
        off, every, some = (setting(r, name, path) for name in ("off", "every window", "every 100th"))
        cells = [INPUTS.get(kind(r), kind(r)), str(r["window"]), f"{off['host_ms']:.2f} / {off['device_ms']:.2f}",
                 f"{every['host_ratio']:.2f}×, {every['device_ratio']:.2f}×",
                 f"{some['host_ratio']:.2f}×, {some['device_ratio']:.2f}×"]
        if busy:
            cells += [f"{off['busy_ms']:.3f}", f"{every['busy_ratio']:.2f}×"] if "busy_ms" in off else ["-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def spread(runs: list, path: str | None = None) -> str:
    """The markdown table of several runs of the same settings (`runs`: one list of parsed JSONs a
    run), ordered as `table`: per setting, every window's host and device time over off, lowest to
    highest, and in how many of the runs that hold it both were within TARGET_HOST and TARGET_DEVICE."""
    every: dict = {}
    for results in runs:
        for r in results:
            every.setdefault((kind(r), r["window"]), []).append(setting(r, "every window", path))
    lines = ["| micro-batches | W | every window: host | every window: device | within both targets |",
             "|---|---:|---:|---:|---:|"]
    for key in sorted(every, key=_order):
        host = [row["host_ratio"] for row in every[key]]
        device = [row["device_ratio"] for row in every[key]]
        met = sum(h <= TARGET_HOST and d <= TARGET_DEVICE for h, d in zip(host, device))
        lines.append(f"| {INPUTS.get(key[0], key[0])} | {key[1]} | {min(host):.3f}×–{max(host):.3f}× | "
                     f"{min(device):.3f}×–{max(device):.3f}× | {met} of {len(host)} |")
    return "\n".join(lines)


def load_run(folder: Path) -> list:
    """The parsed JSONs of one run of `ci/selfcheck_cost.sh` in `folder` (every *.json there, by name)."""
    return [json.loads(f.read_text()) for f in sorted(Path(folder).glob("*.json"))]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path, nargs="+", help="one run's JSONs; several: the spread over the runs")
    p.add_argument("--path", help="the checksum path of JSONs that time several (kernel, torch)")
    args = p.parse_args(argv)
    runs = [load_run(d) for d in args.dir]
    for d, results in zip(args.dir, runs):
        if not results:
            p.error(f"{d}: no JSON of bench/verify_cost.py there")
    print(table(runs[0], args.path) if len(runs) == 1 else spread(runs, args.path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
