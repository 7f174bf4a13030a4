"""Gloo multi-process functional suite (fork start): heterogeneous worlds, W 1-3, overlap on/off,
and fault cases where every rank of the DP group must raise together (bounded by timeouts); one
fault under torchrun, the real launcher."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import faults

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "functional_tests"))
import gloo_suite  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

LAYOUTS = [(2, 4, 8), (1, 2, 4), (2, 3, 12)]  # vision dp, language dp, B


@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"v{x[0]}l{x[1]}")
def test_heterogeneous_world(layout, overlap, window):
    dv, dl, b = layout
    argv = ["--vision-dp", str(dv), "--language-dp", str(dl), "--micro-batch", str(b), "--window", str(window),
            overlap, "--micro-batches", "5"]
    result = gloo_suite.launch(argv, dv + dl)
    assert result["case"] == "ok" and result["micro_batches"] == 5


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"v{x[0]}l{x[1]}")
def test_overlap_meeting_before_each_all_to_all(layout):
    """The overlap pair's meeting on Gloo right before each all_to_all (on by itself for NCCL payloads;
    forced here), in real processes: every window arrives, checked, and the worker ends."""
    dv, dl, b = layout
    argv = ["--vision-dp", str(dv), "--language-dp", str(dl), "--micro-batch", str(b), "--window", "2",
            "--overlap", "--launch-rendezvous", "--micro-batches", "5"]
    result = gloo_suite.launch(argv, dv + dl)
    assert result["case"] == "ok" and result["micro_batches"] == 5


@pytest.mark.parametrize("window,verify", [(1, 1), (2, 2)])
def test_self_check_in_a_heterogeneous_world(window, verify):
    """The runtime self-check on every `verify`-th window of both modules, in real processes with
    overlap: no false alarm, every rank verified windows (the suite refuses a run where some rank
    verified none), at most one a checked window."""
    result = gloo_suite.launch(["--vision-dp", "2", "--language-dp", "4", "--micro-batch", "8", "--window", str(window),
                                "--verify", str(verify), "--micro-batches", "7"], 6)
    assert result["case"] == "ok" and result["micro_batches"] == 7
    checked = len(range(0, -(-7 // window), verify))
    assert len(result["verified_windows"]) == 6 and all(0 < n <= checked for n in result["verified_windows"])


@pytest.mark.parametrize("layout", [(2, 4, 8), (1, 2, 4), (2, 2, 8)], ids=lambda x: f"v{x[0]}l{x[1]}")
def test_bridge_sends_each_language_rank_its_own_samples(layout):
    """--bridge: vision ranks send their samples' ids point-to-point to the language ranks they feed, by
    position, after every micro-batch; every language rank receives exactly the samples it holds."""
    dv, dl, b = layout
    result = gloo_suite.launch(["--vision-dp", str(dv), "--language-dp", str(dl), "--micro-batch", str(b),
                                "--bridge", "--micro-batches", "4", "--timeout", "20"], dv + dl)
    assert result["case"] == "ok" and result["micro_batches"] == 4


def test_language_cost_weight_world():
    result = gloo_suite.launch(["--vision-dp", "2", "--language-dp", "4", "--language-weight", "0.5"], 6)
    assert result["micro_batches"] == 7


def _reports(directory) -> dict:
    """global rank -> what that rank saw (gloo_suite --report-dir)."""
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in Path(directory).glob("rank*.json"))}


def _named(who: str, report: dict) -> bool:
    module, _, rank = who.partition(" rank ")
    return report["module"] == module and (not rank or report["dp_rank"] == int(rank))


def _check_ranks(case, reports: dict, *, same_error: bool, micro_batches: int = 7):
    """Every reporting rank is named by exactly one Seen of the record and sees what it says; with
    `same_error`, the ranks of one Seen raised the very same error."""
    for rep in reports.values():
        assert len([s for s in case.sees if _named(s.who, rep)]) == 1, (rep, case.sees)
    for seen in case.sees:
        ranks = [rep for rep in reports.values() if _named(seen.who, rep)]
        assert ranks or seen.who == "torchrun", f"{seen.who}: no rank reported"
        for rep in ranks:
            seen.check(rep["error"])
            if seen.error is None:
                assert rep["n"] == micro_batches, rep
        if same_error and seen.error is not None:
            assert len({rep["error"] for rep in ranks}) == 1, ranks


@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
@pytest.mark.parametrize("case", faults.cases("gloo"), ids=faults.name)
def test_faults_raise_on_every_rank(case, overlap, tmp_path):
    """The forked Gloo fault cases of tests/faults.py: what every rank of both modules sees."""
    p = case.params
    result = gloo_suite.launch([*p["argv"], overlap, "--report-dir", str(tmp_path)], p["world"])
    assert result["case"] == p["argv"][p["argv"].index("--case") + 1]
    reports = _reports(tmp_path)
    assert sorted(set(range(p["world"])) - set(reports)) == p.get("dead", [])  # every other rank reported
    _check_ranks(case, reports, same_error=True)
    for who, n in p.get("served", {}).items():
        served = [rep["n"] for rep in reports.values() if _named(who, rep)]
        assert served and set(served) == {n}, reports
    if "errors" in result:  # rank 0's view of the faulty module: one error on every rank, a ReorderError
        assert len(result["errors"]) == 1
        next(s for s in case.sees if s.error == "ReorderError").check(result["errors"][0])


def test_a_rank_reports_before_its_buffer_closes(tmp_path, monkeypatch):
    """Every rank's report is on disk before its buffer's close begins: close joins the overlap
    worker, which can take a while (a worker in a collective whose peers are gone), and under
    torchrun the launcher's SIGTERM may end the rank in that wait (the fault record's "language: no
    rank reported" under load). Each forked rank's close notes whether its report was there."""
    from reorder.runtime import buffer

    def close(self, timeout=30.0):
        rank = torch.distributed.get_rank()
        (tmp_path / f"closed{rank}").write_text(str((tmp_path / f"rank{rank}.json").exists()))
        return opened(self, timeout)

    opened = buffer.ReorderingBuffer.close
    monkeypatch.setattr(buffer.ReorderingBuffer, "close", close)  # the forked ranks inherit it
    result = gloo_suite.launch(["--vision-dp", "1", "--language-dp", "2", "--micro-batch", "4", "--micro-batches", "3",
                                "--report-dir", str(tmp_path)], 3)
    assert result["case"] == "ok"
    assert {p.name: p.read_text() for p in tmp_path.glob("closed*")} == {f"closed{r}": "True" for r in range(3)}


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _group_members(pgid: int) -> list:
    """Live processes of process group `pgid`."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(name))
    return out


@pytest.mark.parametrize("case", faults.cases("torchrun"), ids=faults.name)
def test_fault_under_torchrun(case, tmp_path):
    """torchrun --standalone runs gloo_suite with one vision rank's bad input, errors uncaught (as in a
    training script) and the vision -> language bridge after every micro-batch. The whole job ends
    with a non-zero exit within 60 s, the failing ranks print the ReorderError, every rank sees what
    the record says, torchrun's summary names the ReorderError as the root cause, and no process of
    the job is left (torchrun's process group; the workers, which each start a process group of their own)."""
    p = case.params
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(p["nproc"]),
           "--tee", "3", "functional_tests/gloo_suite.py", *p["argv"], "--report-dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    try:
        out, _ = job.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
    elapsed = time.monotonic() - t0
    workers = {int(r): int(pid) for r, pid in re.findall(r"gloo_suite rank (\d+) pid (\d+)", out)}
    left = sorted({*_group_members(job.pid), *(pid for pid in workers.values() if _alive(pid))})
    for pid in left:  # never leave them behind, even when the test fails
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert elapsed < 60 and job.returncode not in (0, None), f"exit {job.returncode} after {elapsed:.1f} s:\n{out}"
    assert not left, f"processes of the job left behind: {left}"
    assert sorted(workers) == list(range(p["nproc"])), f"workers started: {workers}\n{out}"

    summary = out.rpartition("ChildFailedError:")[2]
    exits = {int(r): int(code) for r, code in
             re.findall(r"rank\s*: (\d+) \(local_rank: \d+\)\s*exitcode\s*: (-?\d+)", summary)}
    assert sorted(exits) == list(range(p["nproc"])), f"torchrun's summary lists ranks {sorted(exits)}:\n{out}"
    reports = _reports(tmp_path)
    for rank in set(range(p["nproc"])) - set(reports):  # only where torchrun may end a rank before it reports
        module = "vision" if rank < int(p["argv"][p["argv"].index("--vision-dp") + 1]) else "language"
        assert module in p.get("sigterm_ok", ()) and exits[rank] == -signal.SIGTERM, \
            f"rank {rank} ({module}) did not report, exit {exits[rank]}:\n{out}"
    _check_ranks(case, reports, same_error=False)
    for rank, rep in reports.items():  # the failing ranks print their error
        seen = next(s for s in case.sees if _named(s.who, rep))
        if seen.error == "ReorderError":
            printed = [line for line in out.splitlines() if line.startswith(f"[default{rank}]:") and
                       f"{seen.error}: " in line]
            assert printed and all(t in printed[-1] for t in seen.texts), f"rank {rank} printed {printed}:\n{out}"
    job_seen = case.seen("torchrun")
    job_seen.check(f"ChildFailedError: {summary}")
    assert "ReorderError" in summary.partition("Root Cause")[2], summary


@pytest.mark.parametrize("layout", [(0, 4, 8, 4), (0, 8, 8, 2), (4, 4, 8, 4)], ids=lambda x: f"v{x[0]}l{x[1]}w{x[3]}")
def test_larger_layouts_on_gloo(layout):
    """Layouts of 4-8 GPUs (one module at dp 4 or dp 8, vision dp 4 + language dp 4), on Gloo."""
    dv, dl, b, w = layout
    result = gloo_suite.launch(["--vision-dp", str(dv), "--language-dp", str(dl), "--micro-batch", str(b),
                                "--window", str(w), "--micro-batches", "6"], dv + dl)
    assert result["micro_batches"] == 6


def test_dp1_script_checks_bytes_on_cpu():
    """functional_tests/dp1_cuda.py (run on a GPU by ci/gpu.sh) passes on CPU at toy sizes."""
    import subprocess
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, str(root / "functional_tests" / "dp1_cuda.py"), "--device", "cpu",
                          "--features", "8", "--seq-len", "256", "--reps", "2"], cwd=root, capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(root)})
    assert res.returncode == 0 and "'ok': True" in res.stdout and "'checked': 32" in res.stdout, res.stdout + res.stderr
