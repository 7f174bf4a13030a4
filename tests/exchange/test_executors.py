"""Segment-copy executors against a slow oracle written here (bytearray slicing per segment): random
buffer sets (several dtypes incl. bfloat16, odd sizes, unaligned start addresses and offsets) and
random tables of non-overlapping destination segments. The Triton kernel itself runs on CPU through
Triton's interpreter, in a subprocess with TRITON_INTERPRET=1, when triton is importable."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reorder.plan.segments import FIELDS
import reorder.exchange as exchange_pkg
from reorder.exchange import executors as ex
from reorder.exchange.executors import (Executor, Segments, TorchExecutor, check_bounds, launch_table,
                                        select_executor, word_width)

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.uint8, torch.bool, torch.int16, torch.bfloat16, torch.float16, torch.int32, torch.float32,
          torch.int64, torch.float64]


class Buffers:
    """Typed buffers over known bytes: `raw[i]` is a uint8 tensor sharing memory with `typed[i]`, so
    the oracle reads and compares bytes without going through the code under test."""

    def __init__(self, specs, rng):
        self.raw, self.typed = [], []
        for dtype, count, lead in specs:  # lead > 0 only for uint8: an unaligned start address
            size = count * dtype.itemsize
            base = torch.empty(lead + size, dtype=torch.uint8)  # (from_numpy gives stride 0 when empty)
            base.copy_(torch.from_numpy(rng.integers(0, 256, lead + size, dtype=np.uint8)))
            raw = base[lead:]
            if dtype == torch.bool:  # only the bytes 0 and 1 are bools
                raw &= 1
            self.raw.append(raw)
            self.typed.append(raw.view(dtype) if dtype != torch.uint8 else raw)

    def as_bytes(self):
        return [bytearray(r.numpy().tobytes()) for r in self.raw]


def oracle(segments, src_bytes, dst_bytes):
    """The copy, one Python slice assignment per segment."""
    out = [bytearray(b) for b in dst_bytes]
    for sb, so, db, do, n in zip(*(getattr(segments, f).tolist() for f in FIELDS)):
        out[db][do:do + n] = src_bytes[sb][so:so + n]
    return out


@st.composite
def buffer_specs(draw, max_count):
    dtype = draw(st.sampled_from(DTYPES))
    count = draw(st.integers(0, max_count))
    lead = draw(st.integers(0, 15)) if dtype == torch.uint8 else 0
    return dtype, count, lead


@st.composite
def problems(draw, max_count=300):
    """(seed, source specs, destination specs, segments): destination intervals cut from sorted
    points of each destination buffer (hence disjoint), each read from a random source that fits."""
    src_specs = draw(st.lists(buffer_specs(max_count), min_size=1, max_size=3))
    dst_specs = draw(st.lists(buffer_specs(max_count), min_size=1, max_size=3))
    src_sizes = [c * d.itemsize for d, c, _ in src_specs]
    rows = []
    for db, (dtype, count, _) in enumerate(dst_specs):
        size = count * dtype.itemsize
        cuts = sorted(draw(st.lists(st.integers(0, size), max_size=12)) + [0, size])
        for a, b in zip(cuts[:-1], cuts[1:]):
            if not draw(st.booleans()):
                continue
            fits = [i for i, s in enumerate(src_sizes) if s >= b - a]
            if not fits:
                continue
            sb = draw(st.sampled_from(fits))
            rows.append((sb, draw(st.integers(0, src_sizes[sb] - (b - a))), db, a, b - a))
    if draw(st.booleans()):  # a zero-byte segment anywhere is skipped
        rows.append((0, src_sizes[0], 0, 0, 0))
    rows = draw(st.permutations(rows))
    segs = Segments.of(*(np.array([r[k] for r in rows], dtype=np.int64) for k in range(5)))
    return draw(st.integers(0, 2**32 - 1)), src_specs, dst_specs, segs


def run_against_oracle(executor: Executor, problem):
    seed, src_specs, dst_specs, segs = problem
    rng = np.random.default_rng(seed)
    src, dst = Buffers(src_specs, rng), Buffers(dst_specs, rng)
    want = oracle(segs, src.as_bytes(), dst.as_bytes())
    before = src.as_bytes()
    executor.run(segs, src.typed, dst.typed)
    assert dst.as_bytes() == want
    assert src.as_bytes() == before


@pytest.mark.parametrize("gather_below_words, gather_min_segments", [(0, 1), (4, 1), (1 << 30, 1), (1 << 30, 3)],
                         ids=["all-copy", "mixed", "all-gather", "gather-groups-of-3"])
@given(problem=problems())
def test_torch_executor_matches_oracle(gather_below_words, gather_min_segments, problem):
    run_against_oracle(TorchExecutor(gather_below_words, gather_min_segments), problem)


@pytest.mark.parametrize("min_segments, gathered", [(1, [3, 1]), (2, [3]), (4, [])])
def test_torch_executor_gathers_only_groups_of_enough_small_segments(monkeypatch, min_segments, gathered):
    """Three small segments from source 0 and one from source 1 (one destination, one width): a
    group is gathered only when it holds at least `gather_min_segments`; the rest are copied one by
    one. The bytes are the oracle's either way."""
    calls = []
    real = TorchExecutor._gather_small
    monkeypatch.setattr(TorchExecutor, "_gather_small", staticmethod(
        lambda s, w, sb, db: calls.extend(np.bincount(s.src_buf, minlength=2)[np.unique(s.src_buf)].tolist())
        or real(s, w, sb, db)))
    rng = np.random.default_rng(2)
    src, dst = Buffers([(torch.int64, 64, 0), (torch.int64, 64, 0)], rng), Buffers([(torch.int64, 64, 0)], rng)
    segs = Segments.of(np.array([0, 0, 0, 1]), np.array([0, 64, 256, 8]), np.zeros(4, np.int64),
                       np.array([0, 64, 128, 256]), np.full(4, 32))
    want = oracle(segs, src.as_bytes(), dst.as_bytes())
    TorchExecutor(gather_below_words=512, gather_min_segments=min_segments).run(segs, src.typed, dst.typed)
    assert dst.as_bytes() == want
    assert calls == gathered


