"""The runtime self-check (verify=N): each rank's per-sample, per-field checksums of what it read and
of what it assembled travel in the next window frame, every rank compares all of them alike, and a
mismatch raises the same ReorderError on every rank of the group at that window (here: the end of
the stream), naming window, micro-batch, holding rank and position, sample, field and source rank. Executors that flip a byte, drop a segment or swap two samples are
caught in every module and world shape; a correct executor never is; and the checksum is the same
on every path (pinned, pageable, device: a property against a plain per-byte loop)."""

import re
import threading

import expecttest

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reorder import CostModel, Grid, ReorderError, WindowExchanger, run_emulated
from reorder.batch.blocks import byte_fields, field_buffers
from reorder.batch.checksum import checksums
from reorder.batch.layout import describe
from reorder.cli import synthetic as syn
from reorder.cli.synthetic import module_fields
from reorder.exchange.executors import TorchExecutor
from reorder.exchange.round import WindowRound
from reorder.integrations.megatron import select_fields
from reorder.plan import wire
from reorder.plan.checksums import CHECKED_FIELDS, word_width
from reorder.plan.counts import COLUMNS, SampleCounts
from reorder.plan.grid import canonical_grid
from reorder.plan.segments import Segments

COST = CostModel()
LAYOUTS = [(1, 2), (2, 4), (2, 3), (1, 4), (3, 6)]
MASK64 = (1 << 64) - 1


class Faulty(TorchExecutor):
    """The torch executor, wrong in one way on its first table that moves bytes."""

    def __init__(self, fault):
        super().__init__()
        self.fault, self.done = fault, False

    def run(self, segments, sources, destinations, held=None):
        live = segments.take(segments.nbytes > 0)
        if self.done or not len(live):
            return super().run(segments, sources, destinations)
        self.done = True
        if self.fault == "drop":  # the largest segment is never copied (its bytes stay as allocated: zeros)
            for d in destinations:
                d.zero_()
            keep = np.ones(len(live), bool)
            keep[int(np.argmax(live.nbytes))] = False
            return super().run(live.take(keep), sources, destinations)
        if self.fault == "swap":  # two segments of one size land in each other's place
            sizes, first = np.unique(live.nbytes, return_index=True)
            pair = next(np.flatnonzero(live.nbytes == n)[:2] for n in sizes if (live.nbytes == n).sum() > 1)
            dst = live.dst_off.copy()
            dst[pair] = dst[pair[::-1]]
            live = Segments.of(live.src_buf, live.src_off, live.dst_buf, dst, live.nbytes)
            return super().run(live, sources, destinations)
        super().run(live, sources, destinations)  # flip: one byte of the largest segment
        i = int(np.argmax(live.nbytes))
        d = destinations[int(live.dst_buf[i])].reshape(-1).view(torch.uint8)
        d[int(live.dst_off[i]) + int(live.nbytes[i]) // 2] ^= 0x10


def stream(dps, seed, faulty=None, fault="flip", verify=1):
    """Every module's ranks exchange one window with the self-check on, then end the stream; rank
    `faulty` = (module, rank) runs the faulty executor. Returns {module: [each rank's result or
    exception]}."""
    groups = canonical_grid(list(dps.values()))
    rng = np.random.default_rng(seed)
    batch = syn.make_global_batch(rng, 2 * groups, 256, features=8, mix="large", first_id=0, scale=0.05)
    out = {}
    for module, dp in dps.items():
        def fn(r, coll, module=module, dp=dp):
            ex = WindowExchanger(grid=Grid(size=groups, dp=dp, rank=r), micro_batch_size=2 * groups, cost=COST,
                                 balancer="lpt", collectives=coll if dp > 1 else None, verify=verify)
            if faulty == (module, r):
                ex.round._executors[torch.device("cpu")] = Faulty(fault)
            share = select_fields(syn.rank_share(batch, dp, r), module_fields(module, COST))
            got, report = ex.exchange([share])
            ex.exchange([])
            return report
        out[module] = run_emulated(dp, fn, timeout=30, return_exceptions=True)
    return out


@pytest.mark.parametrize("dps", LAYOUTS, ids=str)
def test_a_correct_exchange_passes_the_check(dps):
    for module, results in stream({"vision": dps[0], "language": dps[1]}, seed=sum(dps)).items():
        assert all(not isinstance(r, BaseException) for r in results), results
        assert results[0].moved_samples > 0 or len(results) == 1


@pytest.mark.parametrize("fault", ["flip", "drop", "swap"])
@pytest.mark.parametrize("dps", LAYOUTS, ids=str)
@pytest.mark.parametrize("module", ["vision", "language"])
def test_a_faulty_executor_is_caught_on_every_rank(dps, module, fault):
    dp = dict(vision=dps[0], language=dps[1])[module]
    res = stream({"vision": dps[0], "language": dps[1]}, seed=sum(dps) + 7, faulty=(module, dp - 1), fault=fault)
    seen = res[module]
    assert all(isinstance(e, ReorderError) for e in seen), seen
    msg = str(seen[0])
    assert len({str(e) for e in seen}) == 1  # the same error on every rank of the group
    m = re.fullmatch(r"self-check failed: window 0, micro-batch 0: rank (\d+) holds at position (\d+) the sample of "
                     r"natural position (\d+) \(read by rank (\d+)\), and it differs in field '[^']+' from what rank "
                     r"(\d+) read \(\d+ \(sample, field\) checksum\(s\) differ\)", msg)
    assert m, msg
    holder, pos, natural, reader, again = map(int, m.groups())
    b = 2 * canonical_grid([dps[0], dps[1]]) // dp
    assert holder < dp and pos < b and reader == again == natural // b
    other = res["language" if module == "vision" else "vision"]
    assert all(not isinstance(r, BaseException) for r in other)


def test_the_check_runs_every_nth_window_only():
    """verify=2 checks windows 0, 2, 4, ...: a fault in window 1 goes unseen, one in window 2 is caught."""
    def run(fault_window):
        def fn(r, coll):
            ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=8, cost=COST, balancer="lpt",
                                 collectives=coll, verify=2)
            rng = np.random.default_rng(3)
            for k in range(4):
                if k == fault_window and r == 1:
                    ex.round._executors[torch.device("cpu")] = Faulty("flip")
                g = syn.make_global_batch(rng, 8, 256, features=8, mix="large", first_id=8 * k, scale=0.05)
                ex.exchange([syn.rank_share(g, 2, r)])
                ex.round._executors.pop(torch.device("cpu"), None)
            ex.exchange([])
        return run_emulated(2, fn, timeout=30, return_exceptions=True)
    assert run(1) == [None, None]
    caught = run(2)
    assert all(isinstance(e, ReorderError) and "window 2" in str(e) for e in caught), caught


