"""Segment-copy executors benchmark (python bench/executors.py [--device cuda]): a realistic move list
(per-sample fields of a multimodal micro-batch: 4-96 KiB text fields and 2-40 MiB image-patch
blocks, 100-300 segments, tens to hundreds of MiB) copied from one source buffer, on the device or
in pinned host memory, into four device destination buffers. Times TritonExecutor (one launch),
TorchExecutor, and one contiguous copy_ of the same number of bytes (the bandwidth bound): device
time by CUDA events and host time of the call by perf_counter, medians of --reps; checks every
result byte for byte against a per-segment copy_ reference. Scenarios: 16-byte aligned offsets (as
packed buffers have) and arbitrary ones. Prints a table, writes JSON (--out).

--device cpu runs tiny sizes, torch executor only, host timing only: a smoke test, not a result."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import code_commit  # noqa: E402
from reorder.exchange.executors import Segments, TorchExecutor  # noqa: E402

DESTINATIONS = 4


def realistic_sizes(rng, total_bytes: int, segments: int) -> np.ndarray:
    """Segment sizes of about `total_bytes` in all: per sample, text fields (input_ids 32 KiB, mask
    and labels 4-8 KiB, MRoPE position ids as 3 rows of 32 KiB) and, for one sample in two, an image
    block of 1k-16k patch rows x 2352 bytes (1176 bf16 features), scaled to the byte total."""
    sizes = []
    while len(sizes) < segments:
        sizes += [32768, 4096, 8192, 32768, 32768, 32768]
        if rng.random() < 0.5:
            sizes.append(int(rng.integers(1000, 16000)) * 2352)
    sizes = np.array(sizes[:segments], dtype=np.int64)
    big = sizes >= 1 << 20
    small_sum = int(sizes[~big].sum())
    if small_sum > total_bytes // 4:  # tiny totals (CPU smoke runs): text fields shrink too
        sizes[~big] = np.maximum(sizes[~big] * (total_bytes // 4) // small_sum // 16 * 16, 16)
    rest = total_bytes - int(sizes[~big].sum())
    if big.any():  # rescale the image blocks to the rest, keeping whole patch rows
        sizes[big] = np.maximum(sizes[big] * rest // int(sizes[big].sum()) // 2352, 1) * 2352
    return sizes


def build_table(rng, sizes: np.ndarray, aligned: bool) -> tuple[Segments, int, np.ndarray]:
    """Segments reading `sizes` bytes from one source buffer (in a shuffled order, with small gaps)
    into DESTINATIONS buffers (each packed in order, with gaps); returns the table, the source size
    and the destination sizes. `aligned`: every offset a multiple of 16, else arbitrary."""
    n = len(sizes)
    def gaps():
        return rng.integers(0, 4, n) * 16 + (0 if aligned else rng.integers(0, 16, n))
    gap, dst_gap = gaps(), gaps()
    src_order = rng.permutation(n)
    src_off = np.empty(n, np.int64)
    src_off[src_order] = np.cumsum(sizes[src_order] + gap) - sizes[src_order]
    dst_buf = np.sort(rng.integers(0, DESTINATIONS, n))
    dst_off = np.zeros(n, np.int64)
    dst_sizes = np.zeros(DESTINATIONS, np.int64)
    for d in range(DESTINATIONS):
        mine = dst_buf == d
        ends = np.cumsum(sizes[mine] + dst_gap[mine])
        dst_off[mine] = ends - sizes[mine]
        dst_sizes[d] = ends[-1] + 16 if mine.any() else 16
    segs = Segments(np.zeros(n, np.int64), src_off, dst_buf.astype(np.int64), dst_off, sizes)
    return segs, int((src_off + sizes).max()) + 16, dst_sizes


def reference(segs: Segments, src: torch.Tensor, dsts: list[torch.Tensor]) -> None:
    """The slow, obviously correct copy: one copy_ of narrow byte views per segment."""
    s = src.view(torch.uint8)
    for so, db, do, nb in zip(segs.src_off.tolist(), segs.dst_buf.tolist(), segs.dst_off.tolist(),
                              segs.nbytes.tolist()):
        dsts[db].view(torch.uint8).narrow(0, do, nb).copy_(s.narrow(0, so, nb))


def timed(fn, device: torch.device, reps: int, warmup: int) -> dict:
    """Medians of device time (CUDA events; host wall with a sync on CPU) and host time of the call
    itself (perf_counter around the call only, no sync), and the first call's wall time."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t = time.perf_counter()
    fn()
    sync()
    first_ms = (time.perf_counter() - t) * 1e3
    for _ in range(warmup):
        fn()
    dev_ms, host_us = [], []
    for _ in range(reps):
        sync()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        fn()
        host_us.append((time.perf_counter() - t) * 1e6)
        if device.type == "cuda":
            end.record()
            end.synchronize()
            dev_ms.append(start.elapsed_time(end))
        else:
            dev_ms.append(host_us[-1] / 1e3)
    return dict(device_ms=float(np.median(dev_ms)), host_us=float(np.median(host_us)), first_call_ms=first_ms)


