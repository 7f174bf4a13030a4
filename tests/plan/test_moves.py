"""The move list against a byte-level oracle: every rank packs its own samples, the pieces travel
as an all_to_all would carry them, every rank assembles, and each output field buffer holds exactly
the samples the spec's reassembly gives that rank, byte for byte; the wire order per peer is the
spec's route order."""

import expecttest
import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from reorder.exchange.executors import TorchExecutor
from reorder.plan.counts import SampleCounts
from reorder.plan.moves import ByteField, build_moves, piece_layout, take_moves
from reorder.plan.window import WindowPlan, inverse
from spec import reference as ref


def plan_of(orders, dp, cross=False):
    """A WindowPlan moving samples as `orders` says (cross: one flat order over the window)."""
    w, batch = orders.shape
    if cross:
        pos = inverse(orders.reshape(1, -1))[0]
        dest_slot, dest_pos = pos // batch, pos % batch
    else:
        dest_slot, dest_pos = np.repeat(np.arange(w), batch), inverse(orders).reshape(-1)
    z = np.zeros((w, dp))
    return WindowPlan(dp=dp, orders=orders, dest_slot=dest_slot, dest_pos=dest_pos, gated=np.zeros(w, bool),
                      costs=np.zeros(orders.shape), loads_before=z, loads_after=z, moved=np.ones(orders.shape, bool),
                      moved_bytes=0, cross_slot=cross)


@st.composite
def windows(draw):
    dp = draw(st.integers(1, 4))
    b = draw(st.integers(1, 3))
    w = draw(st.integers(1, 3))
    batch = dp * b
    fields = [ByteField("dense", draw(st.integers(1, 3)), draw(st.integers(1, 9))) for _ in range(draw(st.integers(1, 2)))]
    fields += [ByteField(k, 1, draw(st.integers(1, 7))) for k in ("row", "image") if draw(st.booleans())]
    if draw(st.booleans()):
        fields.append(ByteField("list", 1, 1))
    ints = st.lists(st.integers(0, 4), min_size=w * batch, max_size=w * batch)
    counts = SampleCounts.of(rows=np.array(draw(ints)).reshape(w, batch), images=np.array(draw(ints)).reshape(w, batch),
                             list_bytes=np.array(draw(ints)).reshape(w, batch))
    cross = w > 1 and draw(st.booleans())
    if cross:
        orders = np.array(draw(st.permutations(range(w * batch)))).reshape(w, batch)
    else:
        orders = np.array([draw(st.permutations(range(batch))) for _ in range(w)])
    return dp, tuple(fields), counts, plan_of(orders, dp, cross), draw(st.integers(0, 2**31))


def sample_bytes(rng, fields, counts):
    """Per flat sample id, per field: a list of byte strings (one per leading index for dense)."""
    flat = counts.flat()
    out = []
    for g in range(len(flat.table)):
        per = []
        for f in fields:
            if f.kind == "dense":
                per.append([rng.bytes(f.unit) for _ in range(f.pre)])
            else:
                per.append([rng.bytes(int(flat.entries(f.kind)[g]) * f.unit)])
        out.append(per)
    return out


def own_buffers(samples, fields, w, batch, dp, rank):
    b = batch // dp
    bufs = []
    for s in range(w):
        ids = [s * batch + rank * b + i for i in range(b)]
        for fi, f in enumerate(fields):
            pre = f.pre if f.kind == "dense" else 1
            data = b"".join(samples[g][fi][p] for p in range(pre) for g in ids)
            bufs.append(torch.frombuffer(bytearray(data + b"\0"), dtype=torch.uint8)[:len(data)].clone())
    return bufs


@given(windows())
def test_every_rank_assembles_its_canonical_samples_byte_for_byte(case):
    dp, fields, counts, plan, seed = case
    w, batch = plan.orders.shape
    b = batch // dp
    samples = sample_bytes(np.random.default_rng(seed), fields, counts)
    ex = TorchExecutor()
    moves = [build_moves(fields, counts, plan, r) for r in range(dp)]
    sends = []
    for r in range(dp):
        send = torch.zeros(sum(moves[r].send_splits), dtype=torch.uint8)
        ex.run(moves[r].pack, own_buffers(samples, fields, w, batch, dp, r), [send])
        sends.append(list(torch.split(send, moves[r].send_splits)))
    flat_order = plan.orders.reshape(-1) if plan.cross_slot else None
    for r in range(dp):
        assert [sends[q][r].numel() for q in range(dp)] == moves[r].recv_splits
        recv = torch.cat([sends[q][r] for q in range(dp)])
        todo = np.flatnonzero(~moves[r].kept)
        outs = [torch.full((_field_bytes(f, moves[r].out_counts, s),), 7, dtype=torch.uint8)
                for s in todo for f in fields]
        ex.run(moves[r].assemble, [recv] + own_buffers(samples, fields, w, batch, dp, r), outs)
        for s in range(w):
            canon = (flat_order[s * batch + r * b: s * batch + (r + 1) * b] if plan.cross_slot
                     else ref.reassemble([list(o) for o in plan.orders], [[s * batch + j for j in range(batch)]
                                                                          for s in range(w)], batch, dp, r)[s])
            own = [s * batch + r * b + i for i in range(b)]
            assert moves[r].kept[s] == ([int(g) for g in canon] == own)
            assert moves[r].out_counts.table[s].tolist() == counts.flat().table[[int(g) for g in canon]].tolist()
            if moves[r].kept[s]:  # returned as it is: no output buffers, nothing written
                continue
            k = int(np.searchsorted(todo, s))
            for fi, f in enumerate(fields):  # every byte of every output buffer written, as the oracle says
                want = b"".join(samples[g][fi][p] for p in range(f.pre if f.kind == "dense" else 1)
                                for g in [int(g) for g in canon])
                assert bytes(outs[k * len(fields) + fi].numpy()) == want


