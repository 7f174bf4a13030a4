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
        torch_ops_count_like_the_host(ids, mask, thw, squares)


def torch_ops_count_like_the_host(ids, mask, thw, squares):
    """`_counts_torch` gives `_counts_numpy`'s counts and grid_thw, or raises its message; returns
    the torch path's result (None where both raised)."""
    try:
        want = counting._counts_numpy(MODEL, ids, mask, squares, thw)
    except ValueError as e:
        with pytest.raises(ValueError) as got:
            counting._counts_torch(MODEL, ids, mask, squares, thw)
        assert str(got.value) == str(e)
        return None
    got = counting._counts_torch(MODEL, ids, mask, squares, thw)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    return got


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


# --- the device path: where each tensor lives, which path counts, the kernel's contract ---------

class PlainCountRows:
    """`count_rows` of reorder.batch.triton_count in plain Python, launched as Triton launches it
    (kernel[(B,)](ids, mask, thw, out, S, n_thw, image_id, start_id, HAS_MASK=, HAS_THW=, BLOCK=)):
    program b writes row b's placeholders, vision starts, mask ones and mask zeros (0, 0 without
    HAS_MASK) to out[4b:4b+4]; with HAS_THW, thw's n_thw integers follow at out[4B:]. A BLOCK that
    is not a power of two is refused, as Triton refuses it. `launches`: (grid, HAS_MASK, HAS_THW)."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def launch(ids, mask, thw, out, S, n_thw, image_id, start_id, *, HAS_MASK, HAS_THW, BLOCK):
            if not isinstance(BLOCK, int) or BLOCK < 1 or BLOCK & (BLOCK - 1):
                raise ValueError(f"arange's range must be a power of 2, got {BLOCK}")
            self.launches.append((grid, HAS_MASK, HAS_THW))
            flat_ids, flat_mask = ids.reshape(-1).tolist(), mask.reshape(-1).tolist()
            for b in range(grid[0]):
                row = flat_ids[b * S:(b + 1) * S]
                m = flat_mask[b * S:(b + 1) * S] if HAS_MASK else []
                out[4 * b:4 * b + 4] = torch.tensor([row.count(image_id), row.count(start_id),
                                                     sum(x == 1 for x in m), sum(x == 0 for x in m)])
            if HAS_THW:
                out[4 * grid[0]:4 * grid[0] + n_thw] = thw.reshape(-1)[:n_thw].to(torch.int64)
        return launch


@settings(max_examples=30, deadline=None)
@given(micro_batches())
def test_the_kernels_table_through_a_plain_kernel(batch):
    """What `_counts_kernel` hands the kernel and reads back: the [B, 4] table of `oracle_table` and
    grid_thw's integers after it, int64 on input_ids' device; without grid_thw nothing after it."""
    ids, mask, thw = batch
    kernel = PlainCountRows()
    counting._KERNEL[:] = [kernel]
    try:
        for grid in (thw, None):
            flat = counting._counts_kernel(MODEL, ids, mask, grid, interpret=True)
            if not ids.shape[0]:
                assert flat is None
                continue
            assert flat.dtype == torch.int64 and flat.device == ids.device
            b = ids.shape[0]
            np.testing.assert_array_equal(flat[:4 * b].reshape(b, 4).numpy(), oracle_table(ids, mask))
            want = thw.reshape(-1).numpy() if grid is not None and thw.numel() else np.zeros(0, np.int64)
            np.testing.assert_array_equal(flat[4 * b:].numpy(), want)
            assert kernel.launches[-1] == ((b,), mask is not None, grid is not None and thw.numel() > 0)
    finally:
        counting._KERNEL[:] = []


@settings(max_examples=30, deadline=None)
@given(micro_batches())
def test_the_device_path_with_the_kernel_counts_like_the_host(batch):
    """`_counts_torch` where the kernel runs (here: the plain kernel, interpreted on CPU tensors):
    the kernel counts unless squares are wanted (it does not count them), grid_thw rides along, and
    the counts are the host path's."""
    ids, mask, thw = batch
    kernel = PlainCountRows()
    real = counting._counts_kernel
    counting._KERNEL[:] = [kernel]
    counting._counts_kernel = lambda model, i, m, g: real(model, i, m, g, interpret=True)
    try:
        for squares in (False, True):
            before = len(kernel.launches)
            got = torch_ops_count_like_the_host(ids, mask, thw, squares)
            if got is None:
                continue
            assert got[1].dtype == np.int64
            launched = len(kernel.launches) - before
            assert launched == (0 if squares or not ids.shape[0] else 1)
            if launched:
                assert kernel.launches[-1][2] == (thw.numel() > 0)
    finally:
        counting._KERNEL[:] = []
        counting._counts_kernel = real