def executors(args, device: torch.device) -> dict:
    out = {"torch": TorchExecutor()}
    if device.type == "cuda":
        from reorder.exchange.executors import TritonExecutor
        for b in args.block_bytes:
            for w in args.num_warps:
                one = len(args.block_bytes) == 1 and len(args.num_warps) == 1
                out["triton" if one else f"triton_b{b}_w{w}"] = TritonExecutor(block_bytes=b, num_warps=w)
    return out


def scenario(args, device, source: str, aligned: bool, rng) -> dict:
    sizes = realistic_sizes(rng, args.mib << 20, args.segments)
    segs, src_size, dst_sizes = build_table(rng, sizes, aligned)
    src = torch.randint(0, 256, (src_size,), dtype=torch.uint8, device=device)
    if source == "pinned":
        src = src.cpu().pin_memory()
    fill = [torch.randint(0, 256, (int(n),), dtype=torch.uint8, device=device) for n in dst_sizes]
    want = [f.clone() for f in fill]
    reference(segs, src, want)
    total = segs.total_bytes
    row = dict(source=source, aligned=aligned, segments=len(segs), merged_segments=len(segs.merged()),
               total_mib=total / 2**20, small_segments=int((segs.nbytes < 1 << 20).sum()), results={})
    for name, ex in executors(args, device).items():
        dsts = [f.clone() for f in fill]
        r = timed(lambda: ex.run(segs, [src], dsts), device, args.reps, args.warmup)
        r["exact"] = all(torch.equal(a, b) for a, b in zip(dsts, want))
        r["gbps"] = total / (r["device_ms"] / 1e3) / 1e9
        row["results"][name] = r
    flat = torch.empty(total, dtype=torch.uint8, device=device)
    srcflat = src.narrow(0, 0, total)
    r = timed(lambda: flat.copy_(srcflat, non_blocking=source == "pinned"), device, args.reps, args.warmup)
    r["exact"] = bool(torch.equal(flat.cpu() if source == "pinned" else flat, srcflat))
    r["gbps"] = total / (r["device_ms"] / 1e3) / 1e9
    row["results"]["contiguous"] = r
    return row


def print_table(rows: list[dict]) -> None:
    print(f"{'source':7} {'align':5} {'segs':>4} {'MiB':>7}  {'executor':14} {'dev ms':>8} {'GB/s':>7} "
          f"{'host us':>8} {'1st ms':>8} exact")
    for row in rows:
        for name, r in row["results"].items():
            print(f"{row['source']:7} {('16' if row['aligned'] else 'any'):5} {row['segments']:4d} "
                  f"{row['total_mib']:7.1f}  {name:14} {r['device_ms']:8.3f} {r['gbps']:7.1f} "
                  f"{r['host_us']:8.1f} {r['first_call_ms']:8.1f} {r['exact']}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--mib", type=int, default=None, help="bytes per table (default 256 on CUDA, 4 on CPU)")
    p.add_argument("--segments", type=int, nargs="+", default=[100, 300])
    p.add_argument("--block-bytes", type=int, nargs="+", default=[16384], help="Triton bytes per program")
    p.add_argument("--num-warps", type=int, nargs="+", default=[4], help="Triton warps per program")
    p.add_argument("--sources", nargs="+", default=["device", "pinned"], choices=["device", "pinned"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "executors.json"))
    args = p.parse_args(argv)
    device = torch.device(args.device)
    args.mib = args.mib or (256 if device.type == "cuda" else 4)
    rng = np.random.default_rng(args.seed)
    rows = []
    for n in args.segments:
        args_n = argparse.Namespace(**{**vars(args), "segments": n})
        for source in args.sources if device.type == "cuda" else ("device",):
            for aligned in (True, False):
                rows.append(scenario(args_n, device, source, aligned, rng))
    print_table(rows)
    info = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                torch=torch.__version__, triton=_triton_version(), mib=args.mib, reps=args.reps,
                block_bytes=args.block_bytes, date=datetime.datetime.now().isoformat(timespec="seconds"),
                commit=code_commit(), scenarios=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(info, indent=1))
    ok = all(r["exact"] for row in rows for r in row["results"].values())
    print(f"wrote {args.out}; byte-exact: {ok}")
    return 0 if ok else 1


def _triton_version():
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    sys.exit(main())
