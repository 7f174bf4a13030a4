"""The self-check's one-launch checksum kernel against the torch ops, bit for bit: random windows
(several micro-batches; dense, per-row, per-image and list fields of int64, int32, bfloat16,
float32, uint8 and bool; odd entry sizes, empty fields and samples, buffers off their word
alignment, fields sharing the last slot, buffers the kernel cannot read summed by torch ops) through Triton's interpreter (a subprocess with
TRITON_INTERPRET=1, when triton is importable), a flipped byte changing exactly its (sample,
field), and the round's self-check with the kernel on both sides. Without triton: the launch
block, the dispatch off CUDA, and the fallback when a launch raises."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reorder.batch import checksum as cs
from reorder.plan.checksums import CHECKED_FIELDS, field_slot, word_width
from reorder.plan.counts import COLUMNS, SampleCounts
from reorder.plan.moves import ByteField
from support.checks import field_owner
from support.kernels import BrokenKernel

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.int64, torch.int32, torch.bfloat16, torch.float32, torch.uint8, torch.bool]
HAS_TRITON = importlib.util.find_spec("triton") is not None


@st.composite
def windows(draw, max_fields=6):
    """(parts, fields): 1-3 micro-batches of 0-3 samples; dense fields [pre, n, k], per-row and
    per-image fields [entries, k] (grid_thw-like int64 [images, 3] among them), maybe a list field
    last; some buffers start off their word alignment."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    many = draw(st.integers(0, 4)) == 0  # more fields than checksum slots: the last ones share a slot
    n_fields = CHECKED_FIELDS + 2 if many else draw(st.integers(1, max_fields))
    spec = []  # (ByteField, dtype, elements per entry)
    for _ in range(n_fields):
        kind = draw(st.sampled_from(["dense", "dense", "row", "image"]))
        dtype = draw(st.sampled_from(DTYPES))
        k = draw(st.integers(0 if kind == "dense" else 1, 5))
        if kind == "image" and draw(st.booleans()):
            dtype, k = torch.int64, 3  # grid_thw
        pre = draw(st.integers(1, 3)) if kind == "dense" else 1
        spec.append((ByteField(kind, pre, k * dtype.itemsize), dtype, k))
    spec.sort(key=lambda s: s[0].kind != "dense")  # byte_fields order: dense fields, then ragged ones
    if draw(st.booleans()):
        spec.append((ByteField("list", 1, 1), torch.uint8, 1))
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, 3))
        counts = SampleCounts.of(rows=rng.integers(0, 4, n), images=rng.integers(0, 3, n),
                                 list_bytes=rng.integers(0, 10, n) * rng.integers(0, 2, n))
        bufs = []
        for (kind, pre, unit), dtype, k in spec:
            if kind == "dense":
                shape = (pre, n, k)
            elif kind == "list":
                shape = (int(counts.list_bytes.sum()),)
            else:
                shape = (int((counts.rows if kind == "row" else counts.images).sum()), k)
            bufs.append(buffer(rng, dtype, shape, offset=int(rng.integers(0, 4))))
        parts.append((bufs, counts))
    return parts, tuple(f for f, _, _ in spec)


def buffer(rng, dtype, shape, offset):
    """A contiguous tensor of random bytes (bools 0/1), `offset` elements into its storage."""
    numel = int(np.prod(shape))
    base = torch.empty(numel + offset, dtype=dtype)
    raw = base.view(torch.uint8)
    raw.copy_(torch.from_numpy(rng.integers(0, 2 if dtype == torch.bool else 256, raw.numel(), dtype=np.uint8)))
    return base[offset:].view(shape)


