"""The GPU benchmarks run end to end on CPU/Gloo at toy sizes (2 real processes) and write the JSON
keys the GPU figures are read from, so they cannot rot between GPU runs. No figure here is a performance result."""

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import expecttest
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _torchrun(script, args, out, timeout=240, nproc=2):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           str(ROOT / "bench" / script), *args, "--json", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("script,args,keys", [
    ("exchange_gpu.py", ["--seq-len", "256", "--features", "8", "--mix", "small", "--matmul", "128",
                         "--compute-ms", "5", "--reps", "2", "--per-rank", "4", "--windows", "1", "2"],
     ["exchange_over_a2a", "exchange_fixed_ms", "overlap_exposed_fraction", "dp1_perm_ms_mb4"]),
    ("e2e_vision.py", ["--dim", "32", "--layers", "1", "--mix", "small", "--steps", "4", "--warmup", "1",
                       "--rounds", "1"],
     ["gain_over_ideal", "mean_gain", "p90_gain"]),
], ids=["exchange_gpu", "e2e_vision"])
def test_benchmark_writes_the_issue_keys(tmp_path, script, args, keys):
    result = _torchrun(script, args, tmp_path / "out.json")
    assert result["device"] == "cpu x2"
    for k in keys:
        assert isinstance(result[k], float) and math.isfinite(result[k]), (k, result.get(k))
    if script == "e2e_vision.py":  # paired step differences: every timed step once, gated + moved = all
        for mode in ("sync", "sync+gate", "sync+gate+backoff", "overlap", "overlap+gate", "overlap+gate+backoff"):
            d = result["paired"][mode]
            assert d["all"]["n"] == 4 and math.isfinite(d["all"]["mean_ms"])
            if "+gate" in mode:
                assert d["gated"]["n"] + d["moved"]["n"] == 4


def test_the_exchange_benchmark_runs_beyond_two_ranks(tmp_path):
    """Its bare all_to_all paired peers as at dp 2 (rank 1 - me): at 3 ranks the split sizes did not
    pair up and NCCL aborted."""
    result = _torchrun("exchange_gpu.py", ["--seq-len", "128", "--features", "8", "--mix", "small", "--matmul", "64",
                                           "--compute-ms", "2", "--reps", "2", "--per-rank", "4", "--windows", "1"],
                       tmp_path / "out.json", nproc=3)
    assert result["device"] == "cpu x3" and math.isfinite(result["exchange_over_a2a"])


@pytest.mark.parametrize("gated", [False, True], ids=["moving", "gated"])
def test_exchange_host_bench_replays_a_real_exchange(tmp_path, gated):
    """bench/exchange_host.py times rank 0's host work with the collectives' recorded results: the
    replayed window moves samples (or, gated, moves none) and the stages it reports add up."""
    out = tmp_path / "host.json"
    args = [sys.executable, str(ROOT / "bench" / "exchange_host.py"), "--reps", "5", "--json", str(out)]
    res = subprocess.run(args + (["--min-saving", "1e18"] if gated else []), cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert (r["moved_samples"] == 0) == gated
    assert set(r["stage_us"]) == {"prepare", "gather", "plan", "pack", "all_to_all", "assemble"}
    assert 0 < sum(r["stage_us"].values()) <= 1.5 * r["exchange_us"]
    assert r["aten_ops"] > 0 and ("copy_" in r["ops_by_kind"]) != gated  # a gated window copies no payload


def test_launch_bound_bench_times_every_mode(tmp_path):
    """bench/launch_bound.py: every mode streams all micro-batches and gets a finite time per step."""
    out = tmp_path / "lb.json"
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "launch_bound.py"), "--steps", "12", "--rounds", "2",
                          "--ops", "20", "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == ["off", "sync", "sync+gate", "sync+gate+backoff", "overlap", "overlap+gate",
                           "overlap+gate+backoff"]
    assert all(math.isfinite(m["ms_per_step"]) and m["ms_per_step"] > 0 for m in modes.values())
    for m in modes.values():  # two rounds pair every mode with off twice: an interval around the mean
        lo, hi = m["paired_ci95_ms"]
        assert lo <= m["paired_mean_ms"] <= hi
    best = json.loads(out.read_text())["best"]
    assert best["mode"] == min(list(modes)[1:], key=lambda k: modes[k]["paired_mean_ms"])
    assert best["slower_beyond_noise"] == (best["paired_ci95_ms"][0] > 0)


