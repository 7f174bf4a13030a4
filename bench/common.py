"""What the benchmarks and the GPU functional tests share: a device synchronizer, wall-clock timers,
the torchrun set-up of a multi-process run, and a count of the torch ops a block dispatches.

Scripts import it as `bench.common` (they run with the repository root on PYTHONPATH)."""

from __future__ import annotations

import collections
import datetime
import os
import platform
import subprocess
import time

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode


def _nothing() -> None:
    pass


def synchronizer(device=None):
    """A function of no arguments that waits for the work queued on `device`: torch.cuda.synchronize
    on a CUDA device (with None: the current one, when CUDA is available), else nothing."""
    if device is None:
        return torch.cuda.synchronize if torch.cuda.is_available() else _nothing
    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else _nothing


def times_ms(fn, reps: int, sync=_nothing, warmup: int = 0) -> list:
    """Wall times in ms of `reps` calls of fn(), each between two sync() calls, after `warmup`
    untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def code_commit(root: str | None = None) -> str:
    """The commit of the code measured, for a results file: $REORDER_COMMIT when set, else
    `git rev-parse --short HEAD` of the checkout at `root` (default: this repository), with
    "+changes" when its tracked files differ from that commit ("" without git). A copy of the tree
    on another machine may carry a stale .git: its results then say that they are not that commit."""
    given = os.environ.get("REORDER_COMMIT")
    if given:
        return given
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=root).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, cwd=root).stdout.strip()
    except OSError:
        return ""
    return head + "+changes" if head and changed else head


def cpu_name() -> str:
    """The host CPU in a few words, for a results file: '<cores>-core <model>'."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{os.cpu_count()}-core {model}"


def median_ms(fn, reps: int, sync=_nothing, warmup: int = 0) -> float:
    """The median of `times_ms`."""
    return float(np.median(times_ms(fn, reps, sync, warmup)))


def rank_device(cuda: bool) -> torch.device:
    """This process's device under torchrun: the CPU, or GPU LOCAL_RANK mod the GPU count.

    When the node's ranks outnumber its GPUs (LOCAL_WORLD_SIZE > device count) the GPUs are shared:
    NCCL refuses two ranks on one GPU only when they look like one host (same host hash and bus id),
    so each local rank gets its own host id (NCCL_HOSTID, read when the first communicator is made:
    call this before `init_process_group`). NCCL then moves data between the ranks through its socket
    transport: the runs prove function, never speed. The mode is printed once per rank."""
    if not cuda:
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", 0))
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count()
    if gpus < 1:
        raise RuntimeError("a CUDA run was asked for but torch sees no GPU")
    dev = torch.device("cuda", local % gpus)
    if ranks > gpus:
        os.environ["NCCL_HOSTID"] = f"{platform.node()}-shared-gpu-rank{local}"
        print(f"shared-GPU mode: local rank {local} of {ranks} on {dev} ({gpus} GPU(s)), NCCL host id "
              f"{os.environ['NCCL_HOSTID']}: proves function, not speed", flush=True)
    return dev


def init_torchrun(cuda: bool | None = None, timeout=datetime.timedelta(minutes=5)):
    """Join the torchrun job (env:// rendezvous): Gloo on the CPU, Gloo and NCCL with `cuda` (None:
    when a GPU is available), each rank then on its `rank_device` (shared GPUs when ranks outnumber
    them). Returns (rank, world size, device)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() if cuda is None else cuda
    dev = rank_device(cuda)
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), dev


class Count(TorchDispatchMode):
    """Counts the aten ops dispatched inside its `with` block (`ops`: op name -> calls)."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # the trace categories of the GPU's own work


def busy_by_range(events: list, prefix: str) -> dict:
    """The GPU's busy time inside each range a torch.profiler trace marks: {range name without
    `prefix`: [(µs, names of the GPU work in it)] in the ranges' order}. events: the trace's
    `traceEvents` (`export_chrome_trace`); a range is a `record_function` whose name starts with
    `prefix`; the GPU's work is its kernels, copies and memsets (GPU_WORK), clipped to the range,
    and work that overlaps (two streams, a copy beside a kernel) counts once: busy is the length of
    their union."""
    marks = sorted((e["ts"], e["ts"] + e["dur"], e["name"][len(prefix):]) for e in events
                   if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e.get("name", "").startswith(prefix))
    work = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("ph") == "X" and e.get("cat") in GPU_WORK)
    out = {}
    for start, end, name in marks:
        inside = [(max(s, start), min(t, end), n) for s, t, n in work if s < end and t > start]
        busy, reached = 0.0, start
        for s, t, _ in inside:  # sorted by start: add what each piece reaches past the union so far
            if t > reached:
                busy += t - max(s, reached)
                reached = t
        out.setdefault(name, []).append((busy, sorted({n for _, _, n in inside})))
    return out
