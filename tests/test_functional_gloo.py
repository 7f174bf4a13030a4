"""Gloo multi-process functional suite (fork start): heterogeneous worlds, W 1-3, overlap on/off,
and fault cases where every rank of the DP group must raise together (bounded by timeouts)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "functional_tests"))
import gloo_suite  # noqa: E402

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


def test_language_cost_weight_world():
    result = gloo_suite.launch(["--vision-dp", "2", "--language-dp", "4", "--language-weight", "0.5"], 6)
    assert result["micro_batches"] == 7


@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
@pytest.mark.parametrize("case", ["source_raises", "bad_input", "early_end"])
def test_faults_raise_on_every_rank(case, overlap):
    result = gloo_suite.launch(["--vision-dp", "2", "--language-dp", "2", "--case", case, overlap,
                                "--timeout", "30"], 4)
    assert len(result["errors"]) == 1
    msg = result["errors"][0]
    expected = {"source_raises": "data source raised OSError: disk read failed at micro-batch 3",
                "bad_input": "pad to a fixed",
                "early_end": "micro-batch count of this window differs across the DP group"}[case]
    assert msg.startswith("ReorderError") and expected in msg, msg


def test_lost_peer_becomes_an_error():
    # the last language rank exits before its first exchange; the survivor raises within the timeout
    result = gloo_suite.launch(["--vision-dp", "1", "--language-dp", "2", "--case", "lost_peer", "--timeout", "10"], 3)
    assert result["case"] == "lost_peer"


@pytest.mark.parametrize("layout", [(0, 4, 8, 4), (0, 8, 8, 2), (4, 4, 8, 4)], ids=lambda x: f"v{x[0]}l{x[1]}w{x[3]}")
def test_issue8_layouts_on_gloo(layout):
    """The 3-8 GPU layouts of issue 8 (single module dp 4 / dp 8, vision dp 4 + language dp 4), on Gloo."""
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
    assert res.returncode == 0 and "'ok': True" in res.stdout and "'checked': 24" in res.stdout, res.stdout + res.stderr
