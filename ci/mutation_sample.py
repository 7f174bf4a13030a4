#!/usr/bin/env python3
"""Mutation testing of the pure core with mutmut 3.8.1 (configured in pyproject.toml [tool.mutmut]).

    python ci/mutation_sample.py sample [--count 60] [--seed REV] [--jobs 2] [GLOB...]
        CI check: a sample of the mutants, drawn with the commit hash as the seed, run against the
        fast tests; fails (exit 1) when one survives (or has no test) and is not on the reviewed
        list ci/mutation/equivalent.txt, or when a listed mutant's diff changed (the list is stale).
        GLOBs (mutmut name patterns, e.g. 'reorder.plan.wire.*') draw from the matching mutants only.
    python ci/mutation_sample.py summary [--seconds S]
        Write ci/mutation/summary.md and summary.json from the verdicts in mutants/ (ci/mutation.sh
        runs mutmut, then this).
    python ci/mutation_sample.py show NAME...     the diff of each mutant and its fingerprint
    python ci/mutation_sample.py list             every mutant name (generates the mutants)

Mutant names are mutmut's: module path, then x_<function> or xǁ<Class>ǁ<method>, then __mutmut_<k>,
e.g. reorder.plan.grid.xǁGridǁ__post_init____mutmut_3 or reorder.plan.orders.x__does_not_pay__mutmut_7.
k numbers the mutations of one function in source order: a name stays the same while its function's
source is unchanged (mutmut 3.8.1), and is renumbered when that function is edited. So every line of
equivalent.txt carries the fingerprint of the mutant's diff: an entry whose diff no longer matches is
stale and counts as a survivor until it is reviewed again.

equivalent.txt: one mutant per line, `NAME FINGERPRINT reason`; `#` starts a comment.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "ci" / "mutation"
EQUIVALENT = OUT / "equivalent.txt"
ENV = {"CI": "1", "HYPOTHESIS_PROFILE": "ci", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
       "OPENBLAS_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
# mutmut's exit-code verdicts, folded: detected = killed, timeout (a hung suite fails CI too)
DETECTED = {"killed", "timeout", "segfault", "suspicious"}


def mutmut_bin() -> str:
    here = Path(sys.executable).parent / "mutmut"
    return str(here) if here.exists() else "mutmut"


def in_root():
    os.chdir(ROOT)
    os.environ.update(ENV)


def generate():
    """Write mutants/ (mutmut's copy of the sources with every mutant in it) without running tests."""
    from mutmut.__main__ import CatchOutput, copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
    from mutmut.mutation.trampoline import set_mutant_under_test
    set_mutant_under_test("mutant_generation")
    os.makedirs("mutants", exist_ok=True)
    with CatchOutput():
        copy_src_dir()
        copy_also_copy_files()
        setup_source_paths()
        create_mutants(1)


def verdicts() -> dict:
    """{source path: {mutant name: status}} from mutants/**/*.meta."""
    from mutmut.stats import status_by_exit_code
    out = {}
    for meta in sorted(glob.glob("mutants/reorder/**/*.py.meta", recursive=True)):
        path = meta[len("mutants/"):-len(".meta")]
        with open(meta) as f:
            codes = json.load(f)["exit_code_by_key"]
        out[path] = {k: status_by_exit_code[v] for k, v in sorted(codes.items())}
    return out


def mutated_files() -> list:
    import tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["tool"]["mutmut"]["only_mutate"])


def diff_of(name: str) -> str:
    from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant
    return get_diff_for_mutant(name, path=find_mutant(name).path)