def test_the_kernel_is_imported_once_from_triton_count(monkeypatch, caplog):
    """The first use imports `count_rows` from reorder.batch.triton_count and keeps it; where that
    import fails, counting goes on with the torch ops and logs nothing (a missing triton is normal)."""
    import sys
    import types
    kernel = PlainCountRows()
    monkeypatch.setattr(counting, "_KERNEL", [])
    monkeypatch.setitem(sys.modules, "reorder.batch.triton_count", types.SimpleNamespace(count_rows=kernel))
    ids = torch.tensor([[IMAGE, START, 1]])
    assert counting._counts_kernel(MODEL, ids, None, None, interpret=True)[:4].tolist() == [1, 1, 0, 0]
    assert counting._KERNEL == [kernel]
    monkeypatch.setattr(counting, "_KERNEL", [])
    monkeypatch.setitem(sys.modules, "reorder.batch.triton_count", None)     # import fails
    with caplog.at_level("DEBUG"):
        assert counting._counts_kernel(MODEL, ids, None, None, interpret=True) is None
    assert counting._KERNEL == [None] and caplog.records == []


def test_a_strided_grid_thw_is_not_read_by_the_kernel(monkeypatch):
    monkeypatch.setattr(counting, "_KERNEL", [PlainCountRows()])
    ids = torch.tensor([[START, IMAGE]])
    thw = torch.tensor([[1, 2, 2], [1, 4, 4]])
    assert counting._counts_kernel(MODEL, ids, None, thw.t(), interpret=True) is None
    assert counting._counts_kernel(MODEL, ids, None, thw, interpret=True)[4:].tolist() == [1, 2, 2, 1, 4, 4]


def test_a_failed_launch_is_logged_once_in_full(monkeypatch, caplog):
    monkeypatch.setattr(counting, "_KERNEL", [BrokenKernel()])
    with caplog.at_level("WARNING", logger="reorder"):
        assert counting._counts_kernel(MODEL, torch.zeros(2, 8, dtype=torch.int64), None, None, interpret=True) is None
    assert [(r.name, r.levelname, r.getMessage()) for r in caplog.records] == [
        ("reorder", "WARNING", "reorder: the Triton counting kernel failed (RuntimeError: no compiler for this GPU); "
                               "counting with torch ops from now on")]


def host_copies(monkeypatch):
    """The meta device (shapes, no data) stands in for an accelerator: every operation checks that
    its tensors share a device, and a copy to the host (`.cpu()`) gives zeros of its shape and
    dtype. Returns the list of tensors copied to the host."""
    copies = []
    real = torch.Tensor.cpu

    def cpu(self, *a, **k):
        if self.device.type != "meta":
            return real(self, *a, **k)
        copies.append((tuple(self.shape), self.dtype))
        return torch.zeros(self.shape, dtype=self.dtype)

    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    monkeypatch.setattr(counting, "_PAIRS", {})
    return copies


@pytest.mark.parametrize("squares", [False, True])
def test_on_a_device_every_count_is_made_there_and_copied_to_the_host_once(monkeypatch, squares):
    copies = host_copies(monkeypatch)
    b, s = 3, 6
    ids = torch.zeros(b, s, dtype=torch.int32, device="meta")
    thw = torch.zeros(2, 3, dtype=torch.int32, device="meta")
    out, grid = counting._counts_torch(MODEL, ids, None, squares, thw)
    k = 3 if squares else 2
    assert copies == [((b * k + 6,), torch.int64)]                          # the table and grid_thw, one copy
    assert out.shape == (4, b) and out.dtype == np.int64
    assert grid.shape == (2, 3) and grid.dtype == np.int64
    assert counting.square_patches(MODEL, ids).dtype == torch.int64 and len(copies) == 2