def test_bootstrap_interval_brackets_the_mean_and_narrows_with_more_figures():
    sys.path.insert(0, str(ROOT))
    from bench.launch_bound import bootstrap_interval

    rng = np.random.default_rng(1)
    few, many = rng.normal(1.0, 1.0, 8), rng.normal(1.0, 1.0, 800)
    (lo_f, hi_f), (lo_m, hi_m) = bootstrap_interval(few, 2000), bootstrap_interval(many, 2000)
    assert lo_f < few.mean() < hi_f and lo_m < many.mean() < hi_m
    assert hi_m - lo_m < (hi_f - lo_f) / 3  # a hundred times the figures: about a tenth the width
    assert bootstrap_interval([3.0, 3.0, 3.0], 100) == [3.0, 3.0]
    assert all(math.isnan(x) for x in bootstrap_interval([1.0], 100))


@pytest.mark.parametrize("script,args,keys", [
    ("single_gpu.py", ["--plan-sizes", "64x8"],
     ["dp1_exchange_ms", "dp1_perm_ms_mb4", "host_ms_per_window", "plan_ms_64x8", "plan_ms_lpt_64x8",
      "moves_ms_64x8"]),
    ("host_parts.py", ["--no-copies"], ["window", "count", "describe", "plan", "moves", "outputs", "executor_run"]),
], ids=["single_gpu", "host_parts"])
def test_single_gpu_benchmarks_write_their_keys(tmp_path, script, args, keys):
    """The one-GPU benchmarks run on CPU at toy sizes and write the keys their GPU figures come from."""
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(ROOT / "bench" / script), "--device", "cpu", "--features", "8", "--reps", "3",
           *args, "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    result = json.loads(out.read_text())
    for k in keys:
        assert isinstance(result[k], float) and math.isfinite(result[k]) and result[k] > 0, (k, result.get(k))
    if script == "single_gpu.py":
        assert result["executor"] == "torch" and result["ops_per_window"] > 0
        quality = result["plan_quality"]  # what each balancer's planning time buys, at every size
        assert sorted(quality) == ["balanced", "lpt"] and all(list(q) == ["64x8"] for q in quality.values())
        for q in (quality["balanced"]["64x8"], quality["lpt"]["64x8"]):
            assert q["max_over_mean"] >= 1 and 0 <= q["moved"] <= 1
        assert quality["balanced"]["64x8"]["max_over_mean"] <= quality["lpt"]["64x8"]["max_over_mean"]
    else:
        assert result["executor"] == "none" and result["segments"] > 0
        window, parts = result["calls"]["window"], result["calls"]
        for lib in ("python", "numpy", "torch"):  # a window runs every part (no copies: no executor calls)
            assert window[lib] >= sum(parts[k][lib] for k in ("prepare", "plan", "moves", "outputs")) > 0, lib
        sizes = result["by_window_size"]  # windows of 1, 2, 4, 8 micro-batches: more lines per larger window
        assert list(sizes) == ["1", "2", "4", "8"]
        lines = [sizes[w]["lines_per_window"] for w in sizes]
        assert lines == sorted(set(lines)) and lines[0] > 0
        assert all(math.isclose(r["us_per_micro_batch"] * int(w), r["us_per_window"]) for w, r in sizes.items())