def test_torch_executor_default_threshold_mixes_big_and_small(monkeypatch):
    """Defaults, sizes where both the copy_ and the gathered path run (a group of 15 small segments
    from the unaligned source), several word widths."""
    gathered = []
    real = TorchExecutor._gather_small
    monkeypatch.setattr(TorchExecutor, "_gather_small",
                        staticmethod(lambda s, w, sb, db: gathered.append(len(s)) or real(s, w, sb, db)))
    rng = np.random.default_rng(7)
    src = Buffers([(torch.bfloat16, 300_000, 0), (torch.uint8, 50_001, 3)], rng)
    dst = Buffers([(torch.float32, 200_000, 0)], rng)
    sizes = np.array([100_000, 64, 8, 3, 2000, 150_001, 16, 1, 4096] + [20] * 12)
    dst_off = np.concatenate([[0], np.cumsum(sizes + 5)[:-1]])
    src_buf = np.array([0, 0, 1, 1, 0, 0, 1, 0, 0] + [1] * 12)
    src_off = np.array([16, 1000, 5, 777, 2, 200_000, 40_000, 9, 64] + [100 + 50 * k for k in range(12)])
    segs = Segments.of(src_buf, src_off, np.zeros(len(sizes), np.int64), dst_off, sizes)
    want = oracle(segs, src.as_bytes(), dst.as_bytes())
    TorchExecutor().run(segs, src.typed, dst.typed)
    assert dst.as_bytes() == want
    assert gathered == [15]


