"""The self-check's checksum kernel on a GPU, bit for bit against the torch ops: random windows whose
buffers live on the device (some off their word alignment), in pinned host memory (read by the
kernel by address) or in pageable host memory (summed by torch ops and added in), with pieces large
enough to span many programs; the torch ops on the device agree with them on the host; a flipped
byte changes exactly its (sample, field) sum; dp-1 windows through the exchanger with verify=1 pass
with the kernel summing both sides, a byte the executor flips is caught at the next window; a checked
window returns with a long kernel still queued ahead of it (no wait for the device); the sums to the
host through captured launches (`checksum.Graphs`) equal too; pinned sources dropped right after the
call while the device lags are held until the kernel has read them; and the kernel
compiled once (the input's offsets multiples of 16 and not); the kernel's first window in the
process, compared with the torch ops while the device lags, keeps the kernel; and checked windows
on alternating streams, each behind a long kernel there, read their own sums.

  python functional_tests/checksum_cuda.py [--windows 200]
  TRITON_INTERPRET=1 python functional_tests/checksum_cuda.py --rehearse --windows 10   # on the CPU

Prints one line per check and a summary dict; exits 1 on any mismatch. --rehearse runs the same
checks on the CPU through Triton's interpreter (pinned and device buffers are host ones there; no
compile count), so the script itself is exercised where no GPU is."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from reorder import CostModel, Grid, ReorderError, WindowExchanger  # noqa: E402
from reorder.batch import checksum as cs  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from bench.common import synchronizer  # noqa: E402
from reorder.exchange import round as round_module  # noqa: E402
from reorder.exchange.executors import TorchExecutor, TritonExecutor  # noqa: E402
from reorder.plan.checksums import CHECKED_FIELDS, field_slot  # noqa: E402
from reorder.plan.counts import SampleCounts  # noqa: E402
from reorder.plan.moves import ByteField  # noqa: E402
from support.checks import field_owner  # noqa: E402

DTYPES = [torch.int64, torch.int32, torch.bfloat16, torch.float32, torch.uint8, torch.bool]


unread = set()  # rehearsal: ids of the buffers standing for pageable host ones


def random_window(rng, dev):
    """(parts on their devices, the same parts on the host, fields, where each buffer lives)."""
    n_fields = CHECKED_FIELDS + 2 if rng.random() < 0.2 else int(rng.integers(1, 8))
    spec = []
    for _ in range(n_fields):
        kind = str(rng.choice(["dense", "dense", "row", "image"]))
        dtype = DTYPES[int(rng.integers(len(DTYPES)))]
        k = int(rng.integers(0 if kind == "dense" else 1, 3000 if rng.random() < 0.3 else 9))
        if kind == "image" and rng.random() < 0.5:
            dtype, k = torch.int64, 3
        spec.append((ByteField(kind, int(rng.integers(1, 4)) if kind == "dense" else 1, k * dtype.itemsize), dtype, k))
    spec.sort(key=lambda s: s[0].kind != "dense")
    if rng.random() < 0.5:
        spec.append((ByteField("list", 1, 1), torch.uint8, 1))
    parts, host, where = [], [], []
    for _ in range(int(rng.integers(1, 5))):
        n = int(rng.integers(0, 9))
        counts = SampleCounts.of(rows=rng.integers(0, 40, n), images=rng.integers(0, 4, n),
                                 list_bytes=rng.integers(0, 300, n))
        bufs, copies = [], []
        for (kind, pre, unit), dtype, k in spec:
            shape = {"dense": (pre, n, k), "list": (int(counts.list_bytes.sum()),)}.get(
                kind, (int((counts.rows if kind == "row" else counts.images).sum()), k))
            numel, off = int(np.prod(shape)), int(rng.integers(0, 4))
            base = torch.empty(numel + off, dtype=dtype)
            raw = base.view(torch.uint8)
            raw.copy_(torch.from_numpy(rng.integers(0, 2 if dtype == torch.bool else 256, raw.numel(), dtype=np.uint8)))
            place = str(rng.choice(["device", "device", "pinned", "pageable"]))
            cuda = dev.type == "cuda"
            t = base.to(dev) if place == "device" else base.pin_memory() if place == "pinned" and cuda else base
            if not cuda and place == "pageable":
                unread.add(id(t))  # rehearsal: what the kernel could not read on CUDA
            bufs.append(t[off:].view(shape))
            copies.append(base[off:].view(shape))
            where.append(place)
        parts.append((bufs, counts))
        host.append((copies, counts))
    return parts, host, tuple(f for f, _, _ in spec), where


def check_windows(args, dev, offsets: set) -> int:
    rng, bad, launched, t_kernel, t_torch, lagging = np.random.default_rng(0), 0, 0, 0.0, 0.0, 0
    sync, kernel = synchronizer(dev), functools.partial(cs.kernel_checksums, interpret=args.rehearse)
    graphs = cs.Graphs()  # captured launches: each window's sums are read before the next call
    for k in range(args.windows):
        parts, host, fields, where = random_window(rng, dev)
        want = cs.torch_checksums(host, fields)
        sync()
        t0 = time.perf_counter()
        got = kernel(parts, fields, dev)
        sync()
        t_kernel += time.perf_counter() - t0
        if got is None:
            if any(w != "pageable" for w in where) and any(b.numel() for bufs, _ in parts for b in bufs):
                bad += 1
                print(f"window {k}: no launch, though the kernel could read a buffer ({where})", flush=True)
            continue
        launched += 1
        readable = [[cs._readable(t, dev, args.rehearse) for t in bufs] for bufs, _ in parts]
        offsets.add(cs.launch_block(parts, fields, readable, cs.CHUNK)[2]["out_at"] % 16 == 0)
        if got.device != dev or not torch.equal(got.cpu(), want):
            bad += 1
            print(f"window {k}: the kernel's sums differ from the torch ops' on the host", flush=True)
            continue
        lagging += check_host_sums(parts, fields, dev, kernel, want, far=k % 10 == 0)
        lagging += check_host_sums(parts, fields, dev, functools.partial(kernel, graphs=graphs), want, far=k % 10 == 5)
        on_device = [([t.to(dev) for t in bufs], c) for bufs, c in host]
        t0 = time.perf_counter()
        again = cs.torch_checksums(on_device, fields)
        sync()
        t_torch += time.perf_counter() - t0
        if not torch.equal(again.cpu(), want):
            bad += 1
            print(f"window {k}: the torch ops on the device differ from the host's", flush=True)
        live = [(p, f) for p, (bufs, _) in enumerate(parts) for f, t in enumerate(bufs)
                if t.numel() and readable[p][f]]
        if live:
            p, f = live[int(rng.integers(len(live)))]
            flat = parts[p][0][f].view(-1).view(torch.uint8)
            byte = int(rng.integers(len(flat)))
            flat[byte] ^= 1 << int(rng.integers(8))
            changed = (kernel(parts, fields, dev) != got).nonzero().tolist()
            sample = sum(c.shape[0] for _, c in parts[:p]) + field_owner(fields[f], parts[p][1], byte)
            if changed != [[sample, field_slot(f)]]:
                bad += 1
                print(f"window {k}: a flipped byte of field {f} changed {changed}, not [[{sample}, "
                      f"{field_slot(f)}]]", flush=True)
    print(f"windows: {args.windows}, {launched} launched, {bad} mismatches; kernel {t_kernel * 1e3:.1f} ms in all, "
          f"torch ops on the device {t_torch * 1e3:.1f} ms; the sums to the host behind a delayed stream: "
          f"{lagging} wrong", flush=True)
    return bad + lagging


def check_host_sums(parts, fields, dev, kernel, want, far: bool) -> int:
    """The kernel's sums to the host (`host=True`, as the round asks for them) with the device lagging
    behind a `torch.cuda._sleep`: an event recorded after the call says when the sums have landed in
    pinned memory, equal to the torch ops'. `far`: the device lags by ~0.2 s, and the call must have
    returned before it reached the launch (a margin that holds with other processes on the GPU;
    the other windows lag by ~1 ms). Returns 1 when not."""
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda._sleep(400_000_000 if far else 2_000_000)
    got = kernel(parts, fields, dev, host=True)  # a numpy array in host memory
    if not cuda:
        return int(not np.array_equal(got, want.numpy()))
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(dev))
    early = far and event.query()  # True: the host waited for the device somewhere
    event.synchronize()
    pinned = torch.from_numpy(got).is_pinned()
    ok = not early and pinned and np.array_equal(got, want.numpy())
    if not ok and kernel.keywords.get("graphs") is not None:
        print("(through captured launches)", flush=True)
    if not ok:
        print(f"sums to the host: returned after the device: {early}, pinned: {pinned}, equal to the torch "
              f"ops': {np.array_equal(got, want.numpy())}", flush=True)
    return int(not ok)


def check_held_sources(args, dev) -> int:
    """Pinned sources dropped right after the call, with the device lagging, and new pinned buffers
    of the same sizes filled at once (the caching host allocator hands a freed block out again at
    once unless something holds it): the sums, uncaptured and through captured launches, with the
    buffers asked or vouched for (`placed`), are those of the dropped sources' bytes, and no new
    buffer got a dropped one's block before the kernel ran. Returns the number of wrong windows."""
    if dev.type != "cuda":
        return 0
    rng, bad, reused, graphs = np.random.default_rng(7), 0, 0, cs.Graphs()
    fields = (ByteField("dense", 2, 4096), ByteField("row", 1, 256))
    for k in range(20):
        counts = SampleCounts.of(rows=rng.integers(1, 64, 8))
        host = [torch.from_numpy(rng.integers(0, 256, (2, 8, 4096), dtype=np.uint8)),
                torch.from_numpy(rng.integers(0, 256, (int(counts.rows.sum()), 256), dtype=np.uint8))]
        want = cs.torch_checksums([(host, counts)], fields)
        pinned = [t.pin_memory() for t in host]
        torch.cuda._sleep(50_000_000)
        # captured or not; the buffers asked whether the kernel reads them, or vouched for (`placed`, the round's)
        got = cs.kernel_checksums([(pinned, counts)], fields, dev, host=True, graphs=graphs if k % 2 else None,
                                  placed=k % 4 >= 2)
        blocks = {t.data_ptr() for t in pinned}
        del pinned
        fresh = [torch.empty(t.shape, dtype=torch.uint8, pin_memory=True).fill_(0x5A) for t in host]
        reused += sum(t.data_ptr() in blocks for t in fresh)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
        event.synchronize()
        if got is None or not np.array_equal(got, want.numpy()):
            bad += 1
            print(f"held sources, window {k} ({'captured' if k % 2 else 'uncaptured'}): the sums differ from the "
                  f"dropped sources'", flush=True)
    print(f"held sources: 20 windows, {bad} wrong, {reused} new buffers got a dropped source's block", flush=True)
    return bad + reused