def test_calls_counts_what_a_function_runs():
    """bench/host_parts.calls: Python lines and calls, and C calls by library, below one call (the
    function itself and the profiler's own switch-off not included)."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import torch

    from bench.host_parts import calls

    def inner(a):
        b = np.add.reduce(a)  # one numpy C call
        return b + len(a)  # one builtin

    def work():
        a = np.arange(4)  # numpy
        torch.zeros(2)  # torch
        return inner(a) + inner(a)  # two Python calls

    assert calls(work) == {"lines": 4, "python": 2, "numpy": 3, "torch": 1, "other": 2}


def test_results_name_the_commit_measured(monkeypatch, tmp_path):
    """A results file records $REORDER_COMMIT when given, else the checkout's HEAD, marked
    "+changes" when a tracked file differs from it (a copy of the tree elsewhere whose .git is
    stale); files git does not track change nothing."""
    sys.path.insert(0, str(ROOT))
    from bench.common import code_commit

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              capture_output=True, text=True, check=True).stdout.strip()

    monkeypatch.delenv("REORDER_COMMIT", raising=False)
    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("commit", "-qm", "one")
    head = git("rev-parse", "--short", "HEAD")
    (tmp_path / "results.json").write_text("{}")
    assert code_commit(str(tmp_path)) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert code_commit(str(tmp_path)) == head + "+changes"
    monkeypatch.setenv("REORDER_COMMIT", "0123abc")
    assert code_commit(str(tmp_path)) == "0123abc"
    monkeypatch.delenv("REORDER_COMMIT")
    assert code_commit().split("+")[0] == subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                         capture_output=True, text=True).stdout.strip()


@pytest.mark.parametrize("gpus,want", [(1, [0, 0, 0, 0]), (2, [0, 1, 0, 1]), (4, [0, 1, 2, 3])])
def test_ranks_beyond_the_gpu_count_share_them_each_with_its_own_nccl_host_id(monkeypatch, capsys, gpus, want):
    """bench.common.rank_device: rank r on GPU r mod count; one NCCL host id per local rank exactly
    when ranks outnumber GPUs (NCCL refuses two ranks of one host on one GPU), said in the output."""
    from bench import common

    monkeypatch.setattr(common.torch.cuda, "device_count", lambda: gpus)
    devices, ids = [], []
    for r in range(4):
        monkeypatch.delenv("NCCL_HOSTID", raising=False)
        monkeypatch.setenv("LOCAL_RANK", str(r))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        devices.append(common.rank_device(True))
        ids.append(os.environ.get("NCCL_HOSTID"))
    assert devices == [common.torch.device("cuda", i) for i in want]
    shared = gpus < 4
    assert (len(set(ids)) == 4 and None not in ids) if shared else ids == [None] * 4
    assert ("shared-GPU mode" in capsys.readouterr().out) == shared
    assert common.rank_device(False) == common.torch.device("cpu")


def test_small_window_planning_bench_writes_its_shares_and_counts(tmp_path):
    """bench/plan_small.py at two sizes: every time positive, phase shares within [0, 1], and the
    call counts (the same on every host) larger for the larger window."""
    out = tmp_path / "plan_small.json"
    cmd = [sys.executable, str(ROOT / "bench" / "plan_small.py"), "--sizes", "4x2,16x4", "--reps", "20",
           "--out", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    sizes = json.loads(out.read_text())["sizes"]
    assert list(sizes) == ["4x2", "16x4"]
    for r in sizes.values():
        assert all(r[k] > 0 for k in ("plan_window_ms", "balanced_ms", "lpt_ms"))
        assert all(0 <= v <= 1 for v in r["balanced_phase_share"].values())
    assert sizes["16x4"]["balanced_calls"]["python"] > sizes["4x2"]["balanced_calls"]["python"] > 0


def test_calibration_bench_on_the_vit_writes_fit_plans_and_gains(tmp_path):
    """bench/calibrate_vit.py at toy size on the CPU: a fit over every rank's rows, the three plans
    each with measured and predicted figures, and both gains (CPU times: no figure is a result)."""
    out = tmp_path / "calibrate_vit.json"
    cmd = [sys.executable, str(ROOT / "bench" / "calibrate_vit.py"), "--device", "cpu", "--dp", "2",
           "--per-rank", "2", "--fit-windows", "5", "--eval-windows", "2", "--scale", "0.05", "--dim", "32",
           "--layers", "1", "--warmup", "1", "--json", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240,
                         env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["fit"]["rows"] == 5 * 2 and all(w >= 0 for w in r["fit"]["weights"].values())
    assert list(r["plans"]) == ["natural", "default cost", "fitted cost"]
    for plan in r["plans"].values():
        for kind in ("measured", "predicted"):
            assert plan[kind]["spread"] >= 1 and plan[kind]["step_ms"] > 0
    assert set(r["gain_fitted_over_default"]) == {"predicted", "measured"}


def _verify_cost(tmp_path, *args) -> dict:
    """bench/verify_cost.py at toy size on the CPU with `args`; its JSON rows."""
    out = tmp_path / "verify.json"
    cmd = [sys.executable, str(ROOT / "bench" / "verify_cost.py"), "--device", "cpu", "--micro-batch", "8",
           "--seq-len", "256", "--features", "8", "--mix", "small", "--windows", "3", "--warmup", "1", *args,
           "--json", str(out)]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(out.read_text())


def test_verify_cost_bench_times_every_setting_and_path(tmp_path):
    """bench/verify_cost.py at toy size on the CPU, both checksum paths: a row per setting and path
    (off once), finite host times, the kernel never launched off CUDA, every checked window summed."""
    got = _verify_cost(tmp_path, "--paths", "kernel,torch")
    assert got["inputs"] == "host"
    rows = got["settings"]
    assert list(rows) == ["off", "every 100th (kernel)", "every 100th (torch)", "every window (kernel)",
                          "every window (torch)"]
    assert all(math.isfinite(r["host_ms"]) and r["host_ms"] > 0 and r["device_ms"] is None for r in rows.values())
    assert all(r["kernel_calls"] == 0 for r in rows.values())
    assert rows["off"]["checksum_calls"] == 0 and rows["every window (torch)"]["checksum_calls"] >= 4
    # the check's host parts: none for off; every checked window sums both sides (on the host nothing
    # is read in place from pinned memory: one call a window, after the assembly)
    assert rows["off"]["host_us_by_part"] is None
    every = rows["every window (torch)"]["host_us_by_part"]
    assert every["the other sums + copy"] > 0 and every["comparison"] > 0 and every["held sources' sums"] >= 0


def test_verify_step_cost_bench_times_training_steps_with_and_without_the_check(tmp_path):
    """bench/verify_step_cost.py at toy size on the CPU: the four rows (overlap off and on, the check
    off and every window), each timed over its blocks, ratios against its own overlap's row without
    the check, and every checked row verified the windows it served (none when off)."""
    out = tmp_path / "step.json"
    cmd = [sys.executable, str(ROOT / "bench" / "verify_step_cost.py"), "--device", "cpu", "--micro-batch", "8",
           "--seq-len", "256", "--features", "8", "--mix", "small", "--matmul", "64", "--step-ms", "1",
           "--steps", "4", "--blocks", "2", "--window", "2", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())["settings"]
    assert list(rows) == ["overlap off, check off", "overlap off, every window", "overlap on, check off",
                          "overlap on, every window"]
    for r in rows.values():
        assert len(r["blocks_ms"]) == 2 and all(math.isfinite(x) and x > 0 for x in r["blocks_ms"])
        assert r["ratio"] == pytest.approx(r["step_ms"] / rows[f"overlap {'on' if r['overlap'] else 'off'}, "
                                                                 "check off"]["step_ms"])
        # 3 blocks of 4 steps: 6 windows of 2 served (the overlap thread prepares one more); a window
        # that moves nothing holds nothing to check, the others are compared at the next window
        assert 0 < r["verified_windows"] <= 7 if r["verify"] else r["verified_windows"] == 0
        assert r["early_copy"] is False
    res = subprocess.run(cmd[:-2] + ["--steps", "3"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "--steps 3: expected a multiple of --window 2" in res.stderr
    # --early-copy: every row's exchanger copies the micro-batches as it counts them, the check still verifies
    res = subprocess.run(cmd + ["--early-copy"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["early_copy"] is True and "copied early" in res.stdout
    assert all(r["early_copy"] is True and (r["verified_windows"] > 0) == bool(r["verify"])
               for r in got["settings"].values())


def test_verify_cost_bench_sums_every_micro_batch_of_a_wider_window(tmp_path):
    """--window 3: every checksum call sums the 3 micro-batches of its window twice (as read and as
    assembled: on the host, one call a window), but a micro-batch kept as it is once (what it hands out
    is what it read); a window past 8 micro-batches is refused by name."""
    out = tmp_path / "verify.json"
    cmd = [sys.executable, str(ROOT / "bench" / "verify_cost.py"), "--device", "cpu", "--micro-batch", "8",
           "--seq-len", "256", "--features", "8", "--mix", "small", "--windows", "3", "--warmup", "1",
           "--window", "3", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["window"] == 3
    every = got["settings"]["every window"]
    assert every["checksum_calls"] >= 3
    assert every["checksum_samples"] == (every["checksum_calls"] * 2 * 3 - every["kept_slots"]) * 8
    res = subprocess.run(cmd[:-2] + ["--window", "9"], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 2 and "--window 9: expected 1 to 8 micro-batches" in res.stderr


def test_verify_cost_bench_ablate_leaves_out_one_part_of_the_check_a_row(tmp_path):
    """--ablate: every-window rows without the comparison, without the read-back (and so the
    comparison), without the launch (zeros summed, still read back and compared), and with the
    assembled outputs alone summed (one call a window, its micro-batches once, nothing read back)."""
    got = _verify_cost(tmp_path, "--ablate")
    rows = got["settings"]
    assert list(rows)[3:] == ["every window, no comparison", "every window, no read-back", "every window, no launch",
                              "every window, assembled only"]
    parts = {name: r["host_us_by_part"] for name, r in rows.items() if r["verify"]}
    assert parts["every window"]["comparison"] > 0 and parts["every window"]["read-back"] > 0
    assert parts["every window, no comparison"]["comparison"] == 0 and parts["every window, no comparison"]["read-back"] > 0
    assert parts["every window, no read-back"]["comparison"] == 0 and parts["every window, no read-back"]["read-back"] == 0
    assert parts["every window, no launch"]["comparison"] > 0
    assert rows["every window, no launch"]["checksum_calls"] >= 3 and rows["every window, no launch"]["checksum_samples"] > 0
    assembled = rows["every window, assembled only"]
    assert parts["every window, assembled only"]["comparison"] == 0 and parts["every window, assembled only"]["read-back"] == 0
    assert assembled["checksum_samples"] == assembled["checksum_calls"] * got["window"] * got["micro_batch"]
    assert assembled["checksum_calls"] == rows["every window"]["checksum_calls"]
    assert [r["path"] for r in rows.values()] == [None] + ["kernel"] * 4 + ["zeros", "kernel"]


def test_verify_cost_bench_early_sources_sums_the_sources_before_the_executor_reads_them(tmp_path):
    """--early-sources: one more every-window row whose window sums all its sources in a launch of
    their own before the executor's (the sums of the held sources, here every source) and the
    assembled outputs after: two checksum calls a window, the same samples summed, every window
    verified."""
    rows = _verify_cost(tmp_path, "--early-sources")["settings"]
    every, early = rows["every window"], rows["every window, sources early"]
    assert list(rows)[-1] == "every window, sources early" and early["verify"] == 1
    assert early["checksum_calls"] == 2 * every["checksum_calls"]  # the sources' launch, then the outputs'
    assert early["checksum_samples"] == every["checksum_samples"] + 8 * every["kept_slots"]  # kept: read twice
    assert every["verified_windows"] >= 3 and early["verified_windows"] == every["verified_windows"]


def test_verify_cost_bench_refuses_gpu_inputs_without_a_gpu():
    """--inputs pinned / device need a CUDA device: refused by name before anything runs."""
    cmd = [sys.executable, str(ROOT / "bench" / "verify_cost.py"), "--device", "cpu", "--inputs", "device"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 2
    assert "--inputs 'device': expected host (no CUDA device)" in res.stderr


def test_checksum_kernel_bench_refuses_without_cuda_and_takes_the_round_s_parts():
    """bench/checksum_kernel.py times the Triton kernel on CUDA only: elsewhere it stops with a clear
    message (exit status 1); the window it times is what the round gives its launch after the
    assembly, every part a buffer per field."""
    import torch

    sys.path.insert(0, str(ROOT))
    from bench.checksum_kernel import window_parts

    parts, fields = window_parts(torch.device("cpu"), 2)
    assert len(parts) in (2, 3, 4) and all(len(bufs) == len(fields) for bufs, _ in parts)
    assert sum(counts.shape[0] for _, counts in parts) == 16 * len(parts)
    if torch.cuda.is_available():
        return
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "checksum_kernel.py")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 1
    assert res.stderr.strip().splitlines()[-1] == ("bench/checksum_kernel.py times the Triton kernel on a CUDA "
                                                   "device: none is available")


def test_busy_time_is_the_union_of_the_gpu_work_inside_each_range():
    """bench/common.busy_by_range: per marked range, the GPU work clipped to it, overlaps counted
    once, other categories and unmarked ranges ignored."""
    sys.path.insert(0, str(ROOT))
    from bench.common import busy_by_range

    def x(cat, name, ts, dur):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [x("user_annotation", "w: off", 0, 100), x("user_annotation", "w: on", 200, 100),
              x("user_annotation", "other", 0, 1000), x("cpu_op", "aten::copy_", 10, 50),
              x("kernel", "copy", 10, 20), x("gpu_memcpy", "Memcpy HtoD", 20, 20),  # overlap: 10..40 once
              x("kernel", "tail", 90, 30),                                        # clipped at 100: 10
              x("kernel", "copy", 210, 10), x("kernel", "checksum_window", 250, 40), x("gpu_memset", "Memset", 280, 5),
              x("kernel", "between", 150, 20), {"ph": "i", "cat": "kernel", "name": "marker", "ts": 220}]
    got = busy_by_range(events, "w: ")
    assert got == {"off": [(40.0, ["Memcpy HtoD", "copy", "tail"])],
                   "on": [(50.0, ["Memset", "checksum_window", "copy"])]}


def test_verify_cost_bench_refuses_device_busy_without_cuda(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "verify_cost.py"), "--device", "cpu",
                          "--device-busy", "5"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert res.returncode == 2 and "--device-busy 5: needs a CUDA device" in res.stderr


def test_verify_cost_device_busy_profiles_every_row_s_windows():
    """bench/verify_cost.device_busy on the CPU (no GPU work: 0 ms): n windows of each row, each in
    its own profiler range, found again in the exported trace; the checksum paths put back."""
    sys.path.insert(0, str(ROOT))
    import torch

    from bench import verify_cost as vc
    from reorder import CostModel, Grid, WindowExchanger
    from reorder.batch import checksum
    from reorder.cli import synthetic as syn
    from reorder.exchange import round as round_module

    rng = np.random.default_rng(0)
    batch = syn.make_global_batch(rng, 8, 256, features=8, mix="small")
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    ex = {name: WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=8, cost=cost, verify=n)
          for name, n in (("off", 0), ("every window", 1))}
    impl = {name: vc.Path("kernel") for name in ex}
    got = vc.device_busy(ex, impl, lambda k: [batch], 0, 3, torch.device("cpu"))
    assert got == {"off": (0.0, 0), "every window": (0.0, 0)}
    assert impl["off"].calls == 0 and impl["every window"].calls >= 3
    assert round_module.window_checksums is checksum.window_checksums


def _cost_run(folder) -> list:
    """The parsed JSONs of one run of ci/selfcheck_cost.sh in `folder`, as the command reads them."""
    sys.path.insert(0, str(ROOT))
    from bench.verify_cost_table import load_run

    return load_run(folder)


class TestVerifyCostTable(expecttest.TestCase):
    def test_the_readme_table_from_the_committed_jsons(self):
        """bench/verify_cost_table.py over the JSONs of the README's cost table: the README holds
        that table as rendered."""
        sys.path.insert(0, str(ROOT))
        from bench.verify_cost_table import table

        rendered = table(_cost_run(ROOT / "functional_tests/results/selfcheck/h100_e21b621/cost1"))
        self.assertExpectedInline(rendered, """\
