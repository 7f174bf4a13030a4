"""Command line end to end: `python -m reorder demo` on real Gloo processes (and emulated, which must
agree), `python -m reorder simulate` on CSV / JSON lines / a synthetic mix with exact expected
figures, bad input files (message with file, line and field; exit 2; no traceback), PNG plots, the
Qwen-VL resize rule, and the multi-process runner's failure report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_DEMO = ["--micro-batch", "8", "--windows", "2", "--seq-len", "160", "--features", "4", "--mix", "small"]


def cli(*args, cwd, timeout=120):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "reorder", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def assert_png(path):
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, (path, len(data))


# ---- demo --------------------------------------------------------------------------------------


def test_demo_real_processes_matches_emulated(tmp_path, capsys):
    """vision dp 2 + language dp 4 on 6 processes, overlap on: progress, table, JSON, plot; the figures
    equal the emulated (threaded) path on the same stream, since plans depend only on the data."""
    real = ok(cli("demo", *SMALL_DEMO, "--json", "real.json", "--plot", "load.png", cwd=tmp_path))
    out = real.stdout
    assert "on 6 processes (torch.distributed, Gloo, fork)" in out
    assert "window 1/2" in out and "window 2/2" in out and out.count("I1-I8 ok") == 2
    assert "per-rank load" in out and "straggler cost" in out and "exchange ms" in out
    assert "all invariants" in out and "held on 2 windows" in out
    assert_png(tmp_path / "load.png")
    got = json.loads((tmp_path / "real.json").read_text())
    assert got["mode"] == "processes" and got["micro_batches"] == 2 and got["groups"] == 4
    for m, dp in (("vision", 2), ("language", 4)):
        s = got["modules"][m]
        assert s["dp"] == dp and len(s["loads_before"]) == dp and len(s["loads_after"]) == dp
        assert sum(s["loads_before"]) == pytest.approx(sum(s["loads_after"]))  # nothing lost (I6)
        assert s["samples"] == 16 and 0 < s["moved_samples"] <= 16 and s["moved_bytes"] > 0
        assert s["spread_after"] <= s["spread_before"] and s["straggler_after"] <= s["straggler_before"]
        assert s["plan_ms"] >= 0 and s["exchange_ms"] > 0 and s["wait_ms"] is not None
    from reorder.__main__ import main

    assert main(["demo", *SMALL_DEMO, "--emulated", "--json", str(tmp_path / "emu.json")]) == 0
    emu = json.loads((tmp_path / "emu.json").read_text())
    assert emu["mode"] == "emulated"
    keys = ("loads_before", "loads_after", "straggler_before", "straggler_after", "moved_samples", "moved_bytes")
    for m in ("vision", "language"):
        assert {k: emu["modules"][m][k] for k in keys} == {k: got["modules"][m][k] for k in keys}, m


def test_demo_no_overlap_window_2_dp1(tmp_path):
    proc = ok(cli("demo", "--vision-dp", "1", "--language-dp", "2", "--micro-batch", "4", "--window", "2",
                  "--windows", "2", "--no-overlap", "--seq-len", "128", "--features", "4", "--mix", "small",
                  "--json", "-", cwd=tmp_path))
    data = json.loads(proc.stdout)
    assert "on 3 processes" in proc.stderr and "window 2/2" in proc.stderr  # --json -: humans read stderr
    assert data["micro_batches"] == 4 and data["config"]["overlap"] is False
    assert data["modules"]["vision"]["moved_samples"] == 0  # dp 1 permutes locally
    assert data["modules"]["language"]["samples"] == 16


def test_demo_detects_a_corrupted_sample(tmp_path):
    """The per-window checks are live: one flipped byte on the last rank fails the run (exit 1)."""
    proc = cli("demo", *SMALL_DEMO, "--inject-corruption", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "demo failed at window 2" in proc.stderr and "I5 violated" in proc.stderr, proc.stderr
    assert "language rank 3" in proc.stderr and "position_ids" in proc.stderr
    assert "Traceback" not in proc.stderr and "window 1/2" in proc.stdout


def test_demo_rejects_a_bad_layout(capsys):
    from reorder.__main__ import main

    assert main(["demo", "--micro-batch", "6"]) == 2
    err = capsys.readouterr().err
    assert "--micro-batch 6 is not a positive multiple of the canonical grid G = lcm(2, 4) = 4" in err
    assert main(["demo", "--vision-dp", "4", "--language-dp", "2"]) == 2
    assert "Megatron MIMO requires encoder dp <= language dp" in capsys.readouterr().err


# ---- simulate ----------------------------------------------------------------------------------


def test_simulate_csv_costs_exact(tmp_path):
    """Costs [10,10,10,1,1,1] per micro-batch over dp 3: natural loads 20/11/2, LPT 11/11/11."""
    lines = ["sample_id,cost"] + [f"{i},{[10, 10, 10, 1, 1, 1][i % 6]}" for i in range(64)]
    (tmp_path / "costs.csv").write_text("\n".join(lines) + "\n")
    proc = ok(cli("simulate", "costs.csv", "--dp", "3", "--micro-batch", "6", "--json", "sim.json", cwd=tmp_path))
    assert "10 micro-batches of B=6" in proc.stdout and "4 trailing samples dropped" in proc.stdout
    data = json.loads((tmp_path / "sim.json").read_text())
    assert data["input"] == dict(source="costs.csv", field="cost", samples=64, used=60, dropped=4)
    from reorder.plan.balancers import BALANCERS

    assert set(data["balancers"]) == set(BALANCERS) and {"lpt", "identity"} <= set(data["balancers"])
    lpt, ident = data["balancers"]["lpt"]["model"], data["balancers"]["identity"]["model"]
    assert (lpt["straggler_before"], lpt["straggler_after"]) == (200, 110)
    assert lpt["saved"] == pytest.approx(0.45) and lpt["spread_after"] == pytest.approx(1.0)
    assert lpt["spread_before"] == pytest.approx(20 / (33 / 3))
    assert (ident["saved"], ident["moved_fraction"], ident["straggler_after"]) == (0.0, 0.0, 200)
    assert data["bound"]["model"]["saved"] == pytest.approx(0.45)
    row = next(line for line in proc.stdout.splitlines() if line.startswith("lpt"))
    assert "45.0%" in row and "model" in row


IMAGES = [  # (JSON image_sizes, CSV image_sizes, patches by the Qwen2-VL rule with default pixels)
    ([[640, 480]], "640x480", 1564),  # 476x644 -> 34x46 patches
    ([], "", 0),  # text only
    ("4000x3000", "4000x3000", 4920),  # scaled down to 840x1148 -> 60x82
    ([[20, 20], [640, 480]], "20x20;640x480", 16 + 1564),  # 20x20 scaled up to 56x56 -> 4x4
]


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_simulate_image_sizes(tmp_path, monkeypatch, capsys, fmt):
    if fmt == "jsonl":
        text = "\n".join(json.dumps({"image_sizes": j, "tokens": 100 + i}) for i, (j, _, _) in enumerate(IMAGES))
        text = "# logged by my loader\n" + text.replace("\n", "\n\n", 1)  # comment + blank line are skipped
    else:
        text = "image_sizes,tokens\n" + "\n".join(f"{c},{100 + i}" for i, (_, c, _) in enumerate(IMAGES))
    (tmp_path / f"imgs.{fmt}").write_text(text + "\n")
    data = json.loads(ok(cli("simulate", f"imgs.{fmt}", "--dp", "2", "--micro-batch", "4", "--json", "-",
                             cwd=tmp_path)).stdout)
    assert data["input"]["field"] == "image_sizes" and data["resize"]["max_pixels"] == 14 * 14 * 4 * 1280
    lpt = data["balancers"]["lpt"]["model"]
    # natural: rank 0 = 1564 + 0, rank 1 = 4920 + 1580; LPT: {4920, 0} and {1580, 1564}
    assert (lpt["straggler_before"], lpt["straggler_after"]) == (6500, 4920)
    assert lpt["moved_fraction"] == 0.5 and data["cost"]["max"] == 4920
    # language term (cost = patches + 0.5 * tokens) and a larger max_pixels, in process
    from reorder.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(["simulate", f"imgs.{fmt}", "--dp", "2", "--micro-batch", "4", "--language-weight", "0.5",
                 "--max-pixels", str(16384 * 28 * 28), "--json", "lw.json"]) == 0
    data = json.loads((tmp_path / "lw.json").read_text())
    assert data["cost"]["max"] == 61204 + 0.5 * 102  # 4000x3000 kept at 2996x4004 -> 214x286 patches


def test_simulate_synthetic_mix_plot_and_json(tmp_path):
    proc = ok(cli("simulate", "--mix", "skewed", "--samples", "512", "--vision-dp", "2", "--language-dp", "4",
                  "--plot", "sim.png", "--json", "-", cwd=tmp_path))
    data = json.loads(proc.stdout)
    assert "synthetic mix 'skewed'" in proc.stderr and "plot written to sim.png" in proc.stderr
    assert data["micro_batches"] == 32 and data["layout"] == {"vision": 2, "language": 4}
    for m in ("vision", "language"):
        lpt = data["balancers"]["lpt"][m]
        assert 0.05 < lpt["saved"] <= data["bound"][m]["saved"] + 1e-12
        assert lpt["spread_after"] < lpt["spread_before"] and 0 < lpt["moved_fraction"] < 1
        assert data["balancers"]["identity"][m]["saved"] == 0
    assert data["balancers"]["lpt"]["language"]["moved_fraction"] > data["balancers"]["lpt"]["vision"]["moved_fraction"]
    assert_png(tmp_path / "sim.png")


def test_bad_csv_names_file_line_and_field(tmp_path):
    rows = ["sample_id,cost"] + [f"{i},{'abc' if i == 5 else i}" for i in range(10)]
    (tmp_path / "costs.csv").write_text("\n".join(rows) + "\n")
    proc = cli("simulate", "costs.csv", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "costs.csv line 7: field 'cost' = 'abc' is not a number" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("name, text, message", [
    ("a.csv", "cost\n1\n-3\n", "a.csv line 3: field 'cost' = '-3' must be a finite number >= 0"),
    ("a.csv", "cost,tokens\n1,2\n3\n", "a.csv line 3: 1 comma-separated values, the header has 2"),
    ("a.csv", "id,size\n1,2\n", "a.csv line 1: no column named 'cost', 'patches' or 'image_sizes'"),
    ("a.csv", "image_sizes\n640x480\n640*480\n", "a.csv line 3: field 'image_sizes' = '640*480' has image 1"),
    ("a.csv", "image_sizes\n6400x20\n", "a.csv line 2: field 'image_sizes' = '6400x20' cannot be resized"),
    ("p.jsonl", '{"patches": 10}\n\n{"patches": 12,}\n', "p.jsonl line 3: not valid JSON (Expecting property name"),
    ("a.jsonl", '{"patches": 1}\n{"patches": 2.5}\n', "a.jsonl line 2: field 'patches' = 2.5 is not a whole"),
    ("a.jsonl", '{"patches": 1}\n{"cost_": 2}\n', "a.jsonl line 2: missing field 'patches'"),
    ("a.jsonl", '{"image_sizes": [[1, 2, 3]]}\n', "a.jsonl line 1: field 'image_sizes' = [[1, 2, 3]] has image 1"),
    ("a.jsonl", '[1, 2]\n', "a.jsonl line 1: expected a JSON object per line"),
    ("a.jsonl", '{"patches": 1, "tokens": "x"}\n', "a.jsonl line 1: field 'tokens' = 'x' is not a number"),
    ("a.csv", "cost\n1\n2\n", "a.csv: 2 samples, fewer than one micro-batch of B=16"),
    ("a.csv", "", "a.csv: no samples"),
    ("missing.csv", None, "cannot read missing.csv: No such file or directory"),
])
def test_bad_inputs_in_process(tmp_path, monkeypatch, capsys, name, text, message):
    from reorder.__main__ import main

    monkeypatch.chdir(tmp_path)
    if text is not None:
        (tmp_path / name).write_text(text)
    assert main(["simulate", name]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_usage_errors_in_process(tmp_path, monkeypatch, capsys):
    from reorder.__main__ import main

    monkeypatch.chdir(tmp_path)
    assert main(["simulate"]) == 2
    assert "give either an input FILE or --mix NAME" in capsys.readouterr().err
    assert main(["simulate", "--mix", "small", "--dp", "2,4", "--vision-dp", "2"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["simulate", "--mix", "small", "--balancer", "nope"]) == 2
    assert "unknown balancer(s) ['nope']" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    assert main(["simulate", "--mix", "small", "--plot", "x.png"]) == 2
    assert "pip install 'reorder[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_matplotlib_is_imported_lazily(tmp_path):
    code = ("import sys; from reorder.__main__ import main; import reorder.cli.demo, reorder.cli.simulate, reorder.cli.plots; "
            "assert main(['simulate', '--mix', 'small', '--samples', '64']) == 0; "
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported without --plot'")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---- pieces ------------------------------------------------------------------------------------


@pytest.mark.parametrize("w, h, kw, size, patches", [
    (640, 480, {}, (476, 644), 1564),  # round to multiples of 28
    (4000, 3000, {}, (840, 1148), 4920),  # > max_pixels: scaled down, floored
    (4000, 3000, dict(max_pixels=16384 * 28 * 28), (2996, 4004), 61204),
    (20, 20, {}, (56, 56), 16),  # < min_pixels: scaled up, ceiled
    (70, 70, {}, (56, 56), 16),  # 70/28 = 2.5 rounds half to even
    (98, 98, {}, (112, 112), 64),  # 98/28 = 3.5 rounds half to even -> 4
    (1000, 10, {}, (28, 560), 80),  # a side under one factor is scaled up, not rejected
    (1000, 1000, dict(min_pixels=2000 * 2000, max_pixels=4000 * 4000), (2016, 2016), 144 * 144),
])
def test_qwen_resize(w, h, kw, size, patches):
    from reorder.integrations.qwen_resize import image_patches, smart_resize

    assert smart_resize(h, w, **kw) == size
    assert image_patches(w, h, **kw) == patches


def test_qwen_resize_rejects():
    from reorder.integrations.qwen_resize import smart_resize

    with pytest.raises(ValueError, match="aspect ratio 201 > 200"):
        smart_resize(10, 2010)
    with pytest.raises(ValueError, match="must be > 0"):
        smart_resize(0, 10)


def _raise_on_rank_1(rank, world):
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()


def test_run_processes_reports_the_failing_rank():
    from reorder.cli.processes import ProcessesFailed, run_processes

    assert run_processes(lambda rank, world: (rank, world), 2) == (0, 2)
    with pytest.raises(ProcessesFailed, match=r"^rank 1: ValueError: boom on rank 1") as e:
        run_processes(_raise_on_rank_1, 3, timeout=60)
    assert "Traceback" in e.value.details


def _flaky_rendezvous(marks: str, fails: int):
    """A stand-in for init_process_group that fails the first `fails` calls (counted in files under
    `marks`, shared by the forked ranks) as Gloo does when a peer's connection drops mid-rendezvous."""
    import torch.distributed as dist

    real = dist.init_process_group

    def init(*a, **k):
        if len(os.listdir(marks)) < fails:
            open(os.path.join(marks, f"{os.getpid()}.{time.monotonic_ns()}"), "w").close()
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:1")
        return real(*a, **k)
    return init