def flipping(executor):
    """`executor`, flipping one byte of its largest destination once, when armed."""

    class Flipping(type(executor)):
        armed = False

        def run(self, segments, sources, destinations, held=None):
            super().run(segments, sources, destinations, held=held)
            if self.armed and segments.nbytes.sum():
                self.armed = False
                d = max(destinations, key=lambda t: t.nbytes).reshape(-1).view(torch.uint8)
                d[len(d) // 2] ^= 0x10

    executor.__class__ = Flipping
    return executor


def check_exchanges(args, dev) -> int:
    """dp-1 windows (pinned and device micro-batches) with verify=1: every one passes with the kernel
    summing both sides; a byte flipped by the executor is caught at the next window."""
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    rng, bad = np.random.default_rng(2), 0
    calls = []
    kernel = cs._kernel()

    class Counting:  # on CUDA every launch goes through the compiled kernel that `warmup` returns
        def __getitem__(self, grid):  # the interpreter's launches (--rehearse)
            calls.append(grid)
            return kernel[grid]

        def warmup(self, *args, **kwargs):
            compiled = kernel.warmup(*args, **kwargs)

            class Compiled:
                def __getitem__(self, grid):
                    calls.append(grid)
                    return compiled[grid]

                def __getattr__(self, name):  # what a capture asks of it (its module loaded first)
                    return getattr(compiled, name)
            return Compiled()

    replay = cs._Captured.replay

    def counting_replay(self, kernel_, consts):  # a captured launch: one replay, no launcher call
        done = replay(self, kernel_, consts)
        if done:
            calls.append("replay")
        return done

    cs._KERNEL[0], cs._Captured.replay = Counting(), counting_replay
    ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=8, cost=cost, device=dev, window_size=2,
                         verify=1)
    flip = ex.round._executors[dev] = flipping(TorchExecutor() if args.rehearse else TritonExecutor())
    bad += correct_windows(ex, rng, dev)
    launches = len(calls)
    verified = (ex.verified_windows, ex.verified_samples)  # windows 0..6 compared (7 at the next window)
    flip.armed = True
    g = [syn.make_global_batch(rng, 8, 512, features=24, mix="small", first_id=1000 + 8 * i) for i in range(2)]
    ex.exchange([syn.to_device(b, dev) for b in g])
    try:
        ex.exchange([])
        bad += 1
        print("a flipped byte went unseen", flush=True)
    except ReorderError as e:
        print(f"flipped byte caught: {str(e)[:160]}", flush=True)
    ok_kernel = isinstance(cs._KERNEL[0], Counting)
    captured = calls[:launches].count("replay")
    bad += int(not ok_kernel) + int(launches < 8) + int(not args.rehearse and not (cs._CAPTURE[0] and captured))
    # the flipped window's frame compared window 7: every correct window that moved samples, 16 samples each
    bad += int(not 0 < verified[0] <= 7 or verified[1] != 16 * verified[0] or ex.verified_windows != verified[0] + 1)
    cs._KERNEL[0], cs._Captured.replay = kernel, replay
    print(f"exchanges: 8 windows, {launches} kernel launches ({captured} captured), kernel "
          f"never failed: {ok_kernel}, capturing: {cs._CAPTURE[0]}; found intact: {verified[0]} windows "
          f"({verified[1]} samples) after 7, {ex.verified_windows} after 8", flush=True)
    return bad