def check_kernel_interpreted():
    """Runs with TRITON_INTERPRET=1: the kernel's sums of random windows equal the torch ops' bit
    for bit (small blocks and chunks, so pieces span several programs and several steps of one);
    a flipped byte changes exactly its (sample, field) sum; no byte past a short buffer is read;
    and the round's self-check passes a correct exchange and catches a flipped byte with the
    kernel summing both sides."""
    assert os.environ.get("TRITON_INTERPRET") == "1"

    def same_sums_and_one_flip(window, sizes, pick):
        parts, fields = window
        block, chunk = sizes
        got = cs.kernel_checksums(parts, fields, "cpu", interpret=True, block=block, chunk=chunk)
        want = cs.torch_checksums(parts, fields)
        assert got.dtype == torch.int64 and got.shape == want.shape
        assert torch.equal(got, want), (got - want).nonzero()
        fewer = cs.kernel_checksums(parts, fields, "cpu", interpret=True, block=block, chunk=chunk, grid=1 + pick % 3)
        assert torch.equal(fewer, want)  # a grid smaller than the programs: each takes every grid-th
        cs._readable = asked  # placed: the caller vouches for every buffer, none is asked
        try:
            placed = cs.kernel_checksums(parts, fields, "cpu", interpret=True, block=block, chunk=chunk, placed=True)
        finally:
            cs._readable = readable
        assert torch.equal(placed, want)
        where = [(p, f) for p, (bufs, _) in enumerate(parts) for f, t in enumerate(bufs) if t.numel()]
        if not where:
            return
        p, f = where[pick % len(where)]
        flat = parts[p][0][f].view(-1).view(torch.uint8)
        byte = pick % len(flat)
        flat[byte] ^= 1 << (pick % 8)
        again = cs.kernel_checksums(parts, fields, "cpu", interpret=True, block=block, chunk=chunk)
        sample = sum(c.shape[0] for _, c in parts[:p]) + field_owner(fields[f], parts[p][1], byte)
        assert (again != got).nonzero().tolist() == [[sample, field_slot(f)]], (sample, f)

    def some_buffers_unread(window, sizes, skip):
        """Buffers the kernel cannot read (on CUDA: pageable host ones) are summed by torch ops and
        added in; none readable: no launch (None), the caller's torch ops sum the window."""
        parts, fields = window
        block, chunk = sizes
        unread = {id(t) for bufs, _ in parts for i, t in enumerate(bufs) if skip >> i & 1}
        cs._readable = lambda t, device, interpret: id(t) not in unread
        try:
            got = cs.kernel_checksums(parts, fields, "cpu", interpret=True, block=block, chunk=chunk)
        finally:
            cs._readable = readable
        if len(unread) == sum(len(bufs) for bufs, _ in parts):
            assert got is None
        else:
            assert torch.equal(got, cs.torch_checksums(parts, fields))

    def no_byte_past_a_short_buffer(window, sizes, pick):
        """A buffer shorter than its counts: the kernel reads none of the bytes that follow it (the
        same sums whatever they hold), and its sample sums differ from the whole buffer's."""
        parts, fields = window
        block, chunk = sizes
        where = [(p, f) for p, (bufs, _) in enumerate(parts) for f, t in enumerate(bufs)
                 if t.nbytes >= 2 * word_width(fields[f].kind, fields[f].unit)]
        if not where:
            return
        p, f = where[pick % len(where)]
        whole = parts[p][0][f]
        keep = whole.nbytes - word_width(fields[f].kind, fields[f].unit)
        sums = []
        for fill in (0x00, 0xFF):
            base = torch.full((whole.nbytes,), fill, dtype=torch.uint8)
            base[:keep] = whole.reshape(-1).view(torch.uint8)[:keep]
            bufs = list(parts[p][0])
            bufs[f] = base[:keep]
            changed = parts[:p] + [(bufs, parts[p][1])] + parts[p + 1:]
            sums.append(cs.kernel_checksums(changed, fields, "cpu", interpret=True, block=block, chunk=chunk))
        full = cs.kernel_checksums(parts, fields, "cpu", interpret=True, block=block, chunk=chunk)
        assert torch.equal(sums[0], sums[1])
        assert not torch.equal(sums[0], full)

    def long_runs(seed):
        """Runs of many steps that cross entries: rows of 3 words (8 bytes, and 2 bytes read byte by
        byte off their alignment), rows of 70 (wider than a block of 64 lanes), images of 37 words,
        dense rows of 40, in blocks of 16 lanes and more: each lane's entry, word, mixes and address,
        carried from step to step (the next step's words loaded ahead), wrap where they must."""
        rng = np.random.default_rng(seed)
        n = 3
        counts = SampleCounts.of(rows=rng.integers(10, 30, n), images=rng.integers(1, 4, n))
        rows, images = int(counts.rows.sum()), int(counts.images.sum())
        fields = (ByteField("dense", 2, 40 * 8), ByteField("row", 1, 24), ByteField("row", 1, 6),
                  ByteField("row", 1, 70 * 8), ByteField("image", 1, 37 * 4))
        bufs = [buffer(rng, torch.int64, (2, n, 40), 0), buffer(rng, torch.int64, (rows, 3), 0),
                buffer(rng, torch.uint8, (rows, 6), 1), buffer(rng, torch.int64, (rows, 70), 0),
                buffer(rng, torch.int32, (images, 37), 0)]
        parts = [(bufs, counts)]
        want = cs.torch_checksums(parts, fields)
        for block, chunk in [(16, 16), (16, 48), (64, 128)]:
            got = cs.kernel_checksums(parts, fields, "cpu", interpret=True, block=block, chunk=chunk)
            assert torch.equal(got, want), (block, chunk, (got - want).nonzero().tolist())
        for f, t in enumerate(bufs[1:], 1):  # a byte flipped in the last entry: its sample's sum of that field
            t.reshape(-1).view(torch.uint8)[-1] ^= 0x10
            got = cs.kernel_checksums(parts, fields, "cpu", interpret=True, block=16, chunk=48)
            assert (got != want).nonzero().tolist() == [[n - 1, field_slot(f)]], f
            t.reshape(-1).view(torch.uint8)[-1] ^= 0x10

    def asked(t, device, interpret):
        raise AssertionError("a buffer was asked whether the kernel reads it, though placed")

    readable = cs._readable
    t0 = time.perf_counter()
    sizes = st.sampled_from([(16, 16), (16, 48), (64, 128)])
    run = settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    run(given(windows(), sizes, st.integers(0, 2**20))(same_sums_and_one_flip))()
    run(given(windows(max_fields=4), sizes, st.integers(0, 2**20))(some_buffers_unread))()
    run(given(windows(max_fields=4), sizes, st.integers(0, 2**20))(no_byte_past_a_short_buffer))()
    for seed in range(4):
        long_runs(seed)
    print(f"property: {time.perf_counter() - t0:.1f} s")
    check_round_interpreted()