@pytest.mark.parametrize("verify", [0, 1, 2])
def test_the_exchanger_counts_the_windows_and_samples_it_verified(verify):
    """verified_windows / verified_samples: the checked windows that moved samples (the others are
    not checked), each counted once every rank found its sums equal, at the next window or at the
    end of the stream; the same on every rank."""
    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=8, cost=COST, balancer="lpt",
                             collectives=coll, verify=verify)
        rng = np.random.default_rng(11)
        moved, seen = [], []
        for k in range(6):
            g = syn.make_global_batch(rng, 8, 256, features=8, mix="large", first_id=8 * k, scale=0.05,
                                      text_only=1.0 if k == 3 else 0.2)  # window 3: no image, nothing to move
            _, report = ex.exchange([syn.rank_share(g, 2, r)])
            moved.append(bool((report.orders != np.arange(8)).any()))
            seen.append(ex.verified_windows)
        ex.exchange([])
        return moved, seen, ex.verified_windows, ex.verified_samples
    results = run_emulated(2, fn, timeout=30)
    assert results[0] == results[1]
    moved, seen, windows, samples = results[0]
    checked = [m and verify > 0 and k % verify == 0 for k, m in enumerate(moved)]
    assert sum(moved) >= 3 and (verify != 1 or not all(moved))  # some windows move samples, one does not
    assert windows == sum(checked) and samples == 8 * windows
    # a checked window is counted at the next window: before then, only the windows before it
    assert seen == [sum(checked[:k]) for k in range(6)]


def spec_mix(x: int) -> int:
    """The documented mix on Python integers (unsigned, mod 2**64; the shift is arithmetic)."""
    h = (x * 0x9E3779B97F4A7C15) & MASK64
    signed = h - (1 << 64) if h >> 63 else h
    return (h ^ ((signed >> 29) & MASK64)) & MASK64 | 1


def spec_checksums(batch, n, fields_order) -> np.ndarray:
    """The documented checksums, one word at a time from the spec's per-sample bytes: each field of
    each sample is a list of entries (dense: one per leading index; rows / images; one for lists)."""
    out = np.zeros((n, CHECKED_FIELDS), np.uint64)
    for j, sample in enumerate(per_sample_entries(batch, n)):
        for f, (name, width) in enumerate(fields_order):
            salt = max(0, f - (CHECKED_FIELDS - 1)) << 32
            total = int(out[j, min(f, CHECKED_FIELDS - 1)])
            for e, entry in enumerate(sample[name]):
                for c in range(0, len(entry), width):
                    w = int.from_bytes(entry[c:c + width], "little", signed=width > 1)
                    total = (total + (w + 1) * spec_mix(c) * spec_mix(e + salt)) & MASK64
            out[j, min(f, CHECKED_FIELDS - 1)] = total
    return out


def per_sample_entries(batch, n) -> list:
    """Per sample, per field name: its entries' bytes (input_ids, position_ids, ... then vision rows)."""
    out = [dict() for _ in range(n)]
    for key, v in batch.items():
        if key == "modality_inputs":
            continue
        if key == "position_ids" and v.dim() == 3:
            for j in range(n):
                out[j][key] = [bytes(v[p, j].contiguous().view(torch.uint8).numpy()) for p in range(v.shape[0])]
        else:
            for j in range(n):
                out[j][key] = [bytes(v[j].contiguous().reshape(-1).view(torch.uint8).numpy())]
    vit = batch["modality_inputs"]["images"]["vit"]
    thw = vit["grid_thw"].tolist()
    ids = batch["input_ids"]
    img = row = 0
    for j in range(n):
        k = int((ids[j] == syn.VISION_START).sum())
        rows = sum(t * h * w for t, h, w in thw[img:img + k])
        out[j]["grid_thw"] = [bytes(vit["grid_thw"][i].contiguous().view(torch.uint8).numpy())
                              for i in range(img, img + k)]
        out[j]["hidden_states"] = [bytes(vit["hidden_states"][r].contiguous().view(torch.uint8).numpy())
                                   for r in range(row, row + rows)]
        img, row = img + k, row + rows
    return out


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 5))
def test_checksums_are_the_documented_sum_over_every_sample_and_field(seed, n):
    g = syn.make_global_batch(np.random.default_rng(seed), n, 24, features=3, mix="small", first_id=0)
    vit = g["modality_inputs"]["images"]["vit"]
    vit["hidden_states"] = vit["hidden_states"].to(torch.float16)  # rows of 6 bytes: 2-byte words
    layout, shard = describe(g, n, vision_start_token_id=syn.VISION_START)
    layout = layout.resolved()
    fields = byte_fields(layout)
    counts = SampleCounts.of(rows=shard.row_counts, images=shard.image_counts)
    bufs = field_buffers(layout, shard, [])
    got = checksums(bufs, fields, counts).numpy().view(np.uint64)
    names = [p[-1] for p in [f.path for f in layout.dense] + [f.path for f in layout.ragged]]
    order = [(name, word_width(kind, unit)) for name, (kind, pre, unit) in zip(names, fields)]
    assert (got == spec_checksums(g, n, order)).all()
    # one flipped byte anywhere changes its sample's checksum of that field, and nothing else
    b = int(np.argmax([x.numel() for x in bufs]))
    flipped = [x.clone() for x in bufs]
    flipped[b].reshape(-1).view(torch.uint8)[0] ^= 1
    again = checksums(flipped, fields, counts).numpy().view(np.uint64)
    assert (again != got).sum() == 1