def _field_bytes(f, out_counts, s):
    """Bytes of field f's output buffer of slot s."""
    n = out_counts.shape[1] * f.pre if f.kind == "dense" else int(out_counts.entries(f.kind)[s].sum())
    return n * f.unit


@given(windows())
def test_wire_order_is_the_spec_route_order(case):
    dp, fields, counts, plan, _ = case
    if plan.cross_slot:
        return
    w, batch = plan.orders.shape
    for r in range(dp):
        moves = build_moves(fields, counts, plan, r)
        sends, recvs = ref.window_routes([list(o) for o in plan.orders], batch, dp, r)
        for q in range(dp):
            want_send = [] if q == r else [s * batch + i for s, i in sends[q]]
            want_recv = [] if q == r else [s * batch + i for s, i in recvs[q]]
            assert moves.send_items[q].tolist() == want_send
            assert moves.recv_items[q].tolist() == want_recv


@given(windows())
def test_send_and_receive_lists_name_every_peer_and_nothing_crosses_at_dp_1(case):
    dp, fields, counts, plan, _ = case
    for r in range(dp):
        moves = build_moves(fields, counts, plan, r)
        assert len(moves.send_items) == len(moves.recv_items) == len(moves.send_splits) == dp
        if dp == 1:  # a local permutation: no piece, no pack segment, nothing sent
            assert len(moves.pack) == 0 and moves.send_splits == moves.recv_splits == [0]


def test_piece_layout_golden():
    """Regions start at multiples of ALIGN (16): a dense field of pre x unit bytes per sample, then
    the row, image and list regions sized by the pieces' totals."""
    fields = (ByteField("dense", 3, 5), ByteField("dense", 1, 16), ByteField("row", 1, 7), ByteField("image", 1, 24),
              ByteField("list", 1, 1))
    regions, sizes = piece_layout(fields, np.array([1, 2, 0]), np.array([[3, 0, 1], [1, 2, 0], [17, 0, 16]]))
    expecttest.assert_expected_inline(str(regions.tolist()), """[[0, 16, 32, 64, 96], [0, 32, 64, 64, 112], [0, 0, 0, 16, 16]]""")
    expecttest.assert_expected_inline(str(sizes.tolist()), """[128, 112, 32]""")


@given(windows())
def test_a_layout_without_byte_fields_moves_no_byte(case):
    """No field (a degenerate layout: nothing per sample to carry): every piece is empty and every
    segment table too, at any world and plan; the pieces' regions and sizes are int64 like any layout's."""
    dp, _, counts, plan, _ = case
    regions, sizes = piece_layout((), np.array([1, 2, 0]), np.array([[3, 0, 1], [1, 2, 0], [17, 0, 16]]))
    assert regions.shape == (3, 0) and regions.dtype == np.int64
    assert sizes.tolist() == [0, 0, 0] and sizes.dtype == np.int64
    for r in range(dp):
        moves = build_moves((), counts, plan, r)
        assert len(moves.pack) == len(moves.assemble) == 0
        assert moves.send_splits == moves.recv_splits == [0] * dp


@given(st.data())
def test_take_moves_copies_any_selection_byte_for_byte(data):
    fields = (ByteField("dense", 2, 3), ByteField("row", 1, 5), ByteField("image", 1, 2), ByteField("list", 1, 1))
    sizes = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    total = sum(sizes)
    ints = st.lists(st.integers(0, 3), min_size=total, max_size=total)
    counts = SampleCounts.of(rows=np.array(data.draw(ints)), images=np.array(data.draw(ints)),
                             list_bytes=np.array(data.draw(ints)))
    index = data.draw(st.lists(st.integers(0, total - 1), max_size=5))  # repeats and subsets
    samples = sample_bytes(np.random.default_rng(len(index)), fields, counts)
    buffers, first = [], 0
    for n in sizes:  # one buffer per (source, field), a field's samples as the batch holds them
        ids = range(first, first + n)
        for fi, f in enumerate(fields):
            data_ = b"".join(samples[g][fi][p] for p in range(f.pre if f.kind == "dense" else 1) for g in ids)
            buffers.append(torch.frombuffer(bytearray(data_ + b"\0"), dtype=torch.uint8)[:len(data_)].clone())
        first += n
    take = take_moves(fields, counts, sizes, index)
    block = torch.zeros(take.block_bytes, dtype=torch.uint8)
    TorchExecutor().run(take.segments, buffers, [block])
    assert take.out_counts.table.tolist() == counts.table[index].tolist()
    got = bytes(block.numpy())
    ends = list(take.regions[1:]) + [take.block_bytes]
    for fi, f in enumerate(fields):
        want = b"".join(samples[g][fi][p] for p in range(f.pre if f.kind == "dense" else 1) for g in index)
        assert got[take.regions[fi]:take.regions[fi] + len(want)] == want
        assert take.regions[fi] % 16 == 0 and take.regions[fi] + len(want) <= ends[fi]