| micro-batches | W | off: host / device ms | every window: host, device | every 100th: host, device | off: GPU busy ms | every window: GPU busy |
|---|---:|---:|---:|---:|---:|---:|
| pinned host memory, read in place | 1 | 2.00 / 3.07 | 1.11×, 1.28× | 0.97×, 0.99× | 1.151 | 2.04× |
| pinned host memory, read in place | 4 | 6.05 / 10.29 | 1.07×, 1.37× | 1.02×, 1.00× | 4.405 | 2.03× |
| pinned host memory, read in place | 8 | 10.60 / 19.12 | 1.05×, 1.41× | 1.00×, 1.00× | 8.804 | 2.02× |
| pinned host memory, copied early (`early_copy`) | 1 | 2.61 / 2.65 | 1.07×, 1.08× | 1.00×, 0.99× | 1.123 | 1.07× |
| pinned host memory, copied early (`early_copy`) | 4 | 6.53 / 6.53 | 1.06×, 1.05× | 1.00×, 1.00× | 4.306 | 1.06× |
| pinned host memory, copied early (`early_copy`) | 8 | 12.59 / 12.69 | 1.04×, 1.03× | 1.00×, 1.00× | 8.623 | 1.06× |
| on the GPU | 1 | 1.50 / 1.54 | 1.09×, 1.09× | 0.98×, 0.99× | 0.055 | 2.61× |
| on the GPU | 4 | 4.84 / 5.11 | 1.07×, 1.06× | 1.00×, 1.00× | 0.212 | 2.21× |
| on the GPU | 8 | 9.54 / 9.93 | 1.04×, 1.05× | 0.99×, 0.98× | 0.421 | 2.18× |""")
        self.assertIn(rendered, (ROOT / "README.md").read_text())

    def test_the_readme_spread_over_five_runs(self):
        """The README's spread of the every-window ratios over five runs of the cost table (three on
        one machine, one on a second, one on a third), as rendered from their committed JSONs."""
        sys.path.insert(0, str(ROOT))
        from bench.verify_cost_table import spread

        at = ROOT / "functional_tests/results/selfcheck"
        folders = [at / f"h100_e21b621/cost{k}" for k in (1, 2, 3, 4)] + [at / "h100_9118219/cost5"]
        rendered = spread([_cost_run(f) for f in folders])
        self.assertExpectedInline(rendered, """\