def test_without_the_check_the_same_fault_passes_silently():
    """The faults above corrupt micro-batches without any error of their own: the check is what
    catches them."""
    res = stream({"vision": 2, "language": 4}, seed=13, faulty=("language", 3), fault="flip", verify=0)
    assert all(not isinstance(r, BaseException) for rs in res.values() for r in rs), res


def exchange_by_hand(rounds, windows):
    """Drive every rank's WindowRound through one window (`windows[r]`: rank r's micro-batches; [] ends
    the stream), carrying the frames and the all_to_all by hand. Returns (every rank's window frame,
    every rank's (micro-batches, report))."""
    frames = np.stack([rd.read(w) for rd, w in zip(rounds, windows)])
    for rd in rounds:
        assert rd.gathered(frames) is None
    out = [rd.pack() for rd in rounds]
    received = [None] * len(rounds)
    if any(o is not None for o in out):
        chunks = [list(torch.split(o.buffer, o.send_splits)) for o in out]
        received = [torch.cat([chunks[q][r] for q in range(len(rounds))]) for r in range(len(rounds))]
    return frames, [rd.finish(got) for rd, got in zip(rounds, received)]


def test_a_checked_window_s_sums_travel_in_the_next_frame():
    """Window 0's sums ride in the next window frame (here the end of the stream's), not in its own:
    each rank's sums of the samples it read, in natural order, then of what it assembled, in output
    order, each the documented sum (`spec_checksums`) of that sample's bytes."""
    n, dp = 4, 2
    g = syn.make_global_batch(np.random.default_rng(5), n, 24, features=3, mix="large", first_id=0, scale=0.05)
    rounds = [WindowRound(grid=Grid(size=2, dp=dp, rank=r), micro_batch_size=n, cost=COST, balancer="lpt", verify=1)
              for r in range(dp)]
    config = np.stack([rd.config_frame() for rd in rounds])
    for rd in rounds:
        rd.agree(config)
    first, results = exchange_by_hand(rounds, [[syn.rank_share(g, dp, r)] for r in range(dp)])
    report = results[0][1]
    assert report.moved_samples > 0  # the window moves samples between the ranks
    words = 2 * CHECKED_FIELDS
    assert not wire.sums_of(first, 1, n // dp, len(COLUMNS), words).any()  # nothing checked before window 0
    last, _ = exchange_by_hand(rounds, [[] for _ in range(dp)])
    sums = wire.sums_of(last, 1, n // dp, len(COLUMNS), words)[0].view(np.uint64)  # [n, 2F]
    layout = describe(g, n, vision_start_token_id=syn.VISION_START)[0].resolved()
    names = [p[-1] for p in [f.path for f in layout.dense] + [f.path for f in layout.ragged]]
    order = [(name, word_width(kind, unit)) for name, (kind, pre, unit) in zip(names, byte_fields(layout))]
    want = spec_checksums(g, n, order)
    assert (sums[:, :CHECKED_FIELDS] == want).all()
    assert (sums[:, CHECKED_FIELDS:] == want[report.orders[0]]).all()


@settings(max_examples=60, deadline=None)
@given(dp=st.integers(1, 4), local=st.integers(1, 3), window=st.integers(1, 3), data=st.data())
def test_the_compared_sums_are_those_the_frames_carry_for_each_output_position(dp, local, window, data):
    """The round compares, per output position p of slot s, the receiver's sums there with the
    sender's sums of its natural sample orders[s, p], taking both from the gathered frames through
    indices made once (`_sum_index`): they equal `wire.sums_of`'s, whatever the world and window."""
    b = dp * local
    rd = WindowRound(grid=Grid(size=dp, dp=dp, rank=0), micro_batch_size=b, cost=COST, window_size=window, verify=1)
    words = wire.window_words(window, local, len(COLUMNS), 2 * CHECKED_FIELDS)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    frames = rng.integers(-2**62, 2**62, size=(dp, words))
    w = data.draw(st.integers(1, window))
    orders = np.stack([rng.permutation(b) for _ in range(w)])
    sent_at, got_at, first = rd._sums_at
    sums = wire.sums_of(frames, w, local, len(COLUMNS), 2 * CHECKED_FIELDS)
    flat = frames.ravel()
    assert (flat[got_at[:w]] == sums[..., CHECKED_FIELDS:]).all()
    assert (flat[sent_at[orders + first[:w]]] == sums[np.arange(w)[:, None], orders, :CHECKED_FIELDS]).all()


class TestMessage(expecttest.TestCase):
    def test_the_error_names_window_holder_sample_field_and_reader(self):
        res = stream({"vision": 2, "language": 4}, seed=13, faulty=("language", 3), fault="flip")
        self.assertExpectedInline(str(res["language"][0]), """self-check failed: window 0, micro-batch 0: rank 2 holds at position 0 the sample of natural position 7 (read by rank 3), and it differs in field 'input_ids' from what rank 3 read (1 (sample, field) checksum(s) differ)""")


def holding(monkeypatch, which):
    """The round's placement with `held` = which(source index): the sources the check must read
    early (on a CUDA target, those read in place from pinned host memory) chosen on the CPU."""
    from reorder.exchange import round as round_module
    from reorder.exchange.placement import Placement, place

    def held_place(target, sources, **kw):
        p = place(target, sources, **kw)
        return Placement(target=p.target, executor=p.executor, direct=p.direct,
                         held=tuple(bool(which(i)) for i in range(len(sources))))

    monkeypatch.setattr(round_module, "place", held_place)


@pytest.mark.parametrize("held", ["none", "every other", "all"])
def test_held_sources_are_summed_before_the_executor_reads_them_the_rest_with_the_assembled(monkeypatch, held):
    """In a checked window the sources that the executor reads in place from host memory (held)
    are summed by a launch of their own before the window's first executor run (pack, assemble):
    a copy that reads them late is then caught, not hidden by the checksum's hold. Everything else
    (what this rank assembled, its other sources) is summed after the last run, in one launch: with
    no held source, one launch a window."""
    from reorder.exchange import round as round_module
    which = {"none": lambda i: False, "every other": lambda i: i % 2, "all": lambda i: True}[held]
    holding(monkeypatch, which)
    events = {}  # rank (its thread) -> what it did, in order
    sums = round_module.window_checksums

    def recording_sums(parts, fields, device, **kw):
        events.setdefault(threading.get_ident(), []).append(("sums", [t is None for bufs, _ in parts for t in bufs]))
        return sums(parts, fields, device, **kw)

    class Recording(TorchExecutor):
        def run(self, segments, sources, destinations, held=None):
            events.setdefault(threading.get_ident(), []).append(("run", None))
            return super().run(segments, sources, destinations)

    monkeypatch.setattr(round_module, "window_checksums", recording_sums)

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=8, cost=COST, balancer="lpt",
                             collectives=coll, verify=1)
        ex.round._executors[torch.device("cpu")] = Recording()
        g = syn.make_global_batch(np.random.default_rng(3), 8, 256, features=8, mix="large", first_id=0, scale=0.05)
        _, report = ex.exchange([syn.rank_share(g, 2, r)])
        ex.exchange([])
        return report.moved_samples

    moved = run_emulated(2, fn, timeout=30)
    assert moved[0] > 0 and len(events) == 2
    for seq in events.values():
        steps = [what for what, _ in seq]
        left_out = [none for _, none in seq if none is not None]
        if held == "none":
            assert steps == ["run", "run", "sums"], steps
            nf = len(left_out[0]) // 2  # the sources, then one part assembled
            assert not any(left_out[0])
        else:
            assert steps == ["sums", "run", "run", "sums"], steps  # pack and assemble between the two launches
            early, late = left_out
            nf = len(early)
            assert [not x for x in early] == [bool(which(i)) for i in range(nf)]  # the held ones only
            assert not any(late[-nf:])  # what it assembled, whole
            if held == "all":
                assert len(late) == nf  # no other source: the assembled part alone
            else:
                assert late[:nf] == [not x for x in early]  # first the other sources: the complement
        assert nf > 2


@pytest.mark.parametrize("fault", ["flip", "drop", "swap"])
@pytest.mark.parametrize("held", ["every other", "all"])
def test_a_fault_is_caught_whether_its_source_was_summed_early_or_late(monkeypatch, fault, held):
    """The sender's sums of held sources (their own launch) and of the others (with the assembled
    ones) add up to what the sender read: a correct exchange passes, a faulty executor is caught on
    every rank."""
    holding(monkeypatch, (lambda i: i % 2) if held == "every other" else (lambda i: True))
    ok = stream({"vision": 2, "language": 4}, seed=21)
    assert not any(isinstance(r, BaseException) for rs in ok.values() for r in rs), ok
    res = stream({"vision": 2, "language": 4}, seed=21, faulty=("language", 1), fault=fault)
    errors = [r for r in res["language"]]
    assert all(isinstance(e, ReorderError) and "self-check failed" in str(e) for e in errors), errors
    assert len({str(e) for e in errors}) == 1


def _one_slot_gated(r, coll, fault, reverse=False):
    """Rank r of a dp-2 group, the check on every window and the gate on, after a window of two
    micro-batches of which the gate keeps the first as it is (the second with `reverse`) and the
    other moves samples; rank 1 runs the faulty executor when `fault`. Returns the exchanger, the
    window's report and the check's rows (per slot, the part of its assembled sums)."""
    ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=8, cost=COST, balancer="lpt",
                         collectives=coll, verify=1, window_size=2, min_gain=0.1)
    if fault and r == 1:
        ex.round._executors[torch.device("cpu")] = Faulty(fault)
    rng = np.random.default_rng(4)
    gs = [syn.make_global_batch(rng, 8, 256, features=8, mix="large", first_id=8 * k, scale=0.05) for k in (0, 1)]
    _, report = ex.exchange([syn.rank_share(g, 2, r) for g in (gs[::-1] if reverse else gs)])
    return ex, report, ex.round._check.rows


