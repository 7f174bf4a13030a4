"""The window round without I/O (`reorder.exchange.round.WindowRound`): frames and byte buffers are
carried between ranks by hand here, no thread, no process group. What the driver would do with
collectives, `route` does with slices."""

import numpy as np
import pytest
import torch

from reorder import CostModel, Grid, ReorderError
from reorder.cli import synthetic as syn
from reorder.exchange.round import WindowRound
from support import checks

COST = CostModel()


def rounds(dp, groups=None, **kw):
    return [WindowRound(grid=Grid(size=groups or dp, dp=dp, rank=r), micro_batch_size=8, cost=COST, **kw)
            for r in range(dp)]


def route(outgoing):
    """Every rank's receive buffer from every rank's Outgoing: rank r gets, from each q in rank
    order, the bytes q's send splits give r (an all_to_all_single done with slices)."""
    dp = len(outgoing)
    starts = [np.concatenate([[0], np.cumsum(o.send_splits)]) for o in outgoing]
    return [torch.cat([outgoing[q].buffer[starts[q][r]:starts[q][r + 1]] for q in range(dp)]) for r in range(dp)]


def window_by_hand(rs, shares, errors=None):
    """One window on every round: read, gather, pack, route, finish; returns each rank's result."""
    frames = np.stack([r.read(s, (errors or {}).get(i)) for i, (r, s) in enumerate(zip(rs, shares))])
    texts = [r.gathered(frames) for r in rs]
    if texts[0] is not None:
        gathered = np.stack(texts)
        for r in rs:
            r.gathered_texts(gathered)
    outgoing = [r.pack() for r in rs]
    received = route(outgoing) if outgoing[0] is not None else [None] * len(rs)
    return [r.finish(got) for r, got in zip(rs, received)]


@pytest.mark.parametrize("dp, slots", [(2, 1), (2, 3), (4, 2)])
def test_a_window_carried_by_hand_keeps_every_invariant(dp, slots):
    rng = np.random.default_rng(dp * 10 + slots)
    batches = [syn.make_global_batch(rng, 8, 160, features=4, mix="small", first_id=8 * s) for s in range(slots)]
    rs = rounds(dp, balancer="lpt", window_size=slots)
    configs = np.stack([r.config_frame() for r in rs])
    for r in rs:
        r.agree(configs)
    out = window_by_hand(rs, [[syn.rank_share(g, dp, q) for g in batches] for q in range(dp)])
    orders = out[0][1].orders
    assert all((rep.orders == orders).all() for _, rep in out)
    assert sum(rep.sent_bytes for _, rep in out) > 0
    checks.check_module(batches, [o for o, _ in out], orders, dp, groups=dp, vision_start_token_id=syn.VISION_START,
                        fields=tuple(batches[0]))


def test_the_end_of_the_stream_is_an_empty_window_on_every_rank():
    rs = rounds(2)
    frames = np.stack([r.read([]) for r in rs])
    assert all(r.gathered(frames) is None for r in rs) and [r.pack() for r in rs] == [None, None]
    assert [r.finish(None) for r in rs] == [([], None), ([], None)]


def test_one_ranks_bad_input_is_every_ranks_error():
    g = syn.make_global_batch(np.random.default_rng(1), 8, 64, mix="small")
    shares = [[syn.rank_share(g, 2, q)] for q in range(2)]
    shares[1][0] = dict(shares[1][0], attention_mask=shares[1][0]["attention_mask"][:, :-1])
    rs = rounds(2)
    frames = np.stack([r.read(s) for r, s in zip(rs, shares)])
    errors = []
    for r in rs:
        with pytest.raises(ReorderError) as e:
            r.gathered(frames)
        errors.append(str(e.value))
    assert len(set(errors)) == 1 and errors[0].startswith("reorder failed on rank 1: attention_mask has shape")


def test_a_long_error_asks_for_a_text_frame_and_arrives_whole():
    g = syn.make_global_batch(np.random.default_rng(2), 8, 64, mix="small")
    why = "x" * 3000 + " the end"
    rs = rounds(2)
    frames = np.stack([r.read([syn.rank_share(g, 2, q)], OSError(why) if q == 0 else None)
                       for q, r in enumerate(rs)])
    texts = np.stack([r.gathered(frames) for r in rs])
    assert texts.shape == (2, -(-len(f"data source raised OSError: {why}") // 8))
    for r in rs:
        with pytest.raises(ReorderError, match=f"^reorder failed on rank 0: data source raised OSError: {why}$"):
            r.gathered_texts(texts)


def test_configs_that_differ_are_refused_by_every_rank():
    rs = [WindowRound(grid=Grid(size=2, dp=2, rank=q), micro_batch_size=8, cost=COST, window_size=1 + q)
          for q in range(2)]
    frames = np.stack([r.config_frame() for r in rs])
    for r in rs:
        with pytest.raises(ReorderError, match=r"window_size is 1 on ranks \[0\], 2 on ranks \[1\]"):
            r.agree(frames)
        assert not r.agreed


def test_a_receive_buffer_of_the_wrong_length_is_refused():
    g = syn.make_global_batch(np.random.default_rng(4), 8, 160, features=4, mix="large", scale=0.05)
    rs = rounds(2, balancer="lpt")
    frames = np.stack([r.read([syn.rank_share(g, 2, q)]) for q, r in enumerate(rs)])
    for r in rs:
        r.gathered(frames)
    outgoing = [r.pack() for r in rs]
    assert outgoing[0] is not None
    got = route(outgoing)[0]
    with pytest.raises(ReorderError, match=f"rank 0 received {len(got) + 1} bytes, expected {len(got)}"):
        rs[0].finish(torch.cat([got, got[:1]]))


def test_the_gate_backoff_skips_windows_without_a_frame():
    g = syn.make_global_batch(np.random.default_rng(5), 8, 64, mix="small")
    rs = rounds(2, min_saving=1e18, gate_backoff=1)
    shares = [[syn.rank_share(g, 2, q)] for q in range(2)]
    first = window_by_hand(rs, shares)
    assert all(rep.gated_slots == 1 and not rep.skipped for _, rep in first) and all(r.skips_next for r in rs)
    assert [r.read(s) for r, s in zip(rs, shares)] == [None, None]  # skipped: nothing to gather
    assert [r.pack() for r in rs] == [None, None]
    for (out, rep), s in zip([r.finish(None) for r in rs], shares):
        assert rep.skipped and out[0] is s[0]