def _late_drop(marks: str):
    """A stand-in for init_process_group with which rank 1, at the first launch only, joins the group,
    then loses its connections and raises, as Gloo does when a peer that already joined finished its
    work and closed them while this rank was still setting up its own."""
    import torch.distributed as dist

    real = dist.init_process_group

    def init(*a, rank, **k):
        real(*a, rank=rank, **k)
        if rank == 1 and not os.listdir(marks):
            open(os.path.join(marks, "dropped"), "w").close()
            dist.destroy_process_group()
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    return init


def test_no_rank_runs_the_function_before_every_rank_has_joined(tmp_path, monkeypatch):
    """A rank whose rendezvous fails after another rank's succeeded (that rank, done with a short
    function, closed its connections) is a dropped rendezvous too: no rank runs the function before
    every rank has joined, so the launch is started again and succeeds."""
    import torch.distributed as dist

    from reorder.cli.processes import run_processes

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(dist, "init_process_group", _late_drop(str(marks)))
    assert run_processes(lambda rank, world: (rank, world), 2, timeout=60) == (0, 2)
    assert os.listdir(marks) == ["dropped"]


def _count_calls(rank, world, calls):
    with open(os.path.join(calls, f"{rank}.{time.monotonic_ns()}"), "w"):
        pass
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def test_run_processes_starts_again_when_the_rendezvous_drops(tmp_path, monkeypatch):
    """A Gloo rendezvous that drops before any rank ran the function (a peer's connection closed
    under load) is started again with fresh processes; a failure of the function itself is not."""
    import torch.distributed as dist

    from reorder.cli.processes import RENDEZVOUS_ATTEMPTS, ProcessesFailed, run_processes

    marks = tmp_path / "marks"
    marks.mkdir()
    monkeypatch.setattr(dist, "init_process_group", _flaky_rendezvous(str(marks), 1))
    assert run_processes(lambda rank, world: (rank, world), 2, timeout=60) == (0, 2)
    assert len(os.listdir(marks)) == 1

    calls = tmp_path / "calls"
    calls.mkdir()
    with pytest.raises(ProcessesFailed, match=r"^rank 1: ValueError: boom on rank 1"):
        run_processes(_count_calls, 2, (str(calls),), timeout=60)
    assert sorted(n.split(".")[0] for n in os.listdir(calls)) == ["0", "1"]  # one attempt only

    always = tmp_path / "always"
    always.mkdir()
    monkeypatch.setattr(dist, "init_process_group", _flaky_rendezvous(str(always), 10 ** 6))
    with pytest.raises(ProcessesFailed, match=rf"^rank \d: RuntimeError: Gloo connectFullMesh failed .* \(rendezvous "
                                              rf"failed {RENDEZVOUS_ATTEMPTS} times\)"):
        run_processes(lambda rank, world: rank, 2, timeout=60)