@pytest.mark.parametrize("fault", [None, "flip"])
def test_a_kept_slot_is_summed_once_and_still_compared(monkeypatch, fault):
    """A slot this rank keeps as it is (here: gated, on every rank), with no held source, hands out
    its sources: the call after the assembly reads them once, as the sender's, and its assembled
    sums are those. The other slot is summed as assembled; a correct window passes, a byte flipped
    in the moved slot is caught on every rank."""
    from reorder.exchange import round as round_module
    calls = {}  # rank (its thread) -> per checksum call, its parts' buffers
    sums = round_module.window_checksums

    def recording_sums(parts, fields, device, **kw):
        calls.setdefault(threading.get_ident(), []).append([bufs for bufs, _ in parts])
        return sums(parts, fields, device, **kw)

    monkeypatch.setattr(round_module, "window_checksums", recording_sums)

    def fn(r, coll):
        ex, report, kept = _one_slot_gated(r, coll, fault)
        ex.exchange([])
        return report.gated_slots, report.moved_samples, kept

    got = run_emulated(2, fn, timeout=30, return_exceptions=True)
    if fault:
        assert all(isinstance(e, ReorderError) and "self-check failed" in str(e) for e in got), got
        assert len({str(e) for e in got}) == 1
        return
    assert [(g, m) for g, m, _ in got] == [(1, 2), (1, 2)]  # one slot gated (kept), one moving samples
    for (_, _, rows), (call,) in zip(got, calls.values()):
        assert len(call) == 3  # both slots' sources, then the moved slot as assembled
        moved = next(s for s, row in enumerate(rows) if row == 2)
        assert rows[1 - moved] == 1 - moved  # the kept slot's assembled sums: its sources' part
        assert all(t is not None for bufs in call for t in bufs)