def check_round_interpreted():
    """The round's self-check with the kernel (interpreted) summing both the senders' and the
    receivers' sides: a correct exchange passes, one byte flipped by the executor is caught."""
    import functools

    import test_self_check as sc

    from reorder import ReorderError
    from reorder.exchange import round as round_module

    round_module.window_checksums = functools.partial(cs.window_checksums, interpret=True)
    calls, lock = [], threading.Lock()
    kernel = cs._kernel()

    class Serialized:  # the emulated ranks are threads; Triton's interpreter patches triton.language per launch
        def __getitem__(self, grid):
            def launch(*args, **meta):
                with lock:
                    calls.append(grid)
                    kernel[grid](*args, **meta)
            return launch

    cs._KERNEL[0] = Serialized()
    t0 = time.perf_counter()
    res = sc.stream({"vision": 1, "language": 2}, seed=5)
    assert all(not isinstance(r, BaseException) for rs in res.values() for r in rs), res
    assert calls and isinstance(cs._KERNEL[0], Serialized)  # the kernel summed, and never failed
    res = sc.stream({"vision": 1, "language": 2}, seed=6, faulty=("language", 1), fault="flip")
    assert all(isinstance(e, ReorderError) and "self-check failed" in str(e) for e in res["language"]), res
    assert isinstance(cs._KERNEL[0], Serialized)
    print(f"round: {time.perf_counter() - t0:.1f} s, {len(calls)} launches")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed (pip install triton==3.9.0 to run the kernel in "
                                           "its interpreter)")
