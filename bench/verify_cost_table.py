"""The self-check's cost table, as the README gives it, from the JSONs of `bench/verify_cost.py`
(`ci/selfcheck_cost.sh` writes one per setting: cost_{device,early,pinned}_w{1,4,8}.json).

  python bench/verify_cost_table.py DIR [--path kernel]

One row per JSON: where the micro-batches are, W, the off row's host and device ms, then every
window's and every 100th's host and device time over off, and, where the JSON has them
(`--device-busy`), the GPU's busy ms off and every window's busy time over off. --path: the checksum
path whose rows are read from JSONs that time several (`bench/verify_cost.py --paths kernel,torch`
names them "every window (kernel)"); a JSON of one path has its rows without the name."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

INPUTS = {"pinned": "pinned host memory, read in place", "early": "pinned host memory, copied early (`early_copy`)",
          "device": "on the GPU"}


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


def table(results: list, path: str | None = None) -> str:
    """The markdown table of `results` (parsed JSONs), ordered as INPUTS, then by W; `path`: see --path."""
    order = list(INPUTS)
    results = sorted(results, key=lambda r: (order.index(kind(r)) if kind(r) in order else len(order), r["window"]))
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--path", help="the checksum path of JSONs that time several (kernel, torch)")
    args = p.parse_args(argv)
    found = sorted(args.dir.glob("*.json"))
    if not found:
        p.error(f"{args.dir}: no JSON of bench/verify_cost.py there")
    print(table([json.loads(f.read_text()) for f in found], args.path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
