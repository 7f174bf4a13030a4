"""Counting on a device against counting on the host: the torch-ops path (what a device without
Triton runs) called on CPU tensors, and the Triton counting kernel through Triton's interpreter (a
subprocess with TRITON_INTERPRET=1, when triton is importable), both against plain numpy sums."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reorder import CostModel
from reorder.batch import counting
from support.kernels import BrokenKernel

ROOT = Path(__file__).resolve().parents[2]
IMAGE, START = 7, 5
MODEL = CostModel(image_token_id=IMAGE, vision_start_token_id=START, language_weight=1.0)
MASK_DTYPES = [None, torch.bool, torch.uint8, torch.int32, torch.int64, torch.float32, torch.bfloat16]


@st.composite
def micro_batches(draw):
    """(input_ids [B, S], attention_mask or None, grid_thw [n, 3] or None), with masks that are
    sometimes not 0/1."""
    b, s = draw(st.integers(0, 4)), draw(st.integers(1, 2100))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    ids = torch.from_numpy(rng.integers(0, 10, size=(b, s))).to(draw(st.sampled_from([torch.int32, torch.int64])))
    dtype = draw(st.sampled_from(MASK_DTYPES))
    mask = None
    if dtype is not None:
        top = 3 if draw(st.booleans()) and dtype != torch.bool else 2
        mask = torch.from_numpy(rng.integers(0, top, size=(b, s))).to(dtype)
    thw = torch.from_numpy(rng.integers(1, 9, size=(draw(st.integers(0, 5)), 3)))
    return ids, mask, thw.to(torch.int32) if draw(st.booleans()) else thw


def oracle_table(ids, mask) -> np.ndarray:
    """[B, 4]: placeholders, vision starts, mask entries equal to 1, equal to 0 (0, 0 without a mask)."""
    i = ids.numpy()
    m = None if mask is None else mask.float().numpy()
    cols = [(i == IMAGE).sum(1), (i == START).sum(1)]
    cols += [np.zeros(len(i), np.int64)] * 2 if m is None else [(m == 1).sum(1), (m == 0).sum(1)]
    return np.stack(cols, axis=1).astype(np.int64)


@settings(max_examples=40, deadline=None)
@given(micro_batches())
def test_torch_ops_count_like_the_host(batch):
    """The device path (torch ops, one host copy; here on CPU tensors) gives the host path's counts
    and grid_thw, and rejects a mask that is not 0/1 with the host path's message."""
    ids, mask, thw = batch
    for squares in (False, True):
        try:
            want = counting._counts_numpy(MODEL, ids, mask, squares, thw)
        except ValueError as e:
            with pytest.raises(ValueError) as got:
                counting._counts_torch(MODEL, ids, mask, squares, thw)
            assert str(got.value) == str(e)
            continue
        got = counting._counts_torch(MODEL, ids, mask, squares, thw)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])


def check_kernel_interpreted():
    """Runs with TRITON_INTERPRET=1: the kernel's table and grid_thw copy on CPU tensors against
    `oracle_table`, and the whole device path with the kernel in it against the host path."""
    assert os.environ.get("TRITON_INTERPRET") == "1"

    def one(batch):
        ids, mask, thw = batch
        b = ids.shape[0]
        if not b:
            return  # an empty micro-batch is counted by the torch ops
        flat = counting._counts_kernel(MODEL, ids, mask, thw, interpret=True).numpy()
        np.testing.assert_array_equal(flat[:4 * b].reshape(b, 4), oracle_table(ids, mask))
        np.testing.assert_array_equal(flat[4 * b:], thw.reshape(-1).numpy())

    settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))(given(micro_batches())(one))()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton not installed (pip install triton==3.9.0 to run the kernel in its interpreter)")
def test_counting_kernel_in_interpreter():
    path = [str(ROOT), str(Path(__file__).resolve().parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))
    res = subprocess.run([sys.executable, "-c", "import test_counting as t; t.check_kernel_interpreted()"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_counting_kernel_specializes_only_what_stays_fixed():
    """The integers that change with the micro-batch or the model (sequence length, grid_thw's
    length, the token ids) and grid_thw's address are not specialized, so no micro-batch compiles a
    new variant mid-run; the dtypes, the flags and the block size are."""
    from reorder.batch.triton_count import count_rows

    assert {p.name for p in count_rows.params if p.do_not_specialize} == {"thw", "S", "n_thw", "image_id",
                                                                          "start_id"}
    assert {p.name for p in count_rows.params if p.is_constexpr} == {"HAS_MASK", "HAS_THW", "BLOCK"}


def test_kernel_is_not_used_off_cuda_or_on_strided_fields(monkeypatch):
    """Off CUDA, or for a field that is not contiguous, the torch ops count (the kernel is not called)."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(grid)

    monkeypatch.setattr(counting, "_KERNEL", [Kernel()])
    ids = torch.zeros(2, 8, dtype=torch.int64)
    assert counting._counts_kernel(MODEL, ids, None, None) is None
    assert counting._counts_kernel(MODEL, ids.t(), None, None, interpret=True) is None
    assert counting._counts_kernel(MODEL, ids, torch.ones(8, 2).t(), None, interpret=True) is None
    assert counting._counts_kernel(MODEL, ids[:0], None, None, interpret=True) is None
    assert calls == []
    assert counting._counts_kernel(MODEL, ids, torch.ones(2, 8), None, interpret=True) is not None
    assert len(calls) == 1


def test_a_kernel_that_fails_leaves_counting_to_the_torch_ops(monkeypatch, caplog):
    """A launch that raises (e.g. no Triton compiler for the GPU) is logged once and counting goes on
    with the torch ops: the kernel is not tried again."""
    broken = BrokenKernel()
    monkeypatch.setattr(counting, "_KERNEL", [broken])
    ids = torch.zeros(2, 8, dtype=torch.int64)
    with caplog.at_level("WARNING", logger="reorder"):
        assert counting._counts_kernel(MODEL, ids, None, None, interpret=True) is None
        assert counting._counts_kernel(MODEL, ids, None, None, interpret=True) is None
    assert broken.launches == [(2,)] and counting._KERNEL == [None]
    assert "Triton counting kernel failed (RuntimeError: no compiler for this GPU)" in caplog.text
