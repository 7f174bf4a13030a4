"""The built wheel holds the library alone: no spec/, support/, tests/ or top-level modules."""

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_holds_only_the_library(tmp_path):
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (wheel,) = tmp_path.glob("reorder-*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"reorder"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    assert "reorder/plan/moves.py" in names and "reorder/exchange/triton_copy.py" in names
