#!/usr/bin/env python3
"""Mutation testing of the pure core with mutmut 3.8.1 (configured in pyproject.toml [tool.mutmut]).

    python ci/mutation_sample.py sample [--count 60] [--seed REV] [--jobs 2] [GLOB...]
        CI check: a sample of the mutants, drawn with the commit hash as the seed, run against the
        fast tests; fails (exit 1) when one survives (or has no test) and is not on a reviewed list
        (below), or when a listed mutant's diff changed (the list is stale).
        GLOBs (mutmut name patterns, e.g. 'reorder.plan.wire.*') draw from the matching mutants only.
    python ci/mutation_sample.py summary [--seconds S] [--jobs J] [-- GLOB...]
        Write ci/mutation/summary.md and summary.json from the verdicts in mutants/ (ci/mutation.sh
        runs mutmut, then this, with its globs). A file whose every mutant this run judged gets this
        run's row; the other files keep the row of the run that last judged them (mutants of theirs
        this run judged again replace their old verdicts), so the summary states per file which run,
        at which commit, produced it.
    python ci/mutation_sample.py show NAME...     the diff of each mutant and its fingerprint
    python ci/mutation_sample.py list             every mutant name (generates the mutants)
    python ci/mutation_sample.py prepare          drop plain copies in mutants/ of files added to
                                                  only_mutate since mutants/ was made (ci/mutation.sh)

Mutant names are mutmut's: module path, then x_<function> or xǁ<Class>ǁ<method>, then __mutmut_<k>,
e.g. reorder.plan.grid.xǁGridǁ__post_init____mutmut_3 or reorder.plan.orders.x__does_not_pay__mutmut_7.
k numbers the mutations of one function in source order: a name stays the same while its function's
source is unchanged (mutmut 3.8.1), and is renumbered when that function is edited. So every line of
a reviewed list carries the fingerprint of the mutant's diff: an entry whose diff no longer matches
is stale and counts as a survivor until it is reviewed again.

Reviewed lists, one mutant per line, `NAME FINGERPRINT reason`; `#` starts a comment. Each is a
category of its own in the summary; only the first is left out of the score:
    ci/mutation/equivalent.txt    equivalent: no input tells the mutant from the original
    ci/mutation/another_plan.txt  same objective, another plan: an input does tell it apart, but the
                                  result is another of several equally good ones (another optimal
                                  plan of `exact`, a plan within `balanced`'s tie margin)
    ci/mutation/rounding.txt      same value, another rounding: equal in exact arithmetic, the float
                                  result may differ in its last bits
    ci/mutation/cuda_only.txt     differs only with CUDA tensors (a launch, a stream, pinned memory):
                                  the mutation run, on CPUs, cannot reach it
A CUDA-only entry that the GPU checks kill (ci/mutation_gpu.py writes ci/mutation/gpu_killed.txt,
`NAME FINGERPRINT check`) counts as killed (`gpu_killed`) while its fingerprint matches.
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
# (key, file, what it means): the reviewed categories of surviving mutants; only "equivalent" leaves
# the score's denominator, the others are survivors whose difference was judged harmless
REVIEWED = (("equivalent", "equivalent.txt", "equivalent"),
            ("another_plan", "another_plan.txt", "same objective, another plan"),
            ("rounding", "rounding.txt", "same value, another rounding"),
            ("cuda_only", "cuda_only.txt", "differs only with CUDA tensors"))
CATEGORY = {key: words for key, _, words in REVIEWED}
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


def drop_unmutated_copies():
    """mutmut mutates a source again only when it is newer than its copy in mutants/: a file added to
    only_mutate after mutants/ was made keeps its plain copy there, and would never be mutated. Such
    copies (no .meta beside them) are removed, so the next mutmut run mutates them, and with them
    mutmut's map of which tests reach which function (made while they were plain, it maps none)."""
    dropped = False
    for path in mutated_files():
        copy = Path("mutants") / path
        if copy.exists() and not Path(f"{copy}.meta").exists():
            copy.unlink()
            dropped = True
    if dropped:
        Path("mutants/mutmut-stats.json").unlink(missing_ok=True)


def generate():
    """Write mutants/ (mutmut's copy of the sources with every mutant in it) without running tests."""
    drop_unmutated_copies()
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


def read_list(path: Path) -> dict:
    """{name: (fingerprint, reason)} of one reviewed list."""
    out = {}
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, fp, reason = (line.split(None, 2) + ["", ""])[:3]
        out[name] = (fp, reason)
    return out


def read_reviewed() -> dict:
    """{name: (category, fingerprint, reason)} over every reviewed list; a name on two lists is an error."""
    out = {}
    for key, file, _ in REVIEWED:
        for name, (fp, reason) in read_list(OUT / file).items():
            if name in out:
                raise SystemExit(f"{name} is on ci/mutation/{file} and on the {out[name][0]} list: one category each")
            out[name] = (key, fp, reason)
    return out