@pytest.mark.parametrize("fault", [None, "flip"])
@pytest.mark.parametrize("held", ["every other", "all"])
@pytest.mark.parametrize("kept", [0, 1])
def test_a_kept_slot_with_held_sources_is_summed_whole_as_assembled(monkeypatch, kept, held, fault):
    """A slot this rank keeps as it is but whose sources are partly or all held (read in place from
    pinned memory: summed early, by their own launch) hands out those very sources: the call after
    the assembly reads them all again as its assembled part, beside the sender's late sources (none
    when all are held), so its sums add up to what was read. A correct window passes; a byte
    flipped in the moved slot is caught on every rank."""
    from reorder.exchange import round as round_module
    holding(monkeypatch, (lambda i: i % 2) if held == "every other" else (lambda i: True))
    calls = {}  # rank (its thread) -> per checksum call, per part, its buffers left out (None)
    sums = round_module.window_checksums

    def recording_sums(parts, fields, device, **kw):
        calls.setdefault(threading.get_ident(), []).append([[t is None for t in bufs] for bufs, _ in parts])
        return sums(parts, fields, device, **kw)

    monkeypatch.setattr(round_module, "window_checksums", recording_sums)

    def fn(r, coll):
        ex, report, rows = _one_slot_gated(r, coll, fault, reverse=kept == 1)
        ex.exchange([])
        natural = (report.orders == np.arange(8)).all(axis=1)
        return report.gated_slots, np.flatnonzero(natural).tolist(), report.moved_samples, rows, ex.verified_windows

    got = run_emulated(2, fn, timeout=30, return_exceptions=True)
    if fault:
        assert all(isinstance(e, ReorderError) and "self-check failed" in str(e) for e in got), got
        assert len({str(e) for e in got}) == 1
        return
    assert [(g, k, m, v) for g, k, m, _, v in got] == [(1, [kept], 2, 1)] * 2  # slot `kept` gated; verified
    late = 2 if held == "every other" else 0  # the slots' late sources, first (none when every source is held)
    for (*_, rows, _), (early, after) in zip(got, calls.values()):
        assert len(early) == 2 and len(after) == late + 2  # then the moved slot as assembled, the kept one whole
        assert sorted(rows) == [late, late + 1]  # every slot's assembled sums in a part of its own
        assert all(not any(part) for part in after[late:])  # which leaves no buffer out


def test_the_sender_sums_the_very_buffers_the_executor_reads(monkeypatch):
    """A checked window makes each slot's buffers once: the sender's checksums (the held sources in
    their own launch, the others with the assembled ones) read the same tensors that the executor's
    pack and assemble read (not copies made a second time, such as the pickled lists'
    concatenation), and `field_buffers` runs once per slot."""
    from reorder.exchange import round as round_module
    holding(monkeypatch, lambda i: i % 3 == 0)
    made, summed, read = {}, {}, {}  # rank (its thread) -> field_buffers calls / the sums' buffers / the executor's
    sums, buffers = round_module.window_checksums, round_module.field_buffers

    def counting_buffers(*a, **k):
        made[threading.get_ident()] = made.get(threading.get_ident(), 0) + 1
        return buffers(*a, **k)

    def recording_sums(parts, fields, device, **kw):
        summed.setdefault(threading.get_ident(), []).append([t for bufs, _ in parts for t in bufs])
        return sums(parts, fields, device, **kw)

    class Recording(TorchExecutor):
        def run(self, segments, sources, destinations, held=None):
            read.setdefault(threading.get_ident(), []).append(list(sources))
            return super().run(segments, sources, destinations)

    monkeypatch.setattr(round_module, "window_checksums", recording_sums)
    monkeypatch.setattr(round_module, "field_buffers", counting_buffers)

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=8, cost=COST, balancer="lpt",
                             collectives=coll, verify=1, window_size=2)
        ex.round._executors[torch.device("cpu")] = Recording()
        rng = np.random.default_rng(5)
        gs = [syn.make_global_batch(rng, 8, 256, features=8, mix="large", first_id=8 * k, scale=0.05) for k in (0, 1)]
        for g in gs:
            g["sample_ids"] = [f"s{i}" for i in range(8)]  # a per-sample list: its buffer is made by concatenation
        _, report = ex.exchange([syn.rank_share(g, 2, r) for g in gs])
        ex.exchange([])
        return report.moved_samples

    moved = run_emulated(2, fn, timeout=30)
    assert moved[0] > 0 and len(made) == 2
    for rank in made:
        early, late = summed[rank]
        pack, assemble = read[rank]
        late = late[:len(early)]  # before what this rank assembled: its sources not held
        assert all((a is None) != (b is None) for a, b in zip(early, late, strict=True))
        sent = [a if b is None else b for a, b in zip(early, late)]
        assert made[rank] == 2  # once per slot of the one window
        assert all(a is b for a, b in zip(sent, pack, strict=True)), "the sender summed other tensors than pack read"
        assert all(a is b for a, b in zip(sent, assemble[1:], strict=True))  # assemble: the received buffer first