def test_word_views_respect_the_storage_offset():
    """An 8-byte aligned address 4 bytes into a storage that starts 4 bytes off alignment: words of
    8 bytes would fail `view(torch.int64)`, so the gathered path takes 4-byte words."""
    arr = np.arange(256, dtype=np.uint8)
    arr = arr[(4 - arr.ctypes.data) % 8:][:200]  # storage start = 4 (mod 8)
    src = torch.from_numpy(arr)[4:]
    assert src.data_ptr() % 8 == 0 and src.storage_offset() == 4
    dst = torch.zeros(64, dtype=torch.int64)
    TorchExecutor().run(Segments.of([0], [0], [0], [8], [64]), [src], [dst])
    assert dst.view(torch.uint8)[8:72].tolist() == arr[4:68].tolist()


@given(problem=problems())
def test_merged_table_copies_the_same_bytes(problem):
    seed, src_specs, dst_specs, segs = problem
    rng = np.random.default_rng(seed)
    src, dst = Buffers(src_specs, rng), Buffers(dst_specs, rng)
    m = segs.merged()
    assert m.total_bytes == segs.total_bytes and len(m) <= len(segs) and (m.nbytes > 0).all()
    assert oracle(m, src.as_bytes(), dst.as_bytes()) == oracle(segs, src.as_bytes(), dst.as_bytes())
    for i in range(len(m) - 1):  # maximal: no two consecutive rows could be fused further
        assert not (m.src_buf[i] == m.src_buf[i + 1] and m.dst_buf[i] == m.dst_buf[i + 1]
                    and m.src_off[i] + m.nbytes[i] == m.src_off[i + 1]
                    and m.dst_off[i] + m.nbytes[i] == m.dst_off[i + 1])


def test_merged_fuses_a_split_copy_and_keeps_breaks():
    # one 100-byte copy cut into 4 shuffled pieces + an empty row, and a piece whose source jumps
    segs = Segments.of(src_buf=[0, 0, 0, 0, 0, 0], src_off=[50, 10, 30, 0, 90, 500],
                       dst_buf=[1, 1, 1, 1, 1, 1], dst_off=[60, 20, 40, 10, 0, 110], nbytes=[50, 20, 20, 10, 0, 7])
    m = segs.merged()
    assert [m.src_off.tolist(), m.dst_off.tolist(), m.nbytes.tolist()] == [[0, 500], [10, 110], [100, 7]]
    assert len(Segments.empty().merged()) == 0


@pytest.mark.parametrize("field", FIELDS)
def test_validation_names_the_field_and_value(field):
    good = {f: np.zeros(3, np.int64) for f in FIELDS}
    bad = dict(good, **{field: np.array([0, -7, 1], np.int64)})
    with pytest.raises(ValueError, match=rf"Segments\.{field}\[1\] = -7 is negative"):
        Segments(**bad)
    with pytest.raises(ValueError, match=rf"Segments\.{field} must be a one-dimensional int64 .* got int32"):
        Segments(**dict(good, **{field: np.zeros(3, np.int32)}))
    with pytest.raises(ValueError, match=rf"Segments\.{field} .*got .*shape \(3, 1\)"):
        Segments(**dict(good, **{field: np.zeros((3, 1), np.int64)}))
    with pytest.raises(ValueError, match=rf"Segments\.{field} must hold integers, got dtype float64"):
        Segments.of(**dict(good, **{field: [0.0, 1.5, 2.0]}))
    if field != "src_buf":
        with pytest.raises(ValueError, match=rf"Segments\.{field} has length 4, src_buf has length 3"):
            Segments(**dict(good, **{field: np.zeros(4, np.int64)}))


def test_bounds_are_checked_before_copying():
    src, dst = [torch.zeros(10, dtype=torch.int16)], [torch.zeros(7, dtype=torch.uint8)]
    with pytest.raises(ValueError, match=r"Segments\.src_buf\[0\] = 1: only 1 src buffers"):
        check_bounds(Segments.of([1], [0], [0], [0], [1]), src, dst)
    with pytest.raises(ValueError, match=r"Segments\.src_off\[1\] = 15 \+ nbytes 6 exceeds src buffer 0 of 20 bytes"):
        check_bounds(Segments.of([0, 0], [0, 15], [0, 0], [0, 1], [1, 6]), src, dst)
    with pytest.raises(ValueError, match=r"Segments\.dst_off\[0\] = 2 \+ nbytes 6 exceeds dst buffer 0 of 7"):
        TorchExecutor().run(Segments.of([0], [0], [0], [2], [6]), src, dst)
    with pytest.raises(ValueError, match="contiguous"):
        check_bounds(Segments.empty(), [torch.zeros(4, 4).t()], dst)
    assert not dst[0].any()


