#!/usr/bin/env python3
"""Mutation check: the CPU test suite must catch deliberately broken implementations.

For every mutation below: copy the repository (tracked + untracked-not-ignored files) into a temp
dir, apply the mutation as an exact string replacement in one file (the old string must occur
exactly once), run the relevant tests there and record whether they failed and which test failed
first. Prints a markdown table and exits 1 if any mutation survives (2 if the unmutated copy
already fails, i.e. the check itself is meaningless).

    python ci/mutants.py                     # all mutations
    python ci/mutants.py -k lpt -k moves     # only mutations whose name contains one of these
    python ci/mutants.py --list              # print the mutations and exit
    python ci/mutants.py --rev HEAD          # test a commit's tree instead of the working tree
    python ci/mutants.py -- --hypothesis-seed=0   # extra pytest args after --

Each run: `python -m pytest -x -q -p no:cacheprovider -n 2 <tests>` in the copy, with
PYTHONPATH=<copy> and HYPOTHESIS_PROFILE=ci. A run that exceeds --timeout counts as caught
(the suite would hang / fail CI) and is marked as a timeout.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALL_TESTS = ("tests/plan/test_grid_cost.py", "tests/plan/test_moves.py", "tests/batch/test_packing.py",
             "tests/exchange/test_exchanger.py", "tests/exchange/test_exchange_faults.py")


@dataclass(frozen=True)
class Mutation:
    name: str
    path: str
    old: str
    new: str
    tests: tuple = ALL_TESTS


MUTATIONS = [
    # 1. LPT visit order (-cost, -index) instead of (-cost, index): ties broken the wrong way.
    Mutation("lpt tie-break flipped (-cost, -index)", "reorder/plan/balancers.py",
             'visit = np.argsort(-c, kind="stable")  # (-cost, index)',
             "visit = np.lexsort((-np.arange(len(c)), -c))"),
    # 2a. wire order per peer without the slot term: pieces ordered by position alone.
    Mutation("moves wire order drops the slot term", "reorder/plan/moves.py",
             "return ids[sel][np.lexsort((plan.dest_pos[sel], plan.dest_slot[sel], peer[sel]))]",
             "return ids[sel][np.lexsort((plan.dest_pos[sel], peer[sel]))]"),
    # 2b. samples inside a piece indexed in reverse arrival order.
    Mutation("moves index inside a piece reversed", "reorder/plan/moves.py",
             "j = _grouped_before(np.full(len(key), 1), key)",
             "j = _grouped_before(np.full(len(key), 1), key)[::-1]"),
    # 3. running entry offsets inclusive instead of exclusive: every sample's rows start at its neighbour's end
    #    (in a piece on the wire; in a shard or an output slot).
    Mutation("moves ragged offsets off by one sample", "reorder/plan/moves.py",
             "run = np.cumsum(values, axis=0) - values",
             "run = np.cumsum(values, axis=0)"),
    Mutation("moves shard offsets off by one sample", "reorder/plan/moves.py",
             "return (np.cumsum(v, axis=1) - v).reshape(values.shape)",
             "return np.cumsum(v, axis=1).reshape(values.shape)"),
    # 4a. regions not padded to ALIGN.
    Mutation("moves regions not aligned", "reorder/plan/moves.py",
             "sizes = align(entries[cols.field_kind].T * cols.field_size)",
             "sizes = entries[cols.field_kind].T * cols.field_size"),
    # 4b. the leading index of a dense field (MRoPE [3, B, S]) not strided by the container's samples.
    Mutation("moves dense leading index stride dropped", "reorder/plan/moves.py",
             "(cols.p * pl.n[:, None] + pl.j[:, None]) * cols.unit",
             "(cols.p + pl.j[:, None]) * cols.unit"),
    # 4c. per-image fields placed by their sample's rows.
    Mutation("moves per-image fields by row offsets", "reorder/plan/moves.py",
             "pl.before[:, cols.kind] * cols.unit)",
             "pl.before[:, np.minimum(cols.kind, 1)] * cols.unit)"),
    # 5a. spatial merge factor not squared.
    Mutation("cost merge factor not squared", "reorder/plan/cost.py",
             "merge2 = float(self.spatial_merge_size * self.spatial_merge_size)",
             "merge2 = float(self.spatial_merge_size)"),
    # 5b. real-token count includes padding.
    Mutation("counting attention mask counts padding", "reorder/batch/counting.py",
             "real = a != 0\n",
             "real = a == a\n"),
    # 6. owner of a canonical group round-robin (modulo) instead of contiguous blocks (division).
    Mutation("grid owner modulo instead of division", "reorder/plan/grid.py",
             "return group // self.groups_per_rank",
             "return group % self.dp"),
    # 7a. the window's language cost from the image column instead of real tokens.
    Mutation("window cost real tokens -> images", "reorder/plan/window.py",
             "cost.costs(counts.placeholders, counts.real_tokens, counts.square_patches, counts.images)",
             "cost.costs(counts.placeholders, counts.images, counts.square_patches, counts.images)"),
    # 7b. the window's encoder cost from the image column instead of placeholders.
    Mutation("window cost placeholders -> images", "reorder/plan/window.py",
             "cost.costs(counts.placeholders, counts.real_tokens, counts.square_patches, counts.images)",
             "cost.costs(counts.images, counts.real_tokens, counts.square_patches, counts.images)"),
    # 8. the error bit of the all-gathered window frame is always 0: a rank-local error is not shared.
    Mutation("window frame error bit always 0", "reorder/plan/wire.py",
             "frame[:TEXT_AT] = (MAGIC, int(error is not None), slots,",
             "frame[:TEXT_AT] = (MAGIC, 0, slots,"),
    # 8b. a slot whose output is not this rank's own in order is taken as kept (returned unchanged).
    Mutation("moves keep every slot", "reorder/plan/moves.py",
             "[:, None] + np.arange(b)).all(axis=1)",
             "[:, None] + np.arange(b)).all(axis=1) | True"),
    # 8c. the driver never advances the gate backoff: it plans windows the other modules skip.
    Mutation("gate backoff not advanced", "reorder/exchange/exchanger.py",
             "self.backoff, self._paths = self.backoff.planned(plan.fully_gated), _paths(layout)",
             "self._paths = _paths(layout)",
             ("tests/exchange/test_exchanger.py",)),
    # 8d. the backoff never grows: one window skipped after every gated one.
    Mutation("gate backoff does not double", "reorder/plan/backoff.py",
             "skip=min(2 ** (run - 1), self.cap)",
             "skip=min(1, self.cap)",
             ("tests/exchange/test_exchanger.py", "tests/plan/test_backoff.py")),
    # 9. MRoPE position_ids [3, B, S] described with batch dim 0.
    Mutation("layout position_ids batch dim 0", "reorder/batch/layout.py",
             "want = 1 if v.dim() == 3 else 0",
             "want = 0"),
    # 10. the config frame is not compared: ranks configured differently go on.
    Mutation("config frame never differs", "reorder/plan/wire.py",
             "    if (gathered == gathered[0]).all():\n        return None",
             "    if True:\n        return None"),
    # 11. device counting: squared run lengths summed as 2k instead of 2k + 1 per position.
    Mutation("device square patches drop the +1", "reorder/batch/counting.py",
             "return torch.where(m, 2 * (idx - run_start) + 1, 0).sum(dim=1)",
             "return torch.where(m, 2 * (idx - run_start), 0).sum(dim=1)",
             ("tests/plan/test_grid_cost.py",)),
]


def repo_files(root: str) -> list:
    """Tracked + untracked-not-ignored files (falls back to a walk without .git/.venv/caches)."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "-c", "-o", "--exclude-standard"],
                             check=True, capture_output=True).stdout
        files = [f for f in out.decode().split("\0") if f]
        return sorted({f for f in files if os.path.isfile(os.path.join(root, f))})
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "__pycache__", ".hypothesis", ".pytest_cache", "build"}
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in skip and not x.endswith(".egg-info")]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names]
        return sorted(files)