@pytest.mark.parametrize("held", ["none", "every other"])
def test_the_round_vouches_only_for_buffers_the_kernel_reads_by_address(monkeypatch, held):
    """The round tells the checksum that its buffers are placed (`placed=True`: none is asked whether
    the kernel reads it by address), and that holds: every buffer it gives is contiguous and on
    the target (here the CPU; on CUDA also pinned host memory read in place), even where a field
    came as a non-contiguous view and the per-sample lists as Python objects; the window passes."""
    from reorder.batch.checksum import _readable
    from reorder.exchange import round as round_module
    holding(monkeypatch, {"none": lambda i: False, "every other": lambda i: i % 2}[held])
    calls, sums = [], round_module.window_checksums

    def vouching_sums(parts, fields, device, **kw):
        calls.append((kw.get("placed"), [_readable(t, torch.device(device), True) for bufs, _ in parts
                                         for t in bufs if t is not None]))
        return sums(parts, fields, device, **kw)

    monkeypatch.setattr(round_module, "window_checksums", vouching_sums)

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=8, cost=COST, balancer="lpt",
                             collectives=coll, verify=1)
        g = syn.make_global_batch(np.random.default_rng(3), 8, 256, features=8, mix="large", first_id=0, scale=0.05)
        g["sample_ids"] = [f"s{i}" for i in range(8)]
        share = syn.rank_share(g, 2, r)
        share["loss_mask"] = share["loss_mask"].t().contiguous().t()  # the same values, not contiguous
        assert not share["loss_mask"].is_contiguous()
        _, report = ex.exchange([share])
        ex.exchange([])
        return report.moved_samples

    moved = run_emulated(2, fn, timeout=30)
    assert moved[0] > 0 and len(calls) == (2 if held == "none" else 4)
    assert all(placed is True and all(readable) and readable for placed, readable in calls), calls


@pytest.mark.parametrize("lists", [False, True])
def test_the_sums_are_launched_behind_the_writes_before_the_outputs_are_rebuilt(monkeypatch, lists):
    """A checked window's sums are asked for right after the executor has written the outputs (and,
    with per-sample lists, after their bytes were read back: a wait for the device that must not
    wait for the sums too), before any output micro-batch is rebuilt: on CUDA the device reads them
    while the host rebuilds, so the window's device time ends sooner."""
    from reorder.exchange import round as round_module
    events = []
    sums, rebuild, read_lists = round_module.window_checksums, round_module.rebuild, round_module.read_lists
    monkeypatch.setattr(round_module, "window_checksums", lambda *a, **k: events.append("sums") or sums(*a, **k))
    monkeypatch.setattr(round_module, "rebuild", lambda *a, **k: events.append("rebuild") or rebuild(*a, **k))
    monkeypatch.setattr(round_module, "read_lists", lambda *a, **k: events.append("lists") or read_lists(*a, **k))

    class Recording(TorchExecutor):
        def run(self, segments, sources, destinations, held=None):
            events.append("run")
            return super().run(segments, sources, destinations)

    ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=8, cost=COST, window_size=2, verify=1)
    ex.round._executors[torch.device("cpu")] = Recording()
    rng = np.random.default_rng(6)
    gs = [syn.make_global_batch(rng, 8, 256, features=8, mix="large", first_id=8 * k, scale=0.05) for k in (0, 1)]
    for g in gs:
        if lists:
            g["sample_ids"] = [f"s{i}" for i in range(8)]
    _, report = ex.exchange(gs)
    moved = int((report.orders != np.arange(8)).any(axis=1).sum())
    assert moved >= 1, report.orders  # slots written (and rebuilt); a natural one is kept as given
    assert events == ["run"] + ["lists"] * moved * lists + ["sums"] + ["rebuild"] * moved, events
    ex.exchange([])
    assert ex.verified_windows == 1


def test_the_last_window_is_compared_after_this_window_s_sums_are_launched(monkeypatch):
    """The comparison of the last checked window (its sums travelled in this window's frame) comes
    after this window's own sums are asked for: on CUDA the host compares while the device sums.
    Every window is still counted as verified once, the last at the end of the stream."""
    from reorder.exchange import round as round_module
    events = []
    sums, compared = round_module.window_checksums, WindowRound._compared
    monkeypatch.setattr(round_module, "window_checksums", lambda *a, **k: events.append("sums") or sums(*a, **k))
    monkeypatch.setattr(WindowRound, "_compared", lambda *a: events.append("compare") or compared(*a))
    ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=8, cost=COST, verify=1)
    rng = np.random.default_rng(3)
    gs = [syn.make_global_batch(rng, 8, 256, features=8, mix="large", first_id=8 * k, scale=0.05) for k in range(3)]
    reports = [ex.exchange([g])[1] for g in gs]
    assert all((r.orders != np.arange(8)).any() for r in reports)  # every window permutes: all are checked
    assert events == ["sums", "sums", "compare", "sums", "compare"], events
    assert ex.verified_windows == 2
    ex.exchange([])
    assert events[-1] == "compare" and ex.verified_windows == 3 and ex.verified_samples == 24


