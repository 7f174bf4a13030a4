"""ReorderingBuffer with overlap: how far the worker runs ahead of the consumer (GPU memory bound)."""

import re
import threading
import time

import numpy as np
import pytest

import faults
from reorder import CostModel, ReorderError, WindowExchanger
from reorder.cli import synthetic as syn
from reorder.runtime.buffer import ReorderingBuffer
from reorder.plan.grid import Grid


@pytest.mark.parametrize("ahead", [1, 2])
def test_worker_prepares_at_most_ahead_windows_beyond_the_consumer(ahead):
    rng = np.random.default_rng(0)
    W, n = 2, 12
    batches = [syn.make_global_batch(rng, 4, 64, features=4, mix="small", first_id=4 * k) for k in range(n)]
    pulled, lock = [0], threading.Lock()

    def source():
        for b in batches:
            with lock:
                pulled[0] += 1
            yield b

    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, window_size=W,
                         cost=CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START))
    seen, worst = [], 0
    with ReorderingBuffer(source(), ex, overlap=True, ahead=ahead) as buf:
        for k, mb in enumerate(buf):
            seen += mb["sample_id"].tolist()
            time.sleep(0.02)  # a slow consumer: the worker has every chance to run ahead
            windows_done = (k + 1) // W  # windows whose last micro-batch the consumer has taken
            with lock:
                worst = max(worst, pulled[0] - windows_done * W)
    assert sorted(seen) == list(range(4 * n))  # every sample exactly once
    assert worst == ahead * W  # it does run ahead, and never further


def test_ahead_must_be_a_positive_integer():
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, cost=CostModel())
    with pytest.raises(ValueError, match="ahead=0 is invalid"):
        ReorderingBuffer(iter([]), ex, overlap=True, ahead=0)


def test_worker_keeps_no_reference_to_a_window_it_handed_over():
    """While the worker prepares the next window, the micro-batches it already queued are referenced
    only by the consumer: dropped there, they are freed (GPU memory: one window less resident)."""
    import gc
    import weakref

    gate = threading.Event()

    def source():  # fresh micro-batches that nothing else references; the third one waits for `gate`
        rng = np.random.default_rng(1)
        for k in range(4):
            if k == 2:
                gate.wait(10)
            yield syn.make_global_batch(rng, 4, 64, features=4, mix="small", first_id=4 * k)

    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4,
                         cost=CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START))
    with ReorderingBuffer(source(), ex, overlap=True) as buf:
        next(buf)
        mb = next(buf)  # the worker now reads the third micro-batch and waits in the source
        ref = weakref.ref(mb["input_ids"])
        del mb
        time.sleep(0.2)
        gc.collect()
        alive = ref() is not None
        gate.set()
        rest = list(buf)
    assert not alive and len(rest) == 2


def test_reordered_micro_batches_are_freed_without_the_garbage_collector():
    """Dropping a reordered micro-batch frees its buffer at once (reference counting): nothing in the
    exchange keeps it in a reference cycle, where device memory would wait for a gc pass (and, with
    overlap, for the training stream that recorded it)."""
    import gc
    import weakref

    rng = np.random.default_rng(2)
    g = syn.make_global_batch(rng, 8, 64, features=4, mix="small")
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=8,
                         cost=CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START))
    gc.collect()
    gc.disable()
    try:
        out, rep = ex.exchange([g])
        assert (rep.orders != np.arange(8)).any()  # permuted: the output is a new buffer
        refs = [weakref.ref(t) for t in (out[0]["input_ids"], out[0]["modality_inputs"]["images"]["vit"]["hidden_states"])]
        del out
        assert [r() for r in refs] == [None, None]
    finally:
        gc.enable()


def _gated_exchanger(calls):
    """dp-1 exchanger whose gate keeps every window (so the backoff skips 1, 2, 4, 4, ... windows after
    planned ones); records (thread name, skipped) per exchanged window in `calls`."""
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, min_saving=1e18, gate_backoff=4,
                         cost=CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START))
    inner = ex.exchange

    def exchange(batches, error=None):
        out, rep = inner(batches, error)
        if rep is not None:
            calls.append((threading.current_thread().name, rep.skipped))
        return out, rep
    ex.exchange = exchange
    return ex


def test_overlap_hands_skipped_windows_to_the_consumer_and_planned_ones_to_the_worker():
    rng = np.random.default_rng(3)
    n = 16
    batches = [syn.make_global_batch(rng, 4, 64, features=4, mix="small", first_id=4 * k) for k in range(n)]
    calls = []
    with ReorderingBuffer(iter(batches), _gated_exchanger(calls), overlap=True) as buf:
        seen = [mb["sample_id"].tolist() for mb in buf]
        assert not buf.worker_alive
    assert seen == [b["sample_id"].tolist() for b in batches]  # natural order, every sample once
    skipped = [s for _, s in calls]
    assert skipped == [False, True, False, True, True, False] + [True] * 4 + [False] + [True] * 4 + [False]
    assert {t for t, s in calls if s} == {threading.main_thread().name}
    assert {t for t, s in calls if not s} == {"reorder-overlap"}


@pytest.mark.parametrize("case", [None, *faults.cases("buffer")], ids=lambda c: "end" if c is None else c.name)
def test_a_run_of_skipped_windows_on_the_consumer_ends_or_raises_and_stops_the_worker(case):
    """The stream ends (case None) or the source raises (the fault records of tests/faults.py)."""
    rng = np.random.default_rng(4)

    def source():
        for k in range(4):  # windows 0 (planned), 1 (skipped), 2 (planned), 3 (skipped), then 4 ends or raises
            yield syn.make_global_batch(rng, 4, 64, features=4, mix="small", first_id=4 * k)
        if case is not None:
            raise case.params["source_error"]

    buf = ReorderingBuffer(source(), _gated_exchanger([]), overlap=True)
    got = [next(buf) for _ in range(4)]
    if case is None:
        with pytest.raises(StopIteration):
            next(buf)
    else:
        with pytest.raises(ReorderError) as e:
            next(buf)
        (seen,) = case.sees
        seen.check(e.value)
    assert len(got) == 4 and not buf.worker_alive
    buf.close()