| micro-batches | W | every window: host | every window: device | within both targets |
|---|---:|---:|---:|---:|
| pinned host memory, read in place | 1 | 1.114×–1.165× | 1.235×–1.381× | 0 of 5 |
| pinned host memory, read in place | 4 | 1.055×–1.159× | 1.358×–1.535× | 0 of 5 |
| pinned host memory, read in place | 8 | 1.039×–1.056× | 1.364×–1.565× | 0 of 5 |
| pinned host memory, copied early (`early_copy`) | 1 | 1.071×–1.105× | 1.072×–1.093× | 0 of 5 |
| pinned host memory, copied early (`early_copy`) | 4 | 1.027×–1.061× | 1.038×–1.056× | 3 of 5 |
| pinned host memory, copied early (`early_copy`) | 8 | 1.015×–1.044× | 1.034×–1.057× | 3 of 5 |
| on the GPU | 1 | 1.088×–1.120× | 1.092×–1.109× | 0 of 5 |
| on the GPU | 4 | 1.055×–1.121× | 1.061×–1.091× | 0 of 5 |
| on the GPU | 8 | 1.044×–1.063× | 1.054×–1.110× | 0 of 5 |""")
        self.assertIn(rendered, (ROOT / "README.md").read_text())

    def test_the_spread_counts_a_run_within_both_targets_at_their_edges(self):
        """A run counts when host <= 1.10x and device <= 1.05x, both; just over either does not; the
        range spans every run, and a setting missing from a run is counted over the runs that hold it."""
        sys.path.insert(0, str(ROOT))
        from bench.verify_cost_table import TARGET_DEVICE, TARGET_HOST, spread

        base = json.loads((ROOT / "functional_tests/results/selfcheck/cost_ef733b5/cost_device_w1.json").read_text())
        other = json.loads((ROOT / "functional_tests/results/selfcheck/cost_ef733b5/cost_device_w8.json").read_text())

        def at(host, device):
            run = json.loads(json.dumps(base))
            run["settings"]["every window"].update(host_ratio=host, device_ratio=device)
            return run

        runs = [[at(TARGET_HOST, TARGET_DEVICE), other], [at(TARGET_HOST, TARGET_DEVICE + 1e-9)],
                [at(TARGET_HOST + 1e-9, 1.0)], [at(1.0, 1.0)]]
        self.assertExpectedInline(spread(runs), """\
