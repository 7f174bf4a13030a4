#!/usr/bin/env python3
"""The CUDA-only survivors of the mutation run, judged on a GPU.

mutmut runs the CPU tests; a mutant that changes only what happens with CUDA tensors (a launch, its
device context, pinned staging: `ci/mutation/cuda_only.txt`) survives there. This script judges those
mutants with the GPU checks instead, in two steps:

    python ci/mutation_gpu.py export DIR      here (needs mutmut and mutants/): for every mutant on
                                              cuda_only.txt whose fingerprint still matches, DIR/NAME/
                                              holds its mutated source file and its path (the
                                              check is the one CHECKS names for that path at judging)
    python ci/mutation_gpu.py judge DIR OUT.txt [--jobs 8] [--timeout 240]
                                              on the GPU host (no mutmut needed): the unmutated tree
                                              must pass every check; then, per mutant, a copy of the
                                              tree with its file replaced runs its check; a check
                                              that fails or times out kills it. OUT.txt gets one
                                              line per killed mutant: NAME FINGERPRINT check;
                                              OUT.jsonl every verdict as it comes, with the output

`ci/mutation/gpu_killed.txt` is such an output: the summary (`ci/mutation_sample.py summary`) counts
a CUDA-only survivor on it, with the same fingerprint, as killed on the GPU (`gpu_killed`).

The check of a mutant is the GPU script that reaches its file: the checksum kernel's check for
`reorder/batch/checksum.py`, counting and describing micro-batches on the device, the host or split
between them (`batch_cuda.py`) for `layout.py` and `counting.py` (in the first GPU judging, the dp-1
exchange `dp1_cuda.py` killed none of their 16).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECKS = {  # mutated file -> the GPU check that reaches it (run from the tree's root)
    "reorder/batch/checksum.py": "functional_tests/checksum_cuda.py --windows 40",
    "reorder/batch/counting.py": "functional_tests/batch_cuda.py",
    "reorder/batch/layout.py": "functional_tests/batch_cuda.py",
}
TREE = ("reorder", "functional_tests", "bench", "spec", "support")  # what a check imports


def export(out: Path) -> int:
    sys.path.insert(0, str(ROOT / "ci"))
    import mutation_sample as ms
    from mutmut.mutation.diff_apply import apply_mutant, find_mutant

    ms.in_root()
    ms.generate()
    out.mkdir(parents=True, exist_ok=True)
    listed = ms.read_list(ms.OUT / "cuda_only.txt")
    n = 0
    for name, (want, _) in sorted(listed.items()):
        fp = ms.fingerprint(ms.diff_of(name))
        if fp != want:
            print(f"{name}: stale entry (fingerprint {fp}, listed {want}); not exported")
            continue
        path = str(find_mutant(name).path)
        path = path[path.index("reorder/"):]
        plain = (ROOT / path).read_text()
        try:
            apply_mutant(name)  # writes the mutant into the source file: read it, then put it back
            mutated = (ROOT / path).read_text()
        finally:
            (ROOT / path).write_text(plain)
        d = out / name
        d.mkdir(exist_ok=True)
        (d / "source.py").write_text(mutated)
        (d / "mutant.json").write_text(json.dumps({"name": name, "fingerprint": fp, "path": path}) + "\n")
        n += 1
    print(f"exported {n} of {len(listed)} CUDA-only mutants to {out}")
    return 0


def run_check(tree: Path, check: str, timeout: float) -> tuple:
    """(passed, seconds, tail of the output) of `check` run in `tree`."""
    t0 = time.time()
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        p = subprocess.run([sys.executable, *check.split()], cwd=tree, env=env, capture_output=True,
                           text=True, timeout=timeout)
        return p.returncode == 0, time.time() - t0, (p.stdout + p.stderr)[-600:]
    except subprocess.TimeoutExpired:
        return False, time.time() - t0, "timeout"


def judge_one(mutant_dir: Path, scratch: Path, timeout: float) -> dict:
    m = json.loads((mutant_dir / "mutant.json").read_text())
    m["check"] = CHECKS[m["path"]]  # the check that reaches the file now, not when it was exported
    tree = scratch / m["name"]
    for top in TREE:
        shutil.copytree(ROOT / top, tree / top, ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(mutant_dir / "source.py", tree / m["path"])
    passed, seconds, tail = run_check(tree, m["check"], timeout)
    shutil.rmtree(tree, ignore_errors=True)
    return {**m, "killed": not passed, "seconds": round(seconds, 1), "tail": tail}


def judge(src: Path, out: Path, jobs: int, timeout: float) -> int:
    dirs = sorted(d for d in src.iterdir() if (d / "mutant.json").exists())
    for check in sorted({CHECKS[json.loads((d / "mutant.json").read_text())["path"]] for d in dirs}):
        passed, seconds, tail = run_check(ROOT, check, timeout)  # an unmutated tree that fails judges nothing
        print(f"unmutated: {check}: {'pass' if passed else 'FAIL'} ({seconds:.0f} s)", flush=True)
        if not passed:
            print(tail)
            return 2
    scratch = Path(tempfile.mkdtemp(prefix="gpu-mutants-"))
    results = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool, open(out.with_suffix(".jsonl"), "w") as log:
        for r in pool.map(lambda d: judge_one(d, scratch, timeout), dirs):  # each verdict as it comes
            results.append(r)
            log.write(json.dumps(r) + "\n")
            log.flush()
    killed = [r for r in results if r["killed"]]
    with open(out, "w") as f:
        f.write(f"# CUDA-only survivors killed on a GPU (ci/mutation_gpu.py): NAME FINGERPRINT check. "
                f"{len(killed)} of {len(results)} killed.\n")
        for r in killed:
            f.write(f"{r['name']} {r['fingerprint']} {r['check'].split()[0]}\n")
    for r in results:
        print(f"{'killed  ' if r['killed'] else 'SURVIVED'} {r['name']} ({r['seconds']} s)")
    print(f"{len(killed)} of {len(results)} CUDA-only mutants killed on the GPU")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("export")
    e.add_argument("dir", type=Path)
    j = sub.add_parser("judge")
    j.add_argument("dir", type=Path)
    j.add_argument("out", type=Path)
    j.add_argument("--jobs", type=int, default=8)
    j.add_argument("--timeout", type=float, default=240)
    a = p.parse_args(argv)
    return export(a.dir) if a.cmd == "export" else judge(a.dir, a.out, a.jobs, a.timeout)


if __name__ == "__main__":
    sys.exit(main())
