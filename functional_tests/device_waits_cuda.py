"""Which host calls wait for the whole device? A long kernel (`torch.cuda._sleep`) runs on one stream;
each probe runs on another stream, in another thread, and is timed on the host: a call that takes the
sleeper's time waited for every stream of the device. Such a call in the overlap thread, between the
window's frame and its all_to_all, could deadlock a training loop (`reorder.exchange.dist`).

  python3 functional_tests/device_waits_cuda.py [seconds]      # the sleeper's length, default 1.0

Prints one line a probe and a SUMMARY of those that waited. No verdict: it measures what the CUDA
driver and torch do on this machine (CUDA_MODULE_LOADING=EAGER changes some rows).
"""

from __future__ import annotations

import mmap
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # reorder from this checkout

import numpy as np  # noqa: E402
import torch  # noqa: E402

from reorder import CostModel, Grid, WindowExchanger  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.runtime.buffer import ReorderingBuffer  # noqa: E402

DEV = torch.device("cuda", 0)


class Sleeper:
    """A kernel of `seconds` on its own stream, calibrated once."""

    def __init__(self, seconds: float):
        self.stream, self.seconds = torch.cuda.Stream(DEV), seconds
        self._run(1000)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        self._run(int(2e9))
        torch.cuda.synchronize()
        self.cycles_per_s = 2e9 / (time.perf_counter() - t0)

    def _run(self, cycles: int) -> None:
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(cycles)

    def start(self) -> None:
        torch.cuda.synchronize()
        self._run(int(self.cycles_per_s * self.seconds))


def probe(sleeper: Sleeper, rows: list, name: str, fn, thread: bool = True):
    """Time `fn` on a fresh stream (in a new thread unless `thread` is False) while the sleeper runs."""
    sleeper.start()
    box = {}

    def run():
        torch.cuda.set_device(DEV)
        t0 = time.perf_counter()
        try:
            with torch.cuda.stream(torch.cuda.Stream(DEV)):
                box["result"] = fn()
        except Exception as e:  # noqa: BLE001 - reported in the row
            box["error"] = f"{type(e).__name__}: {e}"[:200]
        box["s"] = time.perf_counter() - t0

    if thread:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    else:
        run()
    torch.cuda.synchronize()
    waited = box["s"] > 0.5 * sleeper.seconds
    rows.append((name, waited))
    print(f"{name:70} host {box['s'] * 1e3:9.1f} ms  {'WAITED' if waited else 'no wait'}  {box.get('error', '')}",
          flush=True)
    return box.get("result")


def main():
    sleeper = Sleeper(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
    rows = []
    x = torch.rand(1000, device=DEV, dtype=torch.float64)
    probe(sleeper, rows, "torch op, first use (special.i0e float64)", lambda: torch.special.i0e(x))
    probe(sleeper, rows, "torch op, second use", lambda: torch.special.i0e(x))
    probe(sleeper, rows, "torch op, first use (int16 cumsum)",
          lambda: torch.arange(100, device=DEV, dtype=torch.int16).cumsum(0))
    probe(sleeper, rows, "pinned alloc new size 3 MB (caching host allocator)",
          lambda: torch.empty(3 << 20, dtype=torch.uint8, pin_memory=True))
    probe(sleeper, rows, "pinned alloc new size 37 MB", lambda: torch.empty(37 << 20, dtype=torch.uint8, pin_memory=True))
    memory = mmap.mmap(-1, 1 << 20)
    host = torch.frombuffer(memory, dtype=torch.int64)
    probe(sleeper, rows, "cudaHostRegister 1 MB",
          lambda: int(torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.nbytes, 0)))
    probe(sleeper, rows, "device alloc new 1.5 GB", lambda: torch.empty(3 << 29, dtype=torch.uint8, device=DEV))
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(p, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(p + i, tl.load(p + i, mask=i < n) + 1, mask=i < n)

    y = torch.zeros(4096, device=DEV)
    compiled = probe(sleeper, rows, "triton compile (warmup)", lambda: add_one.warmup(y, 4096, BLOCK=256, grid=(16,)))
    probe(sleeper, rows, "triton module load (_init_handles)", lambda: compiled._init_handles())
    probe(sleeper, rows, "triton launch, jit path, new specialization", lambda: add_one[(16,)](y, 4000, BLOCK=128))

    def capture():
        g, z = torch.cuda.CUDAGraph(), torch.zeros(4096, device=DEV)
        g.capture_begin(capture_error_mode="thread_local")
        z.add_(1)
        g.capture_end()
        return g

    g = probe(sleeper, rows, "CUDA graph capture (loaded kernel)", capture)
    probe(sleeper, rows, "CUDA graph replay", lambda: g.replay())
    probe(sleeper, rows, "torch.cuda.empty_cache (cudaFree)", lambda: torch.cuda.empty_cache())
    # the library: each setting's first windows, then the overlap consumer
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    rng = np.random.default_rng(0)

    def window(k: int, pinned: bool) -> list:
        out = [syn.make_global_batch(rng, 16, 1024, features=96, mix="realistic", first_id=16 * (k + i))
               for i in range(2)]
        if pinned:
            return [{n: v.pin_memory() if isinstance(v, torch.Tensor) else v for n, v in b.items()} for b in out]
        return [syn.to_device(b, DEV) for b in out]

    for verify in (0, 1):
        for inputs, early in (("device", False), ("pinned", False), ("pinned", True)):
            ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=16, cost=cost, window_size=2,
                                 device=DEV, verify=verify, early_copy=early)
            for k in range(3):
                batches = window(k, inputs == "pinned")
                probe(sleeper, rows, f"exchange dp1 W2 verify={verify} inputs={inputs} early={early} window {k}",
                      lambda: ex.exchange(batches))
    for verify in (0, 1):
        ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=16, cost=cost, window_size=2,
                             device=DEV, verify=verify)
        with ReorderingBuffer(iter([b for k in range(6) for b in window(k, True)]), ex, overlap=True) as buf:
            it = iter(buf)
            for k in range(5):
                probe(sleeper, rows, f"overlap consumer next() verify={verify} micro-batch {k}", lambda: next(it),
                      thread=False)
    print("SUMMARY waited:", [name for name, waited in rows if waited], flush=True)


if __name__ == "__main__":
    main()