| micro-batches | W | every window: host | every window: device | within both targets |
|---|---:|---:|---:|---:|
| on the GPU | 1 | 1.000×–1.100× | 1.000×–1.050× | 2 of 4 |
| on the GPU | 8 | 1.066×–1.066× | 1.101×–1.101× | 0 of 1 |""")

    def test_the_command_renders_one_run_as_its_table_and_several_as_their_spread(self):
        """`python bench/verify_cost_table.py DIR [DIR ...]`: one folder its table, several their
        spread; a folder without a JSON is refused by name."""
        sys.path.insert(0, str(ROOT))
        from bench.verify_cost_table import main, spread, table

        at = ROOT / "functional_tests/results/selfcheck/h100_e21b621"
        for dirs, want in (([at / "cost1"], table(_cost_run(at / "cost1"))),
                           ([at / "cost2", at / "cost3"], spread([_cost_run(at / "cost2"), _cost_run(at / "cost3")]))):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                self.assertEqual(main([str(d) for d in dirs]), 0)
            self.assertEqual(out.getvalue(), want + "\n")
        err = io.StringIO()
        with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as e:
            main([str(at / "cost1"), str(at / "nowhere")])
        self.assertEqual(e.exception.code, 2)
        self.assertIn("nowhere: no JSON of bench/verify_cost.py there", err.getvalue())

    def test_a_table_of_jsons_without_and_with_a_gpu_busy_time(self):
        """The busy columns come from the JSONs that have them (a copy of one row with a GPU busy
        time, as --device-busy writes it, beside one without)."""
        sys.path.insert(0, str(ROOT))
        from bench.verify_cost_table import table

        runs = [json.loads(f.read_text()) for f in
                sorted((ROOT / "functional_tests/results/selfcheck/cost_ef733b5").glob("cost_*_w[18].json"))]
        self.assertExpectedInline(table(runs), """\