def test_word_width():
    assert word_width(np.array([0, 1, 2, 4, 8, 16, 24, 12]), 0).tolist() == [8, 1, 2, 4, 8, 8, 8, 4]
    assert word_width(np.array([16, 16]), np.array([3, 6]), 64).tolist() == [1, 2]


@given(problem=problems(max_count=2000), block=st.sampled_from([64, 128, 1024]))
def test_launch_table_blocks_tile_every_segment(problem, block):
    """Each non-empty segment is covered by consecutive blocks [start, start + block) clipped to it."""
    _, src_specs, dst_specs, segs = problem
    rng = np.random.default_rng(0)
    src, dst = Buffers(src_specs, rng), Buffers(dst_specs, rng)
    table, n, blocks = launch_table(segs, *check_bounds(segs, src.typed, dst.typed), block)
    live = segs.take(segs.nbytes > 0)
    blk, rows = table[:2 * blocks].reshape(blocks, 2), table[2 * blocks:].reshape(n, 3)
    assert n == len(live) and len(table) == 3 * n + 2 * blocks
    assert (rows[:, 0] == [src.typed[b].data_ptr() + o for b, o in zip(live.src_buf, live.src_off)]).all()
    assert (rows[:, 1] == [dst.typed[b].data_ptr() + o for b, o in zip(live.dst_buf, live.dst_off)]).all()
    assert (rows[:, 2] == live.nbytes).all()
    for i, nb in enumerate(live.nbytes.tolist()):
        assert blk[blk[:, 0] == i, 1].tolist() == list(range(0, nb, block))


def test_select_executor_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(ex, "_NOTICES", set())
    with caplog.at_level(logging.INFO, logger="reorder"):
        assert isinstance(select_executor("cpu"), TorchExecutor)
        assert isinstance(select_executor(torch.device("cpu")), Executor)
    assert [r.getMessage() for r in caplog.records] == [
        "reorder: segment copies on cpu run the torch executor: cpu device (the Triton kernel needs CUDA)"]


def test_select_executor_without_triton_falls_back(caplog, monkeypatch):
    monkeypatch.setattr(ex, "_NOTICES", set())
    monkeypatch.setitem(sys.modules, "reorder.exchange.triton_copy", None)  # import fails as if absent
    monkeypatch.delattr(exchange_pkg, "triton_copy", raising=False)  # an earlier import left it on the package
    with caplog.at_level(logging.INFO, logger="reorder"):
        assert select_executor("cuda:0").name == "torch"
        select_executor("cuda:1")
    assert len(caplog.records) == 1 and "run the torch executor: triton not installed" in caplog.text


def test_triton_executor_refuses_buffers_it_cannot_address():
    triton_ex = object.__new__(ex.TritonExecutor)  # the device check alone: no triton needed
    triton_ex.interpret = False
    segs = Segments.of([0], [0], [0], [0], [4])
    with pytest.raises(ValueError, match="destination 0 is on cpu; all destinations must be on one cuda device"):
        triton_ex._check_devices(segs, segs.nbytes > 0, [torch.zeros(4)], [torch.zeros(4)])
    triton_ex.interpret = True  # interpreted: CPU destinations; a source elsewhere is refused
    with pytest.raises(ValueError, match="source 1 is on meta"):
        triton_ex._check_devices(Segments.of([0, 1], [0, 0], [0, 0], [0, 4], [4, 4]), np.array([True, True]),
                                 [torch.zeros(4), torch.zeros(4, device="meta")], [torch.zeros(4)])