def test_on_a_device_the_mask_is_counted_there_too(monkeypatch):
    """A mask on the device is compared there; the stand-in host copy (zeros) then reads as a mask
    that is not 0/1, which is reported from what was copied (one copy, no other)."""
    copies = host_copies(monkeypatch)
    monkeypatch.setattr(counting, "_mask_values_error", lambda mask: ValueError("not a 0/1 mask"))
    ids = torch.zeros(2, 4, dtype=torch.int64, device="meta")
    with pytest.raises(ValueError, match="not a 0/1 mask"):
        counting._counts_torch(MODEL, ids, torch.ones(2, 4, device="meta"), False, None)
    assert copies == [((2, 4), torch.int64)]


def test_on_a_device_a_host_grid_thw_is_read_where_it_is(monkeypatch):
    """grid_thw on the host while input_ids live on a device: it is not copied along, and comes back
    as int64 whatever its dtype."""
    copies = host_copies(monkeypatch)
    ids = torch.zeros(2, 4, dtype=torch.int64, device="meta")
    thw = torch.tensor([[1, 2, 3]], dtype=torch.int32)
    out, grid = counting._counts_torch(MODEL, ids, None, False, thw)
    assert copies == [((2, 2), torch.int64)]                               # the [B, 2] table alone
    assert grid.tolist() == [[1, 2, 3]] and grid.dtype == np.int64


def test_counting_dispatches_on_where_the_tensors_live(monkeypatch):
    """Host input_ids (and a host mask, or none) are counted with numpy; anything on a device with
    the torch ops: each gets exactly the caller's arguments."""
    calls = []
    monkeypatch.setattr(counting, "_counts_numpy", lambda *a: calls.append(("numpy", a)) or "numpy")
    monkeypatch.setattr(counting, "_counts_torch", lambda *a: calls.append(("torch", a)) or "torch")
    model = CostModel(image_token_id=IMAGE, vision_start_token_id=START, language_weight=1.0,
                      encoder_quadratic_weight=1.0)
    host, meta = torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64, device="meta")
    thw = torch.zeros(1, 3, dtype=torch.int64)
    for ids, mask, path in ((host, host, "numpy"), (host, meta, "torch"), (meta, host, "torch"), (meta, meta, "torch")):
        calls.clear()
        assert counting.count_samples(model, ids, mask, grid_thw=thw) == path
        assert calls == [(path, (model, ids, mask, True, thw))]
    language_free = CostModel(image_token_id=IMAGE, vision_start_token_id=START, language_weight=0.0)
    for ids, path in ((host, "numpy"), (meta, "torch")):
        calls.clear()
        assert counting.count_samples(language_free, ids, None, squares=False) == path
        assert calls == [(path, (language_free, ids, None, False, None))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_a_float_mask_between_zero_and_one_is_refused(dtype):
    ids = torch.zeros(2, 3, dtype=torch.int64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.5, 0.0]], dtype=dtype)
    for count in (counting._counts_numpy, counting._counts_torch):
        with pytest.raises(ValueError) as e:
            count(MODEL, ids, mask, False, None)
        assert str(e.value).startswith("attention_mask holds 0.5 at sample 1, token 1: expected a 0/1 mask")


def test_input_errors_say_what_to_fix():
    ids = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(ValueError) as e:
        counting.count_samples(MODEL, [[1, 2, 3]], None)
    assert str(e.value) == "input_ids has shape (): expected [B, S]"
    quadratic = CostModel(image_token_id=IMAGE, vision_start_token_id=START, language_weight=0.0,
                          language_quadratic_weight=0.5)
    with pytest.raises(ValueError) as e:
        counting.count_samples(quadratic, ids, None)
    assert str(e.value) == ("attention_mask is missing but language_weight=0.0, language_quadratic_weight=0.5: load "
                            "attention_mask on every rank or set the language cost weights to 0")
    with pytest.raises(ValueError) as e:
        counting.count_samples(MODEL, ids, [[1, 1, 1], [1, 1, 0]])
    assert str(e.value) == ("attention_mask must be a [B, S] tensor; got list: give 1 for real tokens and 0 for "
                            "padding, shape [B, S] like input_ids")