def check_reviewed(name: str, reviewed: dict) -> tuple:
    """(category, None) when `name` is on a reviewed list and its diff still matches, else (None, why not)."""
    if name not in reviewed:
        return None, "not on a reviewed list"
    key, want, _ = reviewed[name]
    got = fingerprint(diff_of(name))
    if got != want:
        return None, f"on the {CATEGORY[key]} list with fingerprint {want}, but its diff now has {got}"
    return key, None


# --- summary --------------------------------------------------------------------------------------

COUNTS = ("mutants", "killed", "timeout", "survived", "no_tests", "gpu_killed", *(k for k, _, _ in REVIEWED),
          "not_checked")


def decorated_functions(path: Path) -> list:
    """(line, name, decorators, lines of body past its docstring) of every function of the file that
    mutmut leaves out: one with a decorator but @staticmethod or @classmethod alone."""
    import ast
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.decorator_list:
            names = [ast.unparse(d) for d in node.decorator_list]
            if names in (["staticmethod"], ["classmethod"]):
                continue
            body = node.body[1:] if isinstance(node.body[0], ast.Expr) and isinstance(
                getattr(node.body[0], "value", None), ast.Constant) else node.body
            out.append((node.lineno, node.name, names, body[-1].end_lineno - body[0].lineno + 1))
    return out


def left_out_properties() -> list:
    """(file:name, lines of its body) of every property of the mutated files: mutmut mutates no
    decorated function but static and class methods."""
    return [(f"{path.rsplit('/', 1)[-1]}:{name}", lines) for path in mutated_files()
            for _, name, names, lines in decorated_functions(ROOT / path) if names == ["property"]]


def module_of(path: str) -> str:
    return path[:-len(".py")].replace("/", ".")


def matches(name: str, globs: list) -> bool:
    return not globs or any(fnmatch.fnmatchcase(name, g) for g in globs)


def next_label(runs: dict) -> str:
    """The label after the last one in use: A, B, ..., Z, AA, AB, ... (never one used before)."""
    def number(label):
        n = 0
        for ch in label:
            n = n * 26 + ord(ch) - ord("A") + 1
        return n
    n = max((number(k) for k in runs), default=0) + 1
    label = ""
    while n:
        n, r = divmod(n - 1, 26)
        label = chr(ord("A") + r) + label
    return label


def legacy_open(path: str, row: dict, reviewed: dict) -> dict | None:
    """The surviving mutants of a row written before rows listed them: every mutant of the file on a
    reviewed list (all of that run's survivors were), when their number is the row's; else None."""
    names = [n for n in reviewed if n.startswith(module_of(path) + ".x")]
    kept = row.get("survived", 0) + row.get("no_tests", 0) + sum(row.get(k, 0) for k, _, _ in REVIEWED)
    if row.get("survived", 0) or row.get("no_tests", 0) or len(names) != kept:
        return None
    return {n: "survived" for n in names}


def counted(row: dict, reviewed: dict, gpu: dict, survivors: list, stale: list) -> dict:
    """The row's counts, its surviving mutants sorted into the reviewed categories as the lists stand
    (`gpu`: the CUDA-only survivors the GPU checks killed, gpu_killed.txt)."""
    out = {k: row.get(k, 0) for k in COUNTS}
    if row.get("open") is None:   # the file's mutants are no longer what that run judged: counts as they were
        return out
    for k in COUNTS[3:-1]:
        out[k] = 0
    for name, status in sorted(row["open"].items()):
        if name in gpu and gpu[name][0] == fingerprint(diff_of(name)):  # a GPU check kills it
            out["gpu_killed"] += 1
            continue
        key, why = check_reviewed(name, reviewed)
        if key is not None:
            out[key] += 1
            continue
        if name in reviewed:
            stale.append(name)
        out["no_tests" if status == "no tests" else "survived"] += 1
        survivors.append({"name": name, "status": status, "why": why, "diff": changed_lines(diff_of(name))})
    return out


def score(row: dict, leave_out=("equivalent",)) -> float | None:
    checked = row["mutants"] - row["not_checked"] - sum(row[k] for k in leave_out)
    return round(100.0 * (row["killed"] + row["timeout"] + row["gpu_killed"]) / checked, 2) if checked else None


def cpu_score(row: dict) -> float | None:
    """The score over what a run on CPUs can reach: the CUDA-only survivors left out too."""
    return score(row, ("equivalent", "cuda_only"))