def _after_a_corrupted_window(r, coll, g):
    """Rank r's exchanger of a dp-2 group, the check on every window, after a first window (global
    micro-batch g) that moved samples and in which rank 1's executor flipped a byte."""
    ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=8, cost=COST, balancer="lpt",
                         collectives=coll, verify=1)
    if r == 1:
        ex.round._executors[torch.device("cpu")] = Faulty("flip")
    _, report = ex.exchange([syn.rank_share(g, 2, r)])
    assert report.moved_samples > 0
    return ex


@pytest.mark.parametrize("bad", ["source", "layout"])
def test_a_corrupted_window_is_reported_before_the_next_window_s_own_error(bad):
    """When the window after a corrupted one fails on its own (a data source raised on one rank, or
    the ranks' layouts differ), every rank raises the self-check's error first: the corruption is
    the worse news, and the other error is its context."""
    rng = np.random.default_rng(8)
    gs = [syn.make_global_batch(rng, 8, 256, features=8, mix="large", first_id=8 * k, scale=0.05) for k in (0, 1)]

    def fn(r, coll):
        ex = _after_a_corrupted_window(r, coll, gs[0])
        second = syn.rank_share(gs[1], 2, r)
        if bad == "layout" and r == 0:
            second["extra"] = torch.zeros(4, 3)
        ex.exchange([second], error=RuntimeError("disk gone") if bad == "source" and r == 0 else None)

    errors = run_emulated(2, fn, timeout=30, return_exceptions=True)
    assert all(isinstance(e, ReorderError) and str(e).startswith("self-check failed: window 0") for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    context = str(errors[0].__context__)
    assert ("disk gone" in context) if bad == "source" else ("layout" in context), context


@pytest.mark.parametrize("fault", [None, "flip"])
def test_cross_slot_windows_are_checked_by_their_flat_natural_ids(fault):
    """With cross_slot a window's orders list flat natural ids (slot * B + j) across its
    micro-batches: each output position is compared with the sender's sums of that id (its own
    micro-batch and position), every window of a correct exchange is verified, and a flipped byte
    is caught with the same error on every rank, naming where the sample came from."""
    dp, w, b = 2, 2, 8
    rng = np.random.default_rng(1)
    gs = [[syn.make_global_batch(rng, b, 256, features=8, mix="large", first_id=b * (k * w + s), scale=0.05)
           for s in range(w)] for k in range(3)]

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=dp, dp=dp, rank=r), micro_batch_size=b, cost=COST, balancer="lpt",
                             window_size=w, collectives=coll, verify=1, cross_slot=True)
        if fault and r == 1:
            ex.round._executors[torch.device("cpu")] = Faulty(fault)
        crossed = 0
        for g in gs:
            _, report = ex.exchange([syn.rank_share(x, dp, r) for x in g])
            crossed += int((report.orders // b != np.arange(w)[:, None]).any())  # a sample changed micro-batch
        ex.exchange([])
        return crossed, ex.verified_windows

    got = run_emulated(dp, fn, timeout=30, return_exceptions=True)
    if fault:
        assert all(isinstance(e, ReorderError) and "self-check failed: window 0" in str(e) for e in got), got
        assert len({str(e) for e in got}) == 1
        assert re.search(r"the sample of micro-batch \d, natural position \d \(read by rank \d\)", str(got[0])), got[0]
        return
    assert not any(isinstance(x, BaseException) for x in got), got
    assert got[0][0] >= 1 and got[0][1] == 3 and got[1] == got[0]  # samples crossed micro-batches; all verified


@pytest.mark.parametrize("where", ["pack", "all_to_all"])
def test_a_corrupted_window_is_reported_when_the_next_window_fails_between_plan_and_finish(where):
    """The window after a corrupted one fails after it was planned: in one rank's pack (e.g. out of
    memory for its send buffer), or in the all_to_all on every rank. Every rank still raises the
    self-check's error, the other failure as its context (a rank that failed alone in pack leaves
    its peers in the all_to_all until it times out, as without the check)."""
    from reorder.exchange.collectives import CollectiveError
    rng = np.random.default_rng(9)
    gs = [syn.make_global_batch(rng, 8, 256, features=8, mix="large", first_id=8 * k, scale=0.05) for k in (0, 1)]

    def fn(r, coll):
        ex = _after_a_corrupted_window(r, coll, gs[0])  # the next window moves samples too: every rank sends
        if where == "pack" and r == 0:
            ex.round._executors[torch.device("cpu")].run = lambda *a, **k: (_ for _ in ()).throw(
                RuntimeError("out of memory"))
        if where == "all_to_all":
            def failing(*a, **k):
                raise CollectiveError(f"rank {r}: all_to_all failed")
            ex._all_to_all = failing
        ex.exchange([syn.rank_share(gs[1], 2, r)])

    errors = run_emulated(2, fn, timeout=3, return_exceptions=True)
    assert all(isinstance(e, ReorderError) and str(e).startswith("self-check failed: window 0") for e in errors), errors
    assert len({str(e) for e in errors}) == 1
    contexts = [type(e.__context__).__name__ for e in errors]
    assert contexts == (["RuntimeError", "CollectiveError"] if where == "pack" else ["CollectiveError"] * 2), contexts


@settings(max_examples=30, deadline=None)
@given(dp=st.sampled_from([1, 2, 3]), window=st.integers(1, 3), micro_batches=st.integers(1, 5),
       cross_slot=st.booleans(), min_gain=st.sampled_from([None, 0.05]), backoff=st.sampled_from([0, 2]),
       shadow=st.booleans(), verify=st.integers(1, 3), held=st.sampled_from(["none", "every other"]),
       early_copy=st.booleans(), fault=st.booleans(), seed=st.integers(0, 10**6))
def test_every_configuration_verifies_what_it_checks_and_catches_a_flipped_byte(
        dp, window, micro_batches, cross_slot, min_gain, backoff, shadow, verify, held, early_copy, fault, seed):
    """Over window sizes, stream lengths, cross-slot plans, the gate (slots kept as given) and its
    backoff (windows skipped), shadow mode, check schedules, sources summed early and micro-batches
    copied to the device as they are counted (early_copy, the device here the CPU): a correct
    stream raises nothing and every rank counts as verified exactly the checked windows that moved
    bytes (every verify-th window from the first, skipped ones counted; a natural or shadow one
    checks nothing), with W x B samples each; with the check on every window, a byte flipped by one
    rank's executor is reported by every rank, the same text."""
    from unittest import mock

    from reorder.exchange import round as round_module
    from reorder.exchange.placement import Placement, place
    if fault:
        verify = 1
    groups, b = max(dp, 2), 2 * max(dp, 2)
    rng = np.random.default_rng(seed)
    gs = [syn.make_global_batch(rng, b, 256, features=8, mix="large", first_id=b * k, scale=0.05)
          for k in range(micro_batches)]
    windows = [gs[k:k + window] for k in range(0, micro_batches, window)]

    def held_place(target, sources, **kw):
        p = place(target, sources, **kw)
        return Placement(target=p.target, executor=p.executor, direct=p.direct,
                         held=tuple(held == "every other" and i % 2 == 1 for i in range(len(sources))))

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=groups, dp=dp, rank=r), micro_batch_size=b, cost=COST, balancer="lpt",
                             window_size=window, collectives=coll if dp > 1 else None, verify=verify,
                             cross_slot=cross_slot, min_gain=min_gain, shadow=shadow,
                             gate_backoff=backoff if min_gain else 0, early_copy=early_copy,
                             device="cpu" if early_copy else None)
        faulty = ex.round._executors[torch.device("cpu")] = Faulty("flip") if fault and r == dp - 1 else TorchExecutor()
        reports = []
        try:
            for k, batches in enumerate(windows):
                reports.append(ex.exchange([syn.rank_share(g, dp, r) for g in batches])[1])
            ex.exchange([])
        except ReorderError as e:
            return e, getattr(faulty, "done", False)
        return (reports, ex.verified_windows, ex.verified_samples), getattr(faulty, "done", False)

    with mock.patch.object(round_module, "place", held_place):
        got = run_emulated(dp, fn, timeout=30) if dp > 1 else [fn(0, None)]
    corrupted = any(done for _, done in got)
    if corrupted:
        assert all(isinstance(e, ReorderError) and str(e).startswith("self-check failed: window ") for e, _ in got), got
        assert len({str(e) for e, _ in got}) == 1
        return
    assert not any(isinstance(x, BaseException) for x, _ in got), got
    reports = got[0][0][0]
    checked = [k for k, rep in enumerate(reports) if k % verify == 0 and not (rep.shadow or _natural(rep, b))]
    want = (len(checked), sum(reports[k].orders.size for k in checked))
    assert all((v, s) == want for (_, v, s), _ in got), (got, want)