# ---- simulate: layouts, progress, planning time ---------------------------------------------------


@pytest.mark.parametrize("layout, encoder, language", [(["--dp", "4,2"], 4, 2),
                                                       (["--vision-dp", "2", "--language-dp", "3"], 2, 3)])
def test_simulate_refuses_a_layout_the_library_refuses(tmp_path, layout, encoder, language):
    from reorder.integrations.config import check_model_layout

    with pytest.raises(ValueError) as library:
        check_model_layout(encoder_pp=1, encoder_dp=encoder, language_dp=language, fixed_width_padding=True)
    proc = cli("simulate", "--mix", "small", "--samples", "256", "--micro-batch", "12", *layout, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert str(library.value) in proc.stderr and "Traceback" not in proc.stderr


def test_simulate_shows_progress_on_long_runs_only(tmp_path):
    args = ("simulate", "--mix", "small", "--samples", "256", "--dp", "2,4", "--balancer", "lpt")
    quick = ok(cli(*args, cwd=tmp_path))
    assert "planning:" not in quick.stderr  # under --progress-after (2 s by default): no bar
    slow = ok(cli(*args, "--progress-after", "0", cwd=tmp_path))  # as if the run had lasted 2 s already
    assert "planning:" in slow.stderr and "/48 [" in slow.stderr  # tqdm: the bound per module + lpt, 16 mb each
    assert "planning:" not in slow.stdout and "mb/s" not in slow.stdout  # the tables stay clean


def test_simulate_plan_time_leaves_out_the_first_call(tmp_path):
    """A balancer whose first call costs 0.5 s (one-time set-up): plan us/mb is the steady time, and
    the set-up is reported apart."""
    (tmp_path / "sitecustomize.py").write_text(
        "import time\nimport reorder.plan.balancers as b\nfast, calls = b.BALANCERS['lpt'], []\n"
        "def slow_first(costs, groups):\n    if not calls:\n        calls.append(1)\n        time.sleep(0.5)\n"
        "    return fast(costs, groups)\nb.BALANCERS['lpt'] = slow_first\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "reorder", "simulate", "--mix", "small", "--samples", "512",
                           "--dp", "2,4", "--balancer", "lpt", "--json", "-"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    data = json.loads(ok(proc).stdout)
    lpt = data["balancers"]["lpt"]["language"]
    assert lpt["plan_first_call_ms"] >= 500 and lpt["plan_us_per_microbatch"] < 5000  # 32 mb: 15625 with the call
    assert "(lpt 5" in proc.stderr and "ms)" in proc.stderr  # "... one-time set-up (lpt 500.x ms)"


# ---- the smaller command-line details ------------------------------------------------------------


@pytest.mark.parametrize("ext, magic", [(".pdf", b"%PDF"), (".svg", b"<?xml")])
def test_plot_writes_what_matplotlib_writes(tmp_path, ext, magic):
    ok(cli("simulate", "--mix", "small", "--samples", "256", "--balancer", "lpt", "--plot", "sim" + ext, cwd=tmp_path))
    assert (tmp_path / ("sim" + ext)).read_bytes().startswith(magic)
    proc = cli("simulate", "--mix", "small", "--plot", "sim.jpg", cwd=tmp_path)
    assert proc.returncode == 2 and "--plot sim.jpg: give a file name ending in .png, .pdf, .svg" in proc.stderr


def test_demo_help_shows_every_default(tmp_path):
    text = " ".join(ok(cli("demo", "--help", cwd=tmp_path)).stdout.split())
    assert "image size mix (default realistic)" in text and "seed of the synthetic stream (default 0)" in text


def test_one_window_reads_in_the_singular_and_a_module_made_worse_is_named(tmp_path):
    """Seed 21, B 8, vision dp 2 + language dp 4: the plan that helps language costs vision 1.4 %."""
    out = ok(cli("demo", "--micro-batch", "8", "--windows", "1", "--seq-len", "160", "--features", "4", "--mix",
                 "small", "--seed", "21", cwd=tmp_path)).stdout
    assert "1 window," in out and "summed over 1 micro-batch)" in out and "held on 1 window;" in out
    assert "1 micro-batches" not in out and "1 windows" not in out
    assert "note: balancer balanced made vision (dp 2) 1.4% worse than without reordering" in out
    assert "made language" not in out
    (tmp_path / "c.csv").write_text("cost\n" + "\n".join(str(c) for c in [5, 1, 1, 1, 1]) + "\n")
    out = ok(cli("simulate", "c.csv", "--dp", "1", "--micro-batch", "4", cwd=tmp_path)).stdout
    assert "1 micro-batch of B=4 in file order, 1 trailing sample dropped" in out


def test_simulate_names_a_module_made_worse(tmp_path):
    out = ok(cli("simulate", "--mix", "realistic", "--samples", "4096", "--dp", "8,16", "--micro-batch", "32",
                 "--balancer", "lpt", "--balancer", "identity", cwd=tmp_path)).stdout
    assert "note: balancer lpt made vision (dp 8) 5.6% worse than without reordering" in out
    assert out.count("note:") == 1


def test_a_negative_image_size_is_called_negative(tmp_path):
    (tmp_path / "s.csv").write_text("image_sizes\n640x480\n-640x480\n")
    proc = cli("simulate", "s.csv", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "line 3: field 'image_sizes' = '-640x480' has image 1 = '-640x480' whose width -640 is negative" \
        in proc.stderr


def test_usage_names_the_console_script_or_the_module(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "reorder")  # installed by `pip install -e .`
    proc = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.stdout.startswith("usage: reorder "), proc.stdout + proc.stderr
    bad = subprocess.run([script, "simulate", "--mix", "small", "--samples", "0"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)
    assert bad.stderr.startswith("reorder simulate: error: --samples 0 is invalid"), bad.stderr
    assert ok(cli("--help", cwd=tmp_path)).stdout.startswith("usage: python -m reorder ")


def test_a_fractional_timeout_is_reported_as_given(tmp_path):
    proc = cli("demo", "--timeout", "0.5", cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "timed out after 0.5 s (a rank is stuck)" in proc.stderr


def test_demo_outside_a_checkout_runs_without_the_spec_checks(tmp_path):
    """spec/ and support/ are not installed: from another directory the demo still runs and says
    that it did not check the invariants (instead of failing on the missing modules)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-m", "reorder", "demo", "--windows", "2"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "invariants not checked: the checks read spec/ and support/" in res.stdout