def changed_lines(diff: str) -> list:
    return [ln[0] + ln[1:].strip() for ln in diff.splitlines()
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


def fingerprint(diff: str) -> str:
    return hashlib.sha256("\n".join(changed_lines(diff)).encode()).hexdigest()[:10]


def read_equivalents() -> dict:
    """{name: (fingerprint, reason)}."""
    out = {}
    if not EQUIVALENT.exists():
        return out
    for line in EQUIVALENT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, fp, reason = (line.split(None, 2) + ["", ""])[:3]
        out[name] = (fp, reason)
    return out


def check_equivalent(name: str, equivalents: dict) -> str | None:
    """None when `name` is a reviewed equivalent whose diff still matches, else why not."""
    if name not in equivalents:
        return "not on the equivalent list"
    want = equivalents[name][0]
    got = fingerprint(diff_of(name))
    return None if got == want else f"on the equivalent list with fingerprint {want}, but its diff now has {got}"


# --- summary --------------------------------------------------------------------------------------

def summary(seconds: float | None):
    in_root()
    files = mutated_files()
    data = verdicts()
    equivalents = read_equivalents()
    rows, survivors, equiv_rows, stale = [], [], [], []
    totals = dict.fromkeys(("mutants", "killed", "timeout", "survived", "no_tests", "equivalent", "not_checked"), 0)
    for path in files:
        v = data.get(path, {})
        row = dict.fromkeys(totals, 0)
        row["mutants"] = len(v)
        for name, status in v.items():
            if status in DETECTED:
                row["timeout" if status == "timeout" else "killed"] += 1
            elif status == "not checked":
                row["not_checked"] += 1
            else:                                   # survived, no tests, skipped, ...
                why = check_equivalent(name, equivalents)
                if why is None:
                    row["equivalent"] += 1
                    equiv_rows.append((name, equivalents[name][1]))
                    continue
                if name in equivalents:
                    stale.append(name)
                row["no_tests" if status == "no tests" else "survived"] += 1
                survivors.append({"name": name, "status": status, "diff": changed_lines(diff_of(name))})
        checked = row["mutants"] - row["not_checked"] - row["equivalent"]
        row["score"] = round(100.0 * (row["killed"] + row["timeout"]) / checked, 2) if checked else None
        rows.append((path, row))
        for k in totals:
            totals[k] += row[k]
    checked = totals["mutants"] - totals["not_checked"] - totals["equivalent"]
    totals["score"] = round(100.0 * (totals["killed"] + totals["timeout"]) / checked, 2) if checked else None
    totals["equivalent_share"] = round(100.0 * totals["equivalent"] / totals["mutants"], 2) if totals["mutants"] else 0
    rev = os.environ.get("MUTATION_COMMIT") or subprocess.run(  # a copy of the tree may carry stale git metadata
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"mutmut": "3.8.1", "commit": rev, "seconds": seconds, "files": dict(rows), "total": totals,
           "survivors": survivors, "stale_equivalents": stale}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")

    cols = ("mutants", "killed", "timeout", "survived", "no_tests", "equivalent", "not_checked", "score")
    lines = ["# Mutation score of the pure core", "",
             f"mutmut 3.8.1 over {', '.join(f'`{p}`' for p in files)}, tests of `[tool.mutmut]` in pyproject.toml "
             f"(commit {rev}{f', {seconds / 60:.0f} min' if seconds else ''}; `ci/mutation.sh`).",
             "score = (killed + timeout) / (mutants - equivalent - not checked); no tests counts as survived.", "",
             "| file | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for path, row in rows + [("**total**", totals)]:
        lines.append(f"| {path} | " + " | ".join("" if row[c] is None else str(row[c]) for c in cols) + " |")
    lines += ["", f"Equivalent mutants: {totals['equivalent']} ({totals['equivalent_share']} % of all; "
              "reviewed list: ci/mutation/equivalent.txt).", ""]
    if stale:
        lines += ["Stale equivalent entries (diff changed; review again): " + ", ".join(stale), ""]
    lines += [f"## Survivors ({len(survivors)})", ""]
    for s in survivors:
        lines.append(f"- `{s['name']}` ({s['status']}): " + " / ".join(f"`{d}`" for d in s["diff"]))
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:len(rows) + 8]))


# --- sample ---------------------------------------------------------------------------------------

def all_names() -> list:
    generate()
    files = set(mutated_files())
    return sorted(name for path, v in verdicts().items() if path in files for name in v)


def sample(count: int, seed: str, jobs: int, patterns: list) -> int:
    in_root()
    t0 = time.time()
    names = [n for n in all_names() if not patterns or any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    if not names:
        print(f"mutation sample: no mutant matches {patterns}")
        return 2
    picked = sorted(random.Random(seed).sample(names, min(count, len(names))))
    print(f"mutation sample: {len(picked)} of {len(names)} mutants, seed {seed}", flush=True)
    run = subprocess.run([mutmut_bin(), "run", "--max-children", str(jobs), *picked],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0:
        print(run.stdout[-4000:])
        print(f"mutation sample: mutmut run failed (exit {run.returncode})")
        return 2
    status = {k: s for v in verdicts().values() for k, s in v.items()}
    equivalents = read_equivalents()
    bad = []
    for name in picked:
        s = status.get(name, "not checked")
        if s in DETECTED:
            continue
        why = "not run" if s == "not checked" else check_equivalent(name, equivalents)
        if why is not None:
            bad.append((name, s, why))
    detected = sum(status.get(n) in DETECTED for n in picked)
    print(f"mutation sample: {detected} detected, {len(picked) - detected - len(bad)} reviewed equivalents, "
          f"{len(bad)} unexplained, in {time.time() - t0:.0f} s")
    for name, s, why in bad:
        print(f"\n{name}: {s} ({why})\n{diff_of(name) if s != 'not checked' else ''}")
    if bad:
        print("\nA surviving mutant is a behaviour no test pins down: add a test that kills it, or, if it is "
              "equivalent, add it to ci/mutation/equivalent.txt as `NAME FINGERPRINT reason` "
              "(python ci/mutation_sample.py show NAME prints the fingerprint).")
    return 1 if bad else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--count", type=int, default=int(os.environ.get("MUTATION_SAMPLE", 60)))
    s.add_argument("--seed", default=None, help="default: the commit hash (git rev-parse HEAD)")
    s.add_argument("--jobs", type=int, default=int(os.environ.get("MUTATION_JOBS", 2)))
    s.add_argument("patterns", nargs="*", metavar="GLOB", help="draw only from mutants whose names match")
    m = sub.add_parser("summary")
    m.add_argument("--seconds", type=float, default=None)
    sh = sub.add_parser("show")
    sh.add_argument("names", nargs="+")
    sub.add_parser("list")
    a = p.parse_args(argv)
    if a.cmd == "sample":
        seed = a.seed or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip() or "0"
        return sample(a.count, seed, a.jobs, a.patterns)
    if a.cmd == "summary":
        summary(a.seconds)
        return 0
    in_root()
    if a.cmd == "list":
        print("\n".join(all_names()))
        return 0
    for name in a.names:
        d = diff_of(name)
        print(f"{name} {fingerprint(d)}\n{d}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