def _natural(report, b: int) -> bool:
    """The window moved no byte and permuted nothing: every slot's order the natural one (with a
    cross-slot plan, flat ids slot * B + j in place)."""
    w = len(report.orders)
    return np.array_equal(report.orders, np.arange(w * b).reshape(w, b)) or \
        np.array_equal(report.orders, np.tile(np.arange(b), (w, 1)))


def test_the_error_names_the_field_or_the_fields_that_share_the_last_word():
    """Fields from the 16th on share the last checksum word: a mismatch there names all of them
    ("one of a, b, ..."; a nested field by its '/'-joined path, the pickled per-sample lists as
    "per-sample lists"), one in the word before names its one field."""
    from reorder.exchange.round import _field_names
    b = 8
    rng = np.random.default_rng(3)
    batches = [syn.make_global_batch(rng, b, 256, features=8, mix="large", first_id=b * k, scale=0.05) for k in (0, 1)]
    for g in batches:
        g["extra"] = {f"f{i:02d}": torch.arange(b * 3, dtype=torch.int32).reshape(b, 3) + i for i in range(CHECKED_FIELDS)}
        g["sample_tags"] = [f"t{i}" for i in range(b)]
    ex = WindowExchanger(grid=Grid(size=4, dp=1, rank=0), micro_batch_size=b, cost=COST, verify=1)
    _, report = ex.exchange([batches[0]])
    assert (report.orders != np.arange(b)).any()  # the window moved: it is checked
    rnd = ex.round
    frame = rnd.read([batches[1]])
    check = rnd._now.last
    names = _field_names(check.layout)
    assert len(names) > CHECKED_FIELDS
    _, got_at, _ = rnd._sums_at
    for slot, field in ((CHECKED_FIELDS - 2, repr(names[CHECKED_FIELDS - 2])),
                        (CHECKED_FIELDS - 1, repr("one of " + ", ".join(names[CHECKED_FIELDS - 1:])))):
        frames = frame[None].copy()
        frames.ravel()[got_at[0, 3, slot]] += 1  # what position 3 holds, as assembled, differs in that word
        error = rnd._compared(check, frames)
        assert f"differs in field {field} from" in error and "at position 3" in error, error
    assert "'one of " in error and "extra/f15, " in error and error.count(", ") >= 2, error
    assert "per-sample lists'" in error and names[-1] == "per-sample lists", error
    assert rnd._compared(check, frame[None].copy()) is None