def copy_repo(files, dest: str, rev: str | None = None) -> None:
    """Copy the working tree's `files` to dest, or (with rev) the tree of commit `rev`."""
    if rev:
        os.makedirs(dest, exist_ok=True)
        tar = subprocess.run(["git", "-C", ROOT, "archive", "--format=tar", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=tar, check=True)
        return
    for f in files:
        target = os.path.join(dest, f)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), target)


def apply(m: Mutation, dest: str) -> None:
    path = os.path.join(dest, m.path)
    with open(path) as fh:
        text = fh.read()
    n = text.count(m.old)
    if n != 1:
        raise SystemExit(f"mutation {m.name!r}: old string occurs {n} times in {m.path} (must be exactly once)")
    with open(path, "w") as fh:
        fh.write(text.replace(m.old, m.new))


FAIL_RE = re.compile(r"^(?:FAILED|ERROR) (.+?)(?: - .*)?$", re.M)  # node ids may contain spaces


def run_tests(dest: str, tests, extra, timeout: float):
    """(failed, first failing test id or note, seconds, output)."""
    env = dict(os.environ, PYTHONPATH=dest, HYPOTHESIS_PROFILE="ci", PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "2", "-rfE",
           *extra, *tests]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=dest, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return True, f"(timeout after {timeout:.0f} s)", time.monotonic() - t0, out
    out = p.stdout + p.stderr
    m = FAIL_RE.search(out)
    first = m.group(1).strip() if m else ("" if p.returncode == 0 else f"(exit {p.returncode}, no test id)")
    return p.returncode != 0, first, time.monotonic() - t0, out