def test_triton_executor_falls_back_to_torch_when_a_launch_fails(caplog):
    """A kernel launch that raises is logged once; the run is carried out by the torch executor,
    byte for byte, and so is every later run (the kernel is not tried again)."""
    from support.kernels import BrokenKernel

    triton_ex = object.__new__(ex.TritonExecutor)  # no triton needed: the kernel is the broken one
    triton_ex.interpret, triton_ex.block_bytes, triton_ex.num_warps = True, 64, 4
    triton_ex._kernel, triton_ex._fallback = BrokenKernel(), None
    rng = np.random.default_rng(3)
    with caplog.at_level("WARNING", logger="reorder"):
        for _ in range(2):
            src = Buffers([(torch.uint8, 1000, 0)], rng)
            dst = Buffers([(torch.float64, 125, 0)], rng)
            segs = Segments.of([0, 0], [3, 500], [0, 0], [3, 300], [290, 333])
            want = oracle(segs, src.as_bytes(), dst.as_bytes())
            triton_ex.run(segs, src.typed, dst.typed)
            assert dst.as_bytes() == want
    assert len(triton_ex._kernel.launches) == 1 and isinstance(triton_ex._fallback, TorchExecutor)
    assert caplog.text.count("Triton copy kernel failed (RuntimeError: no compiler for this GPU)") == 1


def test_benchmark_runs_on_cpu(tmp_path):
    """bench/executors.py at toy size: every result byte-exact, the JSON has a row per scenario."""
    spec = importlib.util.spec_from_file_location("bench_executors", ROOT / "bench" / "executors.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "executors.json"
    assert bench.main(["--device", "cpu", "--mib", "1", "--segments", "30", "--reps", "2", "--warmup", "0",
                       "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and len(r["scenarios"]) == 2
    for row in r["scenarios"]:
        assert row["segments"] == 30 and set(row["results"]) == {"torch", "contiguous"}
        assert all(v["exact"] and v["device_ms"] > 0 for v in row["results"].values())


# --- the Triton kernel through Triton's interpreter (CPU) -------------------------------------------

def check_triton_interpreted():
    """Runs in a subprocess with TRITON_INTERPRET=1: the kernel on CPU tensors against the oracle,
    blocks small enough that segments span several, and every relative alignment path."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for block in (64, 256):
        executor = ex.TritonExecutor(block_bytes=block)
        for rel in (0, 1, 2, 3, 4, 6, 8, 16, 17):  # 16-byte words, bytes, int16, bytes, int32, ...
            src = Buffers([(torch.uint8, 1000, 0)], np.random.default_rng(rel))
            dst = Buffers([(torch.float64, 125, 0)], np.random.default_rng(rel + 1))
            segs = Segments.of([0, 0, 0], [3 + rel, 500, 900], [0, 0, 0], [3, 300, 800], [290, 333, 40])
            want = oracle(segs, src.as_bytes(), dst.as_bytes())
            executor.run(segs, src.typed, dst.typed)
            assert dst.as_bytes() == want, (block, rel)
    settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))(
        given(problem=problems(), block=st.sampled_from([64, 128, 4096]))(
            lambda problem, block: run_against_oracle(ex.TritonExecutor(block_bytes=block), problem)))()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_copy_kernel_does_not_specialize_the_table_offset():
    """rows_at (twice the table's block count) changes with every table: left to Triton's default
    integer specialization, a run would compile a second variant of the kernel the first time it is
    a multiple of 16 (or not): a stall of about half a second mid-training."""
    from reorder.exchange.triton_copy import copy_segments

    assert {p.name for p in copy_segments.params if p.do_not_specialize} == {"rows_at"}


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton not installed (pip install triton==3.9.0 to run the kernel in its interpreter)")
def test_triton_kernel_in_interpreter():
    path = [str(ROOT), str(Path(__file__).resolve().parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))
    code = "import test_executors as t, triton; print(triton.__version__); t.check_triton_interpreted()"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    print(f"interpreted kernel checks, triton {res.stdout.split()[0]}: {time.perf_counter() - t0:.1f} s")