def test_checksum_kernel_in_interpreter():
    here = Path(__file__).resolve().parent
    path = [str(ROOT), str(here), str(here.parent / "exchange"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", "import test_triton_checksum as t; t.check_kernel_interpreted()"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    print(res.stdout, f"interpreted checksum kernel: {time.perf_counter() - t0:.1f} s")


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_checksum_kernel_specializes_only_what_stays_fixed():
    """The offsets and sizes change with every window: they travel in the block's header, not as
    arguments (Triton would specialize them, compiling a new variant mid-run). The block is the
    only runtime argument; the output words per sample, the chunk, the lanes and the samples'
    power of two stay fixed."""
    from reorder.batch.triton_checksum import checksum_window

    assert [p.name for p in checksum_window.params if not p.is_constexpr] == ["block"]
    assert {p.name for p in checksum_window.params if p.is_constexpr} == {"SLOTS", "CHUNK", "BLOCK", "SAMPLES"}


# --- without triton ---------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(windows(), st.sampled_from([16, 48, 1024]))
def test_the_launch_block_gives_every_buffer_its_words_and_programs(window, chunk):
    """Per buffer (field b % F of part b // F): its address, its bytes (0 where the kernel does not
    read it), its part's first sample and samples, and ceil(words / chunk) programs from the first
    program of the buffers before it; per field its kind, sizes, word width, salt, slot and counts
    column."""
    parts, fields = window
    readable = [[t.is_contiguous() and (p + f) % 3 != 1 for f, t in enumerate(bufs)] for p, (bufs, _) in enumerate(parts)]
    block, programs, at = cs.launch_block(parts, fields, readable, chunk)
    rows = block[at["bufs_at"]:at["fields_at"]].reshape(-1, 4).tolist()
    want, first, row0 = [], [0], 0
    for (bufs, counts), r in zip(parts, readable):
        n = counts.shape[0]
        for f, ((kind, pre, unit), t, ok) in enumerate(zip(fields, bufs, r)):
            size = t.nbytes if ok else 0
            want.append([t.data_ptr(), size, row0, n])
            first.append(first[-1] + -(-(size // word_width(kind, unit)) // chunk))
        row0 += n
    header = [len(want), len(fields), at["programs_at"], at["bufs_at"], at["fields_at"], at["counts_at"], at["out_at"],
              len(COLUMNS)]
    assert block[:8].tolist() == header and at["programs_at"] == 8 and at["bufs_at"] == 8 + len(first)
    assert block.dtype == np.int64 and rows == want and block[8:at["bufs_at"]].tolist() == first
    assert programs == first[-1]
    every = cs.launch_block(parts, fields, [[True] * len(bufs) for bufs, _ in parts], chunk)
    vouched = cs.launch_block(parts, fields, None, chunk)  # None: every buffer read, as if all were readable
    assert vouched[0].tolist() == every[0].tolist() and vouched[1:] == every[1:]
    kinds = {"dense": 0, "row": 1, "image": 1, "list": 2}
    column = {"row": "rows", "image": "images", "list": "list_bytes"}
    assert block[at["fields_at"]:at["counts_at"]].reshape(-1, 8).tolist() == [
        [kinds[kind], pre, unit, word_width(kind, unit), (f - CHECKED_FIELDS + 1) * 2**32 if f >= CHECKED_FIELDS else 0,
         field_slot(f), COLUMNS.index(column[kind]) if kind in column else 0, 0] for f, (kind, pre, unit) in enumerate(fields)]


def test_off_cuda_the_window_is_summed_by_torch_ops(monkeypatch):
    """On the CPU (no interpreter) the kernel is not called; the sums are each micro-batch's
    `checksums`, part after part."""
    calls = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *a, **k: calls.append(grid)

    monkeypatch.setattr(cs, "_KERNEL", [Kernel()])
    parts, fields = _small_window()
    got = cs.window_checksums(parts, fields, torch.device("cpu"))
    want = torch.cat([cs.checksums(bufs, fields, counts) for bufs, counts in parts])
    assert torch.equal(got, want) and calls == []
    assert cs.kernel_checksums(parts, fields, "cpu") is None and calls == []
    monkeypatch.setattr(cs, "_INTERPRETER", True)  # TRITON_INTERPRET=1: a CUDA launch would read device addresses on the host
    assert cs.kernel_checksums(parts, fields, "cuda") is None and calls == []


def test_a_kernel_that_fails_leaves_the_sums_to_the_torch_ops(monkeypatch, caplog):
    """A launch that raises (e.g. no Triton compiler for the GPU) is logged once; the sums come from
    the torch ops, then and from then on (the kernel is not tried again)."""
    broken = BrokenKernel()
    monkeypatch.setattr(cs, "_KERNEL", [broken])
    parts, fields = _small_window()
    want = cs.torch_checksums(parts, fields)
    with caplog.at_level("WARNING", logger="reorder"):
        assert torch.equal(cs.window_checksums(parts, fields, "cpu", interpret=True), want)
        assert torch.equal(cs.window_checksums(parts, fields, "cpu", interpret=True), want)
    assert len(broken.launches) == 1 and cs._KERNEL == [None]
    assert [r.message for r in caplog.records] == [
        "reorder: the Triton checksum kernel failed (RuntimeError: no compiler for this GPU); the self-check sums "
        "with torch ops from now on"]


def _small_window():
    rng = np.random.default_rng(1)
    counts = SampleCounts.of(rows=np.array([2, 0, 1]), images=np.array([1, 0, 1]), list_bytes=np.array([3, 0, 5]))
    fields = (ByteField("dense", 2, 12), ByteField("row", 1, 6), ByteField("image", 1, 24), ByteField("list", 1, 1))
    parts = []
    for _ in range(2):
        bufs = [buffer(rng, torch.int32, (2, 3, 3), 0), buffer(rng, torch.bfloat16, (3, 3), 1),
                buffer(rng, torch.int64, (2, 3), 0), buffer(rng, torch.uint8, (8,), 3)]
        parts.append((bufs, counts))
    return parts, fields


def test_a_kernel_whose_first_window_differs_from_the_torch_ops_is_replaced(monkeypatch, caplog):
    """A kernel that launches but sums wrong (a compiler or GPU it never ran on) must not make the
    self-check report a mismatch of its own: its first window is compared with the torch ops, the
    torch sums are returned, a warning is logged once and the kernel is not called again."""
    parts, fields = _small_window()
    want = cs.torch_checksums(parts, fields)
    wrong = []

    def off_by_one(parts_, fields_, device, *, host=False, interpret=False, graphs=None, placed=False):
        wrong.append(device)
        return (want + 1).numpy() if host else want + 1

    monkeypatch.setattr(cs, "kernel_checksums", lambda *a, **k: off_by_one(*a, **k) if cs._KERNEL[0] else None)
    for host in (False, True):  # the sums where they were summed, or in host memory (numpy)
        monkeypatch.setattr(cs, "_KERNEL", [object()])
        monkeypatch.setattr(cs, "_KERNEL_AGREED", [])
        wrong.clear()
        caplog.clear()
        with caplog.at_level("WARNING", logger="reorder"):
            for _ in range(2):
                got = cs.window_checksums(parts, fields, "cpu", host=host)
                assert isinstance(got, np.ndarray if host else torch.Tensor) and got.tolist() == want.tolist()
        assert len(wrong) == 1 and cs._KERNEL == [None] and cs._KERNEL_AGREED == []
        assert [r.message for r in caplog.records] == [
            "reorder: the Triton checksum kernel's first window differs from the torch ops' sums; the self-check "
            "sums with torch ops from now on"]


def test_a_kernel_that_agrees_on_its_first_window_is_compared_only_then(monkeypatch):
    """After one agreeing window the kernel's sums are returned as they are (no second torch sum)."""
    parts, fields = _small_window()
    want = cs.torch_checksums(parts, fields)
    compared = []
    real = cs.torch_checksums
    monkeypatch.setattr(cs, "torch_checksums", lambda p, f: compared.append(1) or real(p, f))
    monkeypatch.setattr(cs, "kernel_checksums", lambda *a, **k: want.clone())
    monkeypatch.setattr(cs, "_KERNEL", [object()])
    monkeypatch.setattr(cs, "_KERNEL_AGREED", [])
    for _ in range(3):
        assert torch.equal(cs.window_checksums(parts, fields, "cpu"), want)
    assert compared == [1] and cs._KERNEL_AGREED == [True]