def check_imports_from_copy(dest: str) -> None:
    env = dict(os.environ, PYTHONPATH=dest)
    got = subprocess.run([sys.executable, "-c", "import reorder, spec; print(reorder.__file__); print(spec.__file__)"],
                         cwd=dest, env=env, capture_output=True, text=True, check=True).stdout.split()
    real = os.path.realpath(dest)
    if not all(os.path.realpath(x).startswith(real + os.sep) for x in got):
        raise SystemExit(f"reorder/spec import from {got}, not from the copy {dest}: fix PYTHONPATH / installs")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", action="append", default=[], help="only mutations whose name contains this")
    ap.add_argument("--list", action="store_true", help="list the mutations and exit")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per pytest run (default 240)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--rev", help="test the tree of this git commit (e.g. HEAD) instead of the working tree")
    ap.add_argument("--tests", nargs="+", help="override the test files of every mutation")
    ap.add_argument("-v", "--verbose", action="store_true", help="print pytest output of survivors/timeouts")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest args (after --)")
    args = ap.parse_args(argv)
    muts = [m for m in MUTATIONS if not args.k or any(k in m.name for k in args.k)]
    if args.list:
        for m in muts:
            print(f"{m.name}: {m.path}")
        return 0
    files = None if args.rev else repo_files(ROOT)
    t_all = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="reorder-mutants-") as tmp:
        # every mutation must apply cleanly before anything runs
        for i, m in enumerate(muts):
            dest = os.path.join(tmp, f"m{i}")
            copy_repo(files, dest, args.rev)
            apply(m, dest)
        if not args.no_baseline:
            base = os.path.join(tmp, "base")
            copy_repo(files, base, args.rev)
            check_imports_from_copy(base)
            failed, first, secs, out = run_tests(base, ALL_TESTS, args.pytest_args, args.timeout)
            print(f"baseline (unmutated): {'FAILED ' + first if failed else 'passed'} in {secs:.0f} s", flush=True)
            if failed:
                print(out[-4000:])
                return 2
        rows, survivors = [], []
        for i, m in enumerate(muts):
            dest = os.path.join(tmp, f"m{i}")
            failed, first, secs, out = run_tests(dest, args.tests or m.tests, args.pytest_args, args.timeout)
            caught = "yes" if failed else "**NO**"
            print(f"[{i + 1}/{len(muts)}] {m.name}: {'caught' if failed else 'SURVIVED'} ({secs:.0f} s) {first}",
                  file=sys.stderr, flush=True)
            if not failed:
                survivors.append(m)
            if args.verbose and (not failed or first.startswith("(timeout")):
                print(out[-4000:], file=sys.stderr)
            rows.append((m.name, m.path, caught, f"`{first}`" if first else "-", secs))
    print()
    print("| mutation | file | caught? | first failing test |")
    print("|---|---|---|---|")
    for name, path, caught, first, _ in rows:
        print(f"| {name} | {path} | {caught} | {first} |")
    print()
    print(f"{len(rows) - len(survivors)}/{len(rows)} mutations caught in {time.monotonic() - t_all:.0f} s")
    if survivors:
        print("SURVIVED: " + ", ".join(m.name for m in survivors))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