| micro-batches | W | off: host / device ms | every window: host, device | every 100th: host, device |
|---|---:|---:|---:|---:|
| pinned host memory, read in place | 1 | 2.77 / 3.77 | 1.11×, 1.23× | 0.96×, 0.99× |
| pinned host memory, read in place | 8 | 15.07 / 23.49 | 1.04×, 1.31× | 0.98×, 0.99× |
| pinned host memory, copied early (`early_copy`) | 1 | 3.15 / 3.18 | 1.07×, 1.08× | 0.98×, 0.98× |
| pinned host memory, copied early (`early_copy`) | 8 | 14.83 / 14.88 | 1.04×, 1.04× | 1.00×, 1.00× |
| on the GPU | 1 | 1.61 / 1.65 | 1.10×, 1.09× | 0.98×, 0.99× |
| on the GPU | 8 | 6.18 / 6.62 | 1.07×, 1.10× | 1.00×, 0.98× |""")
        busy = json.loads(json.dumps(runs[0]))
        busy["settings"]["off"]["busy_ms"] = 0.25
        busy["settings"]["every window"]["busy_ratio"] = 1.5
        self.assertExpectedInline(table([busy, runs[1]]), """\
| micro-batches | W | off: host / device ms | every window: host, device | every 100th: host, device | off: GPU busy ms | every window: GPU busy |
|---|---:|---:|---:|---:|---:|---:|
| on the GPU | 1 | 1.61 / 1.65 | 1.10×, 1.09× | 0.98×, 0.99× | 0.250 | 1.50× |
| on the GPU | 8 | 6.18 / 6.62 | 1.07×, 1.10× | 1.00×, 0.98× | - | - |""")

    def test_a_table_per_path_of_jsons_that_time_several(self):
        """`--paths kernel,torch` names the checked rows by path: each path's table reads its own."""
        sys.path.insert(0, str(ROOT))
        from bench.verify_cost_table import table

        run = json.loads((ROOT / "functional_tests/results/selfcheck/cost_ef733b5/cost_device_w1.json").read_text())
        rows = run["settings"]
        for name in ("every window", "every 100th"):
            rows[f"{name} (kernel)"] = rows.pop(name)
            rows[f"{name} (torch)"] = dict(rows[f"{name} (kernel)"], path="torch", host_ratio=1.01, device_ratio=1.02)
        self.assertExpectedInline(table([run], "torch"), """\
| micro-batches | W | off: host / device ms | every window: host, device | every 100th: host, device |
|---|---:|---:|---:|---:|
| on the GPU | 1 | 1.61 / 1.65 | 1.01×, 1.02× | 1.01×, 1.02× |""")
        self.assertIn("| 1.10×, 1.09× |", table([run], "kernel"))
        with self.assertRaises(ValueError) as e:
            table([run])
        self.assertExpectedInline(str(e.exception),
                                  """the JSON of device W 1 times the paths kernel, torch: name one with --path""")


def test_the_readme_step_cost_table_from_the_committed_jsons():
    """Each cell of the README's training-step table (every window against the check off, per
    overlap) is its committed JSON's medians and ratio, as written there."""
    readme = (ROOT / "README.md").read_text()
    runs = sorted((ROOT / "functional_tests/results/selfcheck/h100_2c428a2").glob("step_*.json"))
    assert len(runs) == 6
    for f in runs:
        rows = json.loads(f.read_text())["settings"]
        cells = [f"{rows[f'overlap {o}, every window']['step_ms']:.2f} against "
                 f"{rows[f'overlap {o}, check off']['step_ms']:.2f}: {rows[f'overlap {o}, every window']['ratio']:.3f}×"
                 for o in ("off", "on")]
        assert " | ".join(cells) in readme, (f.name, cells)