def correct_windows(ex, rng, dev, sleep: int = 0, end: bool = False) -> int:
    """Exchange 8 correct dp-1 windows of 2 micro-batches (pinned and device ones in turn, with
    per-sample lists read from pageable host memory); returns how many raised. `sleep`: GPU cycles of
    `torch.cuda._sleep` queued ahead of each window, so the device lags the host; `end`: then end the
    stream (the last window's check)."""
    bad = 0
    for k in range(8):
        g = [syn.make_global_batch(rng, 8, 512, features=24, mix="small", first_id=16 * k + 8 * i) for i in range(2)]
        for i, mb in enumerate(g):  # per-sample lists: the list field, read from pageable host memory
            mb["note"] = [f"n{i}{j}" * j for j in range(8)]
        src = [syn.pin(b) if k % 2 and dev.type == "cuda" else syn.to_device(b, dev) for b in g]
        if sleep and dev.type == "cuda":
            torch.cuda._sleep(sleep)
        try:
            ex.exchange(src)
        except ReorderError as e:
            bad += 1
            print(f"exchange {k} (a correct window) raised: {e}", flush=True)
    if end:
        try:
            ex.exchange([])
        except ReorderError as e:
            bad += 1
            print(f"the end of the stream (after correct windows) raised: {e}", flush=True)
    return bad


