"""Run one function on N forked CPU processes joined in a Gloo process group (FileStore rendezvous).

`run_processes(fn, world, args)` forks `world` children (torch.multiprocessing, fork start: about
0.1-0.4 s for 2-8 ranks, where spawn costs seconds), each calls `init_process_group("gloo")` on a
FileStore in a private temporary directory, runs `fn(rank, world, *args)` and tears the group down.
Rank 0's return value comes back to the caller. Any child failure (an exception, a crash, or the
overall timeout) ends every child and raises `ProcessesFailed` carrying one clean line per failed
rank ("rank 3: InvariantViolation: ...") instead of a wall of tracebacks. A rendezvous that drops
before any rank has joined the group (Gloo's "Connection closed by peer" when a peer's connection
breaks under load) is started again with fresh processes, up to RENDEZVOUS_ATTEMPTS times in all;
a rank has joined once every rank's connections are up (a barrier after the rendezvous).
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback

RENDEZVOUS_ATTEMPTS = 3  # launches in all when the rendezvous drops before any rank joined


class ProcessesFailed(RuntimeError):
    """One or more ranks failed; `errors` maps rank -> "ExceptionType: message" (-1: the launcher)."""

    def __init__(self, errors: dict, details: str = "", suffix: str = ""):
        self.errors = dict(errors)
        self.details = details  # full tracebacks of every failed rank
        self.suffix = suffix
        super().__init__("; ".join(f"rank {r}: {m}" if r >= 0 else m for r, m in self.errors.items()) + suffix)


def _child(rank, fn, world, workdir, args, pg_timeout):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share the machine's cores
    store = dist.FileStore(os.path.join(workdir, "store"), world)
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        # no rank runs the function before every rank has joined: one done early would close its
        # connections while a slower rank still sets up its own, and that rank's failure would be
        # taken for the function's
        dist.barrier()
    except BaseException as e:
        _record(workdir, rank, e)
        _mark(workdir, f"rendezvous.{rank}")
        raise
    _mark(workdir, f"joined.{rank}")  # from here on a failure is the function's: never started again
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            with open(os.path.join(workdir, "result.pkl"), "wb") as f:
                pickle.dump(result, f)
    except BaseException as e:
        _record(workdir, rank, e)
        raise
    finally:
        dist.destroy_process_group()


def _record(workdir, rank, e):
    with open(os.path.join(workdir, f"error.{rank}"), "w") as f:
        f.write(f"{type(e).__name__}: {e}\n\0{traceback.format_exc()}")


def _mark(workdir, name):
    open(os.path.join(workdir, name), "w").close()


def _rendezvous_dropped(workdir) -> bool:
    """A rank failed in init_process_group and none had joined the group."""
    names = os.listdir(workdir)
    return any(n.startswith("rendezvous.") for n in names) and not any(n.startswith("joined.") for n in names)


def _failure(e, workdir) -> ProcessesFailed:
    """Name the root cause first: a rank that died without raising (crash, os._exit), else the rank
    whose error came first, preferring real errors over the "connection closed by peer" that the
    others hit once it was gone; the rest follow as a count."""
    errors, details, when = {}, [], {}
    for name in sorted(os.listdir(workdir)):
        if name.startswith("error."):
            path = os.path.join(workdir, name)
            with open(path) as f:
                short, _, full = f.read().partition("\n\0")
            if short.strip():
                rank = int(name.split(".")[1])
                errors[rank], when[rank] = short.strip(), os.stat(path).st_mtime_ns
                details.append(full)
    first = getattr(e, "error_index", -1)
    if first not in errors and getattr(e, "exit_code", None) is not None:
        sig = getattr(e, "signal_name", None)
        errors[first] = f"killed by signal {sig}" if sig else f"exited with code {e.exit_code}"
        when[first] = -1
    if not errors:
        errors[first] = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        when[first] = -1
    collateral = ("Connection closed by peer", "Connection reset by peer", "connectFullMesh")
    lead = min(errors, key=lambda r: (any(c in errors[r] for c in collateral), when[r], r))
    msg = {lead: errors.pop(lead)}
    others = f" ({len(errors)} other rank(s) failed after it)" if errors else ""
    return ProcessesFailed(msg, "\n".join(details) or str(e), others)


def _stop(processes, grace: float = 2.0):
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def run_processes(fn, world: int, args: tuple = (), *, timeout: float = 600.0, pg_timeout: float = 120.0):
    """Run fn(rank, world, *args) on `world` forked Gloo ranks; return rank 0's result.

    Call before the parent has used torch's thread pools (forking after OpenMP started can hang the
    children). Raises ProcessesFailed on any failure or when the run exceeds `timeout` seconds.
    """
    import logging

    if world < 1:
        raise ValueError(f"world={world} is invalid: need at least one process")
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)  # its "Terminating process ..." warnings repeat what we report
    try:
        return _run(fn, world, args, timeout, pg_timeout)
    finally:
        spawn_log.setLevel(level)


def _run(fn, world, args, timeout, pg_timeout):
    import torch.multiprocessing as mp

    deadline = time.monotonic() + timeout
    for attempt in range(1, RENDEZVOUS_ATTEMPTS + 1):
        sys.stdout.flush()  # buffered output would be duplicated in every forked child
        sys.stderr.flush()
        with tempfile.TemporaryDirectory(prefix="reorder-procs-") as workdir:
            ctx = mp.start_processes(_child, args=(fn, world, workdir, args, pg_timeout), nprocs=world,
                                     start_method="fork", join=False)
            failure = None
            try:
                while not ctx.join(timeout=0.2):
                    if time.monotonic() > deadline:
                        failure = ProcessesFailed({-1: f"timed out after {timeout:g} s (a rank is stuck)"})
                        break
            except Exception as e:  # ProcessRaisedException / ProcessExitedException: the others are ended
                failure = _failure(e, workdir)
            finally:
                _stop(ctx.processes)
            if failure is not None and _rendezvous_dropped(workdir):
                if attempt < RENDEZVOUS_ATTEMPTS and time.monotonic() < deadline:
                    continue
                failure = ProcessesFailed(failure.errors, failure.details,
                                          f"{failure.suffix} (rendezvous failed {attempt} times)")
            if failure is not None:
                raise failure
            path = os.path.join(workdir, "result.pkl")
            if not os.path.exists(path):
                raise ProcessesFailed({-1: "rank 0 ended without a result"})
            with open(path, "rb") as f:
                return pickle.load(f)