def summary(seconds: float | None, jobs: int, globs: list):
    in_root()
    files = mutated_files()
    data = verdicts()
    reviewed = read_reviewed()
    gpu = read_list(OUT / "gpu_killed.txt")
    previous = json.loads((OUT / "summary.json").read_text()) if (OUT / "summary.json").exists() else {}
    runs = dict(previous.get("runs", {}))
    old_rows = previous.get("files", {})
    rev = os.environ.get("MUTATION_COMMIT") or subprocess.run(  # a copy of the tree may carry stale git metadata
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    label = next_label(runs)
    run = {"commit": rev, "jobs": jobs, "seconds": round(seconds) if seconds else None,
           "command": f"MUTATION_JOBS={jobs} ci/mutation.sh" + "".join(f" '{g}'" for g in globs),
           "where": os.environ.get("MUTATION_HOST", f"{os.cpu_count()}-core host"), "files": [], "again": {}}
    rows, survivors, stale, changed = {}, [], [], {}
    for path in files:
        v = data.get(path, {})
        mine = {n: s for n, s in v.items() if matches(n, globs) and s != "not checked"}
        if v and len(mine) == len(v):                       # every mutant of the file judged by this run
            row = {"mutants": len(v), "run": label, "not_checked": 0,
                   "killed": sum(s in DETECTED and s != "timeout" for s in v.values()),
                   "timeout": sum(s == "timeout" for s in v.values()),
                   "open": {n: s for n, s in v.items() if s not in DETECTED}}
            run["files"].append(path)
        elif path in old_rows:                              # the last run that judged the file
            row = dict(old_rows[path])
            if v and len(v) != row["mutants"]:
                changed[path] = (len(v), row["mutants"])
            if "open" not in row:
                row["open"] = legacy_open(path, row, reviewed)
            if mine and row["open"] is not None:            # some of its mutants judged again now
                for name, status in mine.items():
                    was = row["open"].pop(name, None)
                    if status in DETECTED:
                        row["timeout" if status == "timeout" else "killed"] += was is not None
                    else:
                        row["open"][name] = status
                        if was is None:
                            row["killed"] -= 1              # killed then, survives now
                row["again"] = {**row.get("again", {}), label: len(mine)}
                run["again"][path] = len(mine)
        else:                                               # never judged
            row = {"mutants": len(v), "run": None, "not_checked": len(v), "killed": 0, "timeout": 0, "open": {}}
        rows[path] = row
    out_rows = {}
    for path, row in rows.items():
        c = counted(row, reviewed, gpu, survivors, stale)
        out_rows[path] = {**c, "score": score(c), "cpu_score": cpu_score(c), "run": row["run"], **({"again": row["again"]} if row.get("again")
                                                                      else {}), "open": row["open"]}
    total = {k: sum(r[k] for r in out_rows.values()) for k in COUNTS}
    total["score"], total["cpu_score"] = score(total), cpu_score(total)
    total["equivalent_share"] = round(100.0 * total["equivalent"] / total["mutants"], 2) if total["mutants"] else 0
    if run["files"] or run["again"]:
        runs[label] = run
    used = {r["run"] for r in out_rows.values()} | {k for r in out_rows.values() for k in r.get("again", {})}
    runs = {k: v for k, v in runs.items() if k in used}
    doc = {"mutmut": "3.8.1", "runs": runs, "files": out_rows, "total": total, "survivors": survivors,
           "stale_reviews": stale, "changed_since": {p: {"now": a, "then": b} for p, (a, b) in changed.items()}}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.json").write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")

    cols = COUNTS + ("score", "cpu_score")
    lines = ["# Mutation score of the pure core", "",
             "mutmut 3.8.1 over the files of `[tool.mutmut] only_mutate`, the tests of `[tool.mutmut]` in pyproject.toml "
             "(`ci/mutation.sh`). Each file's verdicts come from the last run that judged every mutant of it (a file "
             "changed since is run again); `+X` marks mutants of it that run X judged again:", ""]
    for k, r in sorted(runs.items()):
        files_of = r["files"] if isinstance(r.get("files"), list) else [r.get("files", "")]
        what = ", ".join(f"`{f.rsplit('/', 1)[-1]}`" if f.endswith(".py") else f for f in files_of)
        again = "; again: " + ", ".join(f"{n} mutants of `{p.rsplit('/', 1)[-1]}`" for p, n in r["again"].items()) \
            if r.get("again") else ""
        took = f", {r['seconds'] / 60:.0f} min" if r.get("seconds") else ""
        command = r.get("command", "")
        if command.count("'") > 8:              # many mutant names: the first glob, and how many more
            head, *rest = command.split(" '")
            command = f"{head} '{rest[0]} ... ({len(rest) - 1} more names: summary.json)"
        lines.append(f"- run {k}: commit {r['commit']}, `{command}`" if command else
                     f"- run {k}: commit {r['commit']}, {r.get('where', '')}")
        body = what + again if what else again.lstrip("; ")  # a run that only judged some mutants again
        lines[-1] += (f" on a {r['where']}{took}" if r.get("command") else took) + f": {body}"
    lines += ["", "score = (killed + timeout + gpu_killed) / (mutants - equivalent - not checked): every other "
              "survivor counts against it, reviewed or not. gpu_killed: CUDA-only survivors of the CPU run that the "
              "GPU checks kill (`ci/mutation_gpu.py`, `gpu_killed.txt`). Reviewed survivors (one category each; lists in ci/mutation/): "
              + "; ".join(f"{k} = {w} (`{f}`)" for k, f, w in REVIEWED) + ". cpu_score leaves the CUDA-only "
              "survivors out too: the score over what a run on CPUs can reach.", "",
              "| file | run | " + " | ".join(cols) + " |", "|---|---|" + "---:|" * len(cols)]
    for path, row in list(out_rows.items()) + [("**total**", total)]:
        who = "" if path == "**total**" else (row["run"] or "not run") + "".join(f" +{k}" for k in row.get("again", {}))
        lines.append(f"| {path} | {who} | " + " | ".join("" if row[c] is None else str(row[c]) for c in cols) + " |")
    lines += ["", f"Equivalent mutants: {total['equivalent']} ({total['equivalent_share']} % of all); "
              + ", ".join(f"{CATEGORY[k]}: {total[k]}" for k, _, _ in REVIEWED[1:]) + ".", ""]
    props = left_out_properties()
    lines += [f"Not mutated: mutmut leaves out every decorated function but static and class methods; in these files "
              f"those are {len(props)} properties ({sum(n for _, n in props)} lines of body, tests/test_mutation_reach.py "
              "keeps it so): " + ", ".join(f"`{name}`" for name, _ in props) + ".", ""]
    if changed:
        lines += ["Changed since the run that judged them (its row stands until a run judges them again; "
                  "mutants now / then): " + ", ".join(f"`{p}` {a} / {b}" for p, (a, b) in changed.items()) + ".", ""]
    if stale:
        lines += ["Stale reviewed entries (diff changed; review again): " + ", ".join(stale), ""]
    lines += [f"## Survivors ({len(survivors)})", ""]
    for sv in survivors:
        lines.append(f"- `{sv['name']}` ({sv['status']}): " + " / ".join(f"`{d}`" for d in sv["diff"]))
    (OUT / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:lines.index("## Survivors " + f"({len(survivors)})")]))


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
    reviewed = read_reviewed()
    bad, by_category = [], dict.fromkeys(CATEGORY, 0)
    for name in picked:
        s = status.get(name, "not checked")
        if s in DETECTED:
            continue
        key, why = (None, "not run") if s == "not checked" else check_reviewed(name, reviewed)
        if key is None:
            bad.append((name, s, why))
        else:
            by_category[key] += 1
    detected = sum(status.get(n) in DETECTED for n in picked)
    print(f"mutation sample: {detected} detected, "
          + ", ".join(f"{n} reviewed as {CATEGORY[k]}" for k, n in by_category.items() if n)
          + f"{', ' if any(by_category.values()) else ''}{len(bad)} unexplained, in {time.time() - t0:.0f} s")
    for name, s, why in bad:
        print(f"\n{name}: {s} ({why})\n{diff_of(name) if s != 'not checked' else ''}")
    if bad:
        print("\nA surviving mutant is a behaviour no test pins down: add a test that kills it, or, if it is "
              "equivalent, add it to ci/mutation/equivalent.txt as `NAME FINGERPRINT reason` "
              "(python ci/mutation_sample.py show NAME prints the fingerprint); the other reviewed lists "
              "(ci/mutation_sample.py --help) hold survivors that an input tells apart, judged harmless.")
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
    m.add_argument("--jobs", type=int, default=int(os.environ.get("MUTATION_JOBS", 1)))
    m.add_argument("globs", nargs="*", metavar="GLOB", help="the mutmut name globs of the run (none: every mutant)")
    sh = sub.add_parser("show")
    sh.add_argument("names", nargs="+")
    sub.add_parser("list")
    sub.add_parser("prepare", help="before a mutmut run in an existing mutants/: drop the plain copies of files "
                                   "added to only_mutate since it was made, so that they are mutated")
    a = p.parse_args(argv)
    if a.cmd == "sample":
        seed = a.seed or subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip() or "0"
        return sample(a.count, seed, a.jobs, a.patterns)
    if a.cmd == "summary":
        summary(a.seconds, a.jobs, a.globs)
        return 0
    in_root()
    if a.cmd == "prepare":
        drop_unmutated_copies()
        return 0
    if a.cmd == "list":
        print("\n".join(all_names()))
        return 0
    for name in a.names:
        d = diff_of(name)
        print(f"{name} {fingerprint(d)}\n{d}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