def check_torch_exchanges(args, dev) -> int:
    """The same correct windows with the torch ops summing both sides (the fallback where Triton is
    missing or its launch failed), the device lagging the host: none raises. A window mixing host
    buffers (pinned sources a slot keeps) and device ones (assembled slots) gathers its sums on the
    device; gathered on the host, the device part's sums came over by a non-blocking copy and were
    added up before they landed (false mismatches)."""
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    kernel = cs._kernel()
    cs._KERNEL[0] = None
    try:
        bad = 0
        for seed in (3, 5, 7):
            ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=8, cost=cost, device=dev,
                                 window_size=2, verify=1)
            bad += correct_windows(ex, np.random.default_rng(seed), dev, sleep=20_000_000, end=True)
    finally:
        cs._KERNEL[0] = kernel
    print(f"torch ops: 3 x 8 correct windows, {bad} raised", flush=True)
    return bad


def check_first_window(args, dev) -> int:
    """The kernel's first window in a process, compared with the torch ops once, with the device
    lagging ~0.2 s behind a `torch.cuda._sleep` and every buffer in pinned host memory (the torch ops
    then sum on the host and nothing of theirs waits for the device): the comparison must wait for
    the kernel's sums to land, or it compares words not yet written, takes the kernel for a broken one
    and sums with torch ops from then on. Runs first. Returns 1 when the kernel was set aside or its
    sums differ from the torch ops'."""
    if args.rehearse:
        print("first window: not on the CPU (no device stream)", flush=True)
        return 0
    rng = np.random.default_rng(7)
    n, fields = 6, (ByteField("dense", 2, 40), ByteField("row", 1, 12))
    counts = SampleCounts.of(rows=rng.integers(1, 30, n), images=np.zeros(n, np.int64))
    bufs = [torch.from_numpy(rng.integers(0, 256, (2, n, 40), dtype=np.uint8)).pin_memory(),
            torch.from_numpy(rng.integers(0, 256, (int(counts.rows.sum()), 12), dtype=np.uint8)).pin_memory()]
    want = cs.checksums([b.clone() for b in bufs], fields, counts)  # on the host: no device involved
    cs._KERNEL_AGREED.clear()
    torch.cuda._sleep(400_000_000)
    got = cs.window_checksums([(bufs, counts)], fields, dev, host=True)
    torch.cuda.synchronize(dev)
    kept = cs._KERNEL[0] is not None and cs._KERNEL_AGREED == [True]
    ok = kept and np.array_equal(got, want.numpy())
    print(f"first window behind a lagging device: kernel kept: {kept}, sums equal to the torch ops': "
          f"{np.array_equal(got, want.numpy())}", flush=True)
    return int(not ok)


