"""What the runtime self-check costs: a window's host time (and, on CUDA, its device time) with the
check off, on every 100th window and on every window, side by side in one process (the settings
alternate window by window, so drift hits all alike). A dp-1 module: its window runs every step
of the check (checksums where the samples are read, the frame, the comparison on what was
assembled) without a collective; the micro-batches are realistic Qwen-VL ones, on CUDA from pinned
host memory (--inputs pinned, the default: every read of a sample crosses the host link, the
sender's checksum read too) or already on the GPU (--inputs device), elsewhere on the host.
--early-copy: each micro-batch is copied to the device as it is counted (early_copy=True), so
pinned inputs too are read from the device.

Each checked setting runs once per checksum path of --paths: `kernel` (the round's own: on CUDA one
Triton launch for the sources read in place from pinned host memory, if any, and one for the rest,
`reorder.batch.checksum.window_checksums`) and `torch` (the torch
ops, the fallback), in the same alternation, so the kernel's saving is read off one table. On CUDA
both by default; elsewhere `kernel` alone (there it is the torch ops).

  PYTHONPATH=. python bench/verify_cost.py [--device cuda] [--inputs pinned|device] [--micro-batch 16]
                                           [--window 1] [--windows 200] [--paths kernel,torch] [--early-copy]
                                           [--ablate] [--early-sources] [--device-busy N] [--json F]

--window: micro-batches per window (1, the default, is the smallest window: the check's fixed
host cost per window weighs most there).

--ablate: three more every-window rows, each with a part of the check left out, to read what
that part costs inside a window (the median's difference from the every-window row) where timing
the part itself cannot tell (a part run cold, between the window's other steps, costs more than
alone): "no comparison" (the sums travel, nobody compares them), "no read-back" (nor are they read
back and sent), "no launch" (the checksum calls return zeros at once: no launch block, no launch;
the zeros are read back and compared), and "assembled only" (one launch a window sums what was
assembled, nothing else: no source summed, nothing read back or compared; the device's part of
any check that reads the assembled bytes once, by one launch after the writes). These rows check
nothing.

--early-sources: one more every-window row whose sources are all summed once the window is
planned, by their own launch before the executor reads them (as the library sums only the sources
read in place from pinned host memory), and the assembled outputs after the assembly: two launches
a window instead of one, the sources' read moved to where the device waits for the host's planning
and packing instead of after the assembly. Its sums are the same; the row says whether the move
pays for its second launch.

--device-busy N (CUDA): then N more windows of each row under torch.profiler, each between two
synchronizations, for the GPU's busy time a window: the union of its kernels, copies and memsets.
The device time above runs from before a window's first step to the end of its last kernel, and so
holds the host time the device waits for; the busy time is the device's own work, which a training
step whose GPU is never idle pays. Each row also says in how many of those windows the checksum
kernel showed (a profiler that missed the kernels of a replayed CUDA graph would show none).

Prints one row per setting and path: median host ms per window, mean device ms per window (CUDA
events), the ratio to off, and how many of the row's checksum calls the kernel served; then the
check's host time part by part (mean µs per timed window of each checked row: the sums of the held
sources, the other sums and their copy to the host, within both the launch tables and the kernel
paths, the read-back at the next window, the comparison); writes JSON."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from bench.common import code_commit, cpu_name
from reorder import CostModel, Grid, WindowExchanger
from reorder.batch import checksum
from reorder.cli import synthetic as syn
from reorder.exchange import round as round_module
from reorder.plan.counts import SampleCounts

SETTINGS = {"off": 0, "every 100th": 100, "every window": 1}
# the check's host parts: name -> (owner, attribute) timed in place
PARTS = {"held sources' sums": (round_module.WindowRound, "_sent_sums"),
         "the other sums + copy": (round_module.WindowRound, "_checked"),
         "launch blocks (both)": (checksum, "launch_block"),
         "kernel paths (both)": (checksum, "kernel_checksums"),
         "read-back": (round_module.WindowRound, "_check_words"),
         "comparison": (round_module.WindowRound, "_compared")}


class Parts:
    """Host seconds spent in each of PARTS, per row (`row`: the row being timed, None when untimed)."""

    def __init__(self):
        self.row, self.seconds, self._saved = None, {}, []

    def __enter__(self):
        for part, (owner, attr) in PARTS.items():
            fn = getattr(owner, attr)
            self._saved.append((owner, attr, fn))
            setattr(owner, attr, self._timed(part, fn))
        return self

    def __exit__(self, *exc):
        for owner, attr, fn in self._saved:
            setattr(owner, attr, fn)

    def _timed(self, part, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                if self.row is not None:
                    into = self.seconds.setdefault(self.row, {})
                    into[part] = into.get(part, 0.0) + time.perf_counter() - t0
        return timed


class Path:
    """A checksum path for the round (`kernel`, `torch`, or `zeros`: nothing summed, zeros of the
    window's shape on the host, for --ablate), counting the window checksums it computes and those
    the kernel served."""

    def __init__(self, name: str):
        self.name, self.calls, self.kernel, self.samples = name, 0, 0, 0

    def __call__(self, parts, fields, device, **kw):
        self.calls += 1
        got = checksum.kernel_checksums(parts, fields, device, **kw) if self.name == "kernel" else None
        if got is not None:
            self.kernel += 1
        elif self.name == "zeros":
            got = np.zeros((sum(c.shape[0] for _, c in parts), checksum.CHECKED_FIELDS), dtype=np.int64)
        else:  # as window_checksums does without the kernel: the sums to the host when the round asks
            got = checksum.torch_checksums(parts, fields)
            if kw.get("host"):
                got = checksum._to_host(got)
        self.samples += got.shape[0]
        return got


ABLATED = ("no comparison", "no read-back", "no launch", "assembled only")  # --ablate: every window, parts left out
EARLY = "every window, sources early"  # --early-sources


def rows_of(paths: list, ablate: bool = False, early: bool = False) -> list:
    """(row name, verify, path name or None) of every row: off, then each checked setting per path,
    then with `ablate` the ABLATED rows (every window; the first path, "zeros" for "no launch"), and
    with `early` the EARLY row (every window; the first path)."""
    out = [("off", 0, None)]
    for name, n in SETTINGS.items():
        if n:
            out += [(name if len(paths) == 1 else f"{name} ({p})", n, p) for p in paths]
    out += [(f"every window, {name}", 1, "zeros" if name == "no launch" else paths[0]) for name in ABLATED if ablate]
    return out + [(EARLY, 1, paths[0])] * early


def sources_early(ex: WindowExchanger) -> None:
    """`ex`'s round sums every source of a checked window once it is planned, in the launch of the
    held ones (`_sent_sums`), before the executor reads them; the launch after the assembly sums
    what was assembled only (a kept slot's sources again). The sums are the same; what moves is
    when the device reads the sources: while the host packs and assembles, not after."""
    rnd = ex.round

    def sender_parts(now, *, held):
        if not held:
            return None  # no source is left for the launch after the assembly
        nf, table = len(now.fields), now.window.counts.table
        return [(now.sources[s * nf:(s + 1) * nf], SampleCounts(table[s])) for s in range(len(table))]

    rnd._sender_parts = sender_parts


def leave_out(name: str, ex: WindowExchanger) -> None:
    """`ex`'s round with the comparison, or the read-back and the comparison, left out when the row
    `name` says so (an ABLATED row; "no launch" is its path), and for "assembled only" the sources'
    sums too (a kept slot's sources are still summed: they are what it hands out)."""
    rnd = ex.round
    if name.endswith(("no comparison", "no read-back", "assembled only")):
        rnd._compared = lambda check, frames: None  # every comparison passes
    if name.endswith(("no read-back", "assembled only")):
        rnd._check_words = lambda: None  # no sums in the frame: nothing to compare either
    if name.endswith("assembled only"):
        rnd._sender_parts = lambda now, *, held: None  # no source summed, held or not


BUSY = "reorder.verify_cost window: "  # the profiler ranges of --device-busy


def device_busy(ex: dict, impl: dict, window_of, first: int, n: int, dev) -> dict:
    """--device-busy: n more windows of each row (windows first, first + 1, ..., rows alternating),
    each in a profiler range between two synchronizations. Returns {row: (mean busy ms a window,
    windows whose GPU work includes the checksum kernel)} (`common.busy_by_range`; off CUDA, where
    the tests run it, there is no GPU work: 0 ms)."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    from bench.common import busy_by_range

    cuda = dev.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(dev)) if cuda else (lambda: None)
    try:
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            for k in range(first, first + n):
                for name, e in ex.items():
                    round_module.window_checksums = impl[name]
                    sync()
                    with record_function(BUSY + name):
                        e.exchange(window_of(k))
                        sync()
    finally:
        round_module.window_checksums = checksum.window_checksums
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            ranges = busy_by_range(json.load(trace)["traceEvents"], BUSY)
    return {name: (float(np.mean([us for us, _ in got])) / 1e3,
                   sum(any("checksum_window" in w for w in work) for _, work in got))
            for name, got in ranges.items()}


def add_input_args(p: argparse.ArgumentParser) -> None:
    """The device and the micro-batches' arguments, which `inputs_of` and `micro_batches` read, and
    --early-copy (where the exchangers copy them to the device)."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--inputs", help="where the micro-batches are: pinned (host memory, the default on CUDA) or "
                                    "device (on the GPU already); host elsewhere")
    p.add_argument("--micro-batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--features", type=int, default=1176)
    p.add_argument("--mix", default="realistic")
    p.add_argument("--early-copy", action="store_true", help="the exchangers copy each micro-batch to the device "
                                                             "as they count it (early_copy=True)")


def inputs_of(p: argparse.ArgumentParser, args, cuda: bool) -> str:
    """--inputs checked (its default: pinned on CUDA, else host), or the parser's error naming it."""
    inputs = args.inputs or ("pinned" if cuda else "host")
    if inputs not in (("pinned", "device") if cuda else ("host",)):
        p.error(f"--inputs {args.inputs!r}: expected " + ("pinned or device" if cuda else "host (no CUDA device)"))
    return inputs


def micro_batches(args, inputs: str, dev: torch.device) -> list:
    """8 synthetic global micro-batches of the arguments' shape and mix, where `inputs` says: pinned
    host memory, the device, or the host."""
    rng = np.random.default_rng(0)
    batches = [syn.make_global_batch(rng, args.micro_batch, args.seq_len, features=args.features, mix=args.mix,
                                     first_id=k * args.micro_batch) for k in range(8)]
    if inputs == "pinned":
        return [syn.pin(b) for b in batches]
    if inputs == "device":
        return [syn.to_device(b, dev) for b in batches]
    return batches


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_input_args(p)
    p.add_argument("--window", type=int, default=1, help="micro-batches per window (at most 8)")
    p.add_argument("--windows", type=int, default=200, help="timed windows per row")
    p.add_argument("--warmup", type=int, default=10, help="untimed windows per row first (Triton compiles, caches fill)")
    p.add_argument("--paths", help="checksum paths, comma-separated: kernel, torch (default: both on CUDA, "
                                   "kernel elsewhere)")
    p.add_argument("--ablate", action="store_true", help="every-window rows with a part of the check left out")
    p.add_argument("--early-sources", action="store_true",
                   help="one more every-window row whose sources are summed once the window is planned, before "
                        "the executor reads them (two launches a window), the assembled outputs after")
    p.add_argument("--device-busy", type=int, default=0, metavar="N",
                   help="CUDA: then N more windows of each row under torch.profiler, for the GPU's busy time a "
                        "window (its kernels, copies and memsets, their union)")
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    paths = (args.paths or ("kernel,torch" if cuda else "kernel")).split(",")
    if not paths or set(paths) - {"kernel", "torch"}:
        p.error(f"--paths {args.paths!r}: expected kernel, torch or both, comma-separated")
    inputs = inputs_of(p, args, cuda)
    if not 1 <= args.window <= 8:
        p.error(f"--window {args.window}: expected 1 to 8 micro-batches")
    if args.device_busy and not cuda:
        p.error(f"--device-busy {args.device_busy}: needs a CUDA device (the GPU's busy time)")
    batches = micro_batches(args, inputs, dev)
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    rows = rows_of(paths, args.ablate, args.early_sources)
    ex = {name: WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=args.micro_batch, cost=cost,
                                window_size=args.window, device=dev, verify=n, early_copy=args.early_copy)
          for name, n, _ in rows}
    for name in ex:
        leave_out(name, ex[name])
        if name == EARLY:
            sources_early(ex[name])
    impl = {name: Path(path or "kernel") for name, _, path in rows}
    host = {name: [] for name in ex}

    def window_of(k):
        return [batches[(k * args.window + i) % len(batches)] for i in range(args.window)]

    device = {name: [] for name in ex}
    kept = {name: 0 for name in ex}  # slots kept as they are in windows that move samples (the check sums them once)
    with Parts() as parts:
        try:
            for k in range(args.windows + args.warmup):
                for name, e in ex.items():
                    round_module.window_checksums = impl[name]
                    parts.row = name if k >= args.warmup else None
                    b = window_of(k)
                    if cuda:
                        torch.cuda.synchronize(dev)
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                    t0 = time.perf_counter()
                    _, report = e.exchange(b)
                    t1 = time.perf_counter()
                    if cuda:
                        end.record()
                        torch.cuda.synchronize(dev)
                    natural = (report.orders == np.arange(args.micro_batch)).all(axis=1)
                    if not natural.all():  # a window that moves samples: its natural slots are kept as they are
                        kept[name] += int(natural.sum())
                    if k >= args.warmup:
                        host[name].append((t1 - t0) * 1e3)
                        if cuda:
                            device[name].append(start.elapsed_time(end))
        finally:
            round_module.window_checksums = checksum.window_checksums
    calls = {name: (i.calls, i.kernel, i.samples) for name, i in impl.items()}  # of the timed windows
    busy = device_busy(ex, impl, window_of, args.warmup + args.windows, args.device_busy, dev) \
        if args.device_busy else None
    out_rows = {}
    off_h = float(np.median(host["off"]))
    off_d = float(np.mean(device["off"])) if cuda else None
    for name, n, path in rows:
        h = float(np.median(host[name]))
        d = float(np.mean(device[name])) if cuda else None
        out_rows[name] = dict(verify=n, path=path, host_ms=h, host_ratio=h / off_h, device_ms=d,
                              device_ratio=None if d is None else d / off_d, checksum_calls=calls[name][0],
                              kernel_calls=calls[name][1], checksum_samples=calls[name][2],
                              kept_slots=kept[name], verified_windows=ex[name].verified_windows,
                              host_us_by_part={part: 1e6 * parts.seconds.get(name, {}).get(part, 0.0) / args.windows
                                               for part in PARTS} if n else None)
        if busy is not None:
            out_rows[name].update(busy_ms=busy[name][0], busy_ratio=busy[name][0] / busy["off"][0],
                                  busy_windows=args.device_busy, busy_windows_with_checksum_kernel=busy[name][1])
    print(f"micro-batches: {inputs}{', copied early' if args.early_copy else ''}, {args.window} per window of "
          f"{args.micro_batch} samples")
    w = max(24, *map(len, out_rows))  # the name column; and a part column per checked row
    print(f"{'self-check':{w}} {'host ms':>9} {'x off':>7} {'device ms':>10} {'x off':>7} {'kernel sums':>12}")
    for name, r in out_rows.items():
        dms = "-" if r["device_ms"] is None else f"{r['device_ms']:.3f}"
        dra = "-" if r["device_ratio"] is None else f"{r['device_ratio']:.3f}"
        print(f"{name:{w}} {r['host_ms']:9.3f} {r['host_ratio']:7.3f} {dms:>10} {dra:>7} "
              f"{r['kernel_calls']:>5}/{r['checksum_calls']:<6}")
    if busy is not None:
        print(f"\nGPU busy a window (torch.profiler, {args.device_busy} windows a row: kernels, copies, memsets)")
        print(f"{'self-check':{w}} {'busy ms':>9} {'x off':>7} {'windows with the checksum kernel':>34}")
        for name, r in out_rows.items():
            print(f"{name:{w}} {r['busy_ms']:9.3f} {r['busy_ratio']:7.3f} "
                  f"{r['busy_windows_with_checksum_kernel']:>27}/{args.device_busy:<6}")
    checked = [name for name, n, _ in rows if n]
    print(f"\nhost µs per window, part by part: {'':4}" + "".join(f"{name:>{w + 2}}" for name in checked))
    for part in PARTS:
        print(f"{part:38}" + "".join(f"{out_rows[name]['host_us_by_part'][part]:{w + 2}.1f}" for name in checked))
    print(f"{'(median host time over off)':38}"
          + "".join(f"{1e3 * (out_rows[name]['host_ms'] - off_h):{w + 2}.1f}" for name in checked))
    if cuda:
        print(f"checksum launches captured in CUDA graphs: {checksum._CAPTURE[0]}")
    out = dict(device=torch.cuda.get_device_name(dev) if cuda else cpu_name(), commit=code_commit(),
               captured=bool(cuda and checksum._CAPTURE[0]),
               inputs=inputs, early_copy=args.early_copy, window=args.window, micro_batch=args.micro_batch,
               seq_len=args.seq_len, features=args.features, mix=args.mix, windows=args.windows, paths=paths,
               ablate=args.ablate, early_sources=args.early_sources, device_busy=args.device_busy,
               settings=out_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