@pytest.mark.parametrize("all_ranks", [False, True])
def test_log_every_names_module_and_rank_and_logs_on_dp_rank_0(caplog, all_ranks):
    import logging

    from reorder.exchange.collectives import run_emulated

    rng = np.random.default_rng(5)
    batches = [syn.make_global_batch(rng, 4, 64, features=4, mix="small", first_id=4 * k) for k in range(4)]
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=4, cost=cost, collectives=coll)
        with ReorderingBuffer((syn.rank_share(b, 2, r) for b in batches), ex, log_every=2, log_module="vision",
                              log_all_ranks=all_ranks) as buf:
            return len(list(buf))

    with caplog.at_level(logging.INFO, logger="reorder"):
        assert run_emulated(2, fn, timeout=30) == [4, 4]
    # the window lines (the executor's choice is logged once per process, by whichever test is first)
    lines = sorted(m for r in caplog.records if r.name == "reorder" and ": spread" in (m := r.getMessage()))
    ranks = [0, 1] if all_ranks else [0]
    assert [line.split(": spread")[0] for line in lines] == sorted(
        f"vision dp rank {r} of 2, window {w}" for r in ranks for w in (2, 4))


@pytest.mark.parametrize("verify", [0, 1])
def test_the_window_log_line_says_how_many_windows_the_self_check_found_intact(caplog, verify):
    import logging

    from reorder.exchange.collectives import run_emulated

    rng = np.random.default_rng(5)
    batches = [syn.make_global_batch(rng, 8, 256, features=4, mix="large", first_id=8 * k, scale=0.05)
               for k in range(4)]
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=8, cost=cost, collectives=coll,
                             balancer="lpt", verify=verify)
        seen = []
        with ReorderingBuffer((syn.rank_share(b, 2, r) for b in batches), ex, log_every=1) as buf:
            for _ in buf:
                seen.append(ex.verified_windows)
                assert (buf.verified_windows, buf.verified_samples) == (ex.verified_windows, ex.verified_samples)
        return seen, ex.verified_windows

    with caplog.at_level(logging.INFO, logger="reorder"):
        (seen, total), _ = run_emulated(2, fn, timeout=30)
    lines = [m for r in caplog.records if r.name == "reorder" and ": spread" in (m := r.getMessage())]
    told = [re.search(r"self-check: (\d+) windows \((\d+) samples\) intact", line) for line in lines]
    assert len(lines) == 4
    if not verify:
        assert told == [None] * 4 and total == 0
        return
    assert all(told) and total > 0
    # each line is logged as its window is handed out: the windows verified by then, 8 samples each
    assert [(int(t[1]), int(t[2])) for t in told] == [(n, 8 * n) for n in seen]


def test_the_overlap_worker_takes_the_consumers_current_device_for_cuda_without_an_index(monkeypatch):
    """device="cuda" (no index) means the current device of the thread that builds the buffer (a
    training process sets its own): the worker thread, whose current device is torch's default
    until it sets one, sets that device, with its index (torch.cuda.set_device refuses a device
    without one)."""
    import torch

    class Stop(Exception):
        pass

    consumer, seen = threading.current_thread(), []

    def set_device(device):
        seen.append((threading.current_thread().name, device))
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError(f"Expected a torch.device with a specified index or an integer, but got:{device}")
        raise Stop  # where the worker would make its stream: no CUDA here

    # per thread, as CUDA's: the consumer's is 3, any other thread's the default 0
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3 if threading.current_thread() is consumer else 0)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, cost=CostModel(), device="cuda")
    batch = syn.make_global_batch(np.random.default_rng(0), 4, 64, features=4, mix="small")
    with pytest.raises(Stop):
        with ReorderingBuffer(iter([batch]), ex, overlap=True) as buf:
            next(buf)
    assert seen == [("reorder-overlap", torch.device("cuda", 3))]


def test_the_overlap_worker_never_captures_a_checksum_launch(monkeypatch):
    """The overlap worker runs windows beside the training's own device work, whose device-wide
    synchronizes (Megatron's batched P2P after its sends) invalidate a CUDA graph capture in progress
    on any thread of the device: its checksum launches are never captured (`checksum.Graphs.take`
    gives none there), while the consumer's thread still takes captured blocks."""
    import torch

    from reorder.batch import checksum

    monkeypatch.setattr(checksum, "_CAPTURE", [True])
    graphs, taken = checksum.Graphs(), {}
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, verify=1,
                         cost=CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START))
    exchange = ex.exchange

    def probing(*a, **k):  # what a checksum launch of this window's thread would take
        taken.setdefault(threading.current_thread().name, set()).add(
            graphs.take(torch.device("cuda", 0), 600) is not None)
        return exchange(*a, **k)

    monkeypatch.setattr(ex, "exchange", probing)
    rng = np.random.default_rng(2)
    batches = [syn.make_global_batch(rng, 4, 64, features=4, mix="small", first_id=4 * k) for k in range(4)]
    with ReorderingBuffer(iter(batches), ex, overlap=True) as buf:
        assert len(list(buf)) == 4
    assert taken.get("reorder-overlap") == {False}, taken
    assert graphs.take(torch.device("cuda", 0), 600) is not None  # the consumer's thread still captures