def check_no_wait(args, dev) -> int:
    """A checked window waits for nothing on the device: with a long kernel queued ahead of it on the
    current stream (`torch.cuda._sleep`), `exchange` returns while that kernel still runs, with the
    check on every window as with it off (its sums reach the host behind the window's work and are
    read at the next window). Not on the CPU (no stream to wait for)."""
    if args.rehearse:
        print("no-wait check: not on the CPU (no device stream)", flush=True)
        return 0
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    rng, bad = np.random.default_rng(4), 0
    stream = torch.cuda.current_stream(dev)
    for verify in (0, 1):
        ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=8, cost=cost, device=dev,
                             window_size=2, verify=verify)
        waited, moved = [], 0
        for k in range(6):
            g = [syn.pin(syn.make_global_batch(rng, 8, 512, features=24, mix="small", first_id=16 * k + 8 * i))
                 for i in range(2)]  # two micro-batches of a window of 2, as in `check_exchanges`: they reorder
            torch.cuda.synchronize(dev)
            if k:  # window 0 compiles and compares the kernel with the torch ops once: it may wait
                torch.cuda._sleep(400_000_000)  # ~0.2 s of device time ahead of the window
            _, report = ex.exchange(g)
            if k:
                waited.append(stream.query())  # True: the host waited for the sleeping kernel
                moved += int((report.orders != np.arange(report.orders.shape[1])).any())
        ex.exchange([])
        bad += sum(waited) + int(not moved)
        print(f"no-wait check, verify={verify}: {sum(waited)} of {len(waited)} windows waited for the device "
              f"(windows reordered: {moved} of {len(waited)})", flush=True)
    return bad


def check_side_streams(args, dev) -> int:
    """Checked windows run on whichever stream is current: windows alternate between the default
    stream and a side stream (`torch.cuda.stream`), each behind a kernel queued ahead of it there
    (`torch.cuda._sleep`). Each window's event must be recorded on that window's stream
    (`keepalive.current_stream`): one recorded on another stream completes before the sums are
    copied back, and the next window reads stale sums (a mismatch). Not on the CPU."""
    if args.rehearse:
        print("side-stream check: not on the CPU (no device stream)", flush=True)
        return 0
    from reorder.batch.keepalive import current_stream

    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    rng, side, wrong, raised, moved = np.random.default_rng(5), torch.cuda.Stream(dev), 0, 0, 0
    ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=8, cost=cost, device=dev, window_size=2,
                         verify=1)
    k = 0
    try:
        for k in range(12):
            g = [syn.to_device(syn.make_global_batch(rng, 8, 512, features=24, mix="small",
                                                     first_id=16 * k + 8 * i), dev) for i in range(2)]
            stream = side if k % 2 else torch.cuda.default_stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                wrong += int(current_stream(dev).cuda_stream != stream.cuda_stream)
                torch.cuda._sleep(20_000_000)  # ~10 ms ahead of the window on its stream
                _, report = ex.exchange(g)
                moved += int((report.orders != np.arange(report.orders.shape[1])).any())
            torch.cuda.current_stream(dev).wait_stream(stream)
        ex.exchange([])
    except ReorderError as e:
        raised = 1
        print(f"side-stream check: window {k} raised: {e}", flush=True)
    print(f"side-stream check: 12 windows on alternating streams, {'a mismatch' if raised else 'no mismatch'}; "
          f"current stream wrong in {wrong}; windows reordered: {moved}", flush=True)
    return wrong + raised + int(not moved)


def compiled_variants(kernel) -> int:
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--windows", type=int, default=200)
    p.add_argument("--rehearse", action="store_true", help="on the CPU, through Triton's interpreter "
                                                          "(TRITON_INTERPRET=1)")
    args = p.parse_args()
    if args.rehearse:
        if os.environ.get("TRITON_INTERPRET") != "1":
            p.error("--rehearse needs TRITON_INTERPRET=1 in the environment")
        dev = torch.device("cpu")
        readable = cs._readable
        cs._readable = lambda t, device, interpret: id(t) not in unread and readable(t, device, interpret)
        round_module.window_checksums = functools.partial(cs.window_checksums, interpret=True)
    else:
        dev = torch.device("cuda", torch.cuda.current_device())
    offsets = set()
    bad = (check_first_window(args, dev) + check_windows(args, dev, offsets) + check_held_sources(args, dev)
           + check_exchanges(args, dev) + check_torch_exchanges(args, dev) + check_no_wait(args, dev)
           + check_side_streams(args, dev))
    from reorder.batch.triton_checksum import checksum_window

    variants = 1 if args.rehearse else compiled_variants(checksum_window)
    print(f"compiled variants: checksum kernel {variants} (output offsets multiples of 16: {sorted(offsets)})",
          flush=True)
    recompiled = int(variants != 1) + int(len(offsets) != 2 and not args.rehearse)
    print({"ok": bad + recompiled == 0, "windows": args.windows, "compiled_once": recompiled == 0,
           "capturing": cs._CAPTURE[0]})
    return 1 if bad + recompiled else 0


if __name__ == "__main__":
    sys.exit(main())
