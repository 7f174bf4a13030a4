"""Full window exchanges on emulated ranks: I1-I8 for heterogeneous layouts, window sizes, a short
last window; every rank raises the same error for rank-local bad input or config mismatch."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import faults
from reorder import CostModel, Grid, ReorderError, WindowExchanger, run_emulated

from support import harness
from reorder.cli import synthetic as syn
from spec.samples import per_sample_bytes
from reorder.batch.counting import token_counts

LAYOUTS = [(1, 2), (2, 4), (2, 3), (1, 4), (4, 8), (3, 6)]
COST = CostModel()


def windows_for(seed, batch, slots, seq=192):
    rng = np.random.default_rng(seed)
    return [syn.make_global_batch(rng, batch, seq, features=4, mix="small", first_id=s * batch) for s in range(slots)]


@pytest.mark.parametrize("dps", LAYOUTS, ids=str)
@pytest.mark.parametrize("slots", [1, 3])
def test_invariants_hold_for_layouts(dps, slots):
    from math import lcm
    g = lcm(*dps)
    batches = windows_for(sum(dps) * 10 + slots, 2 * g, slots)
    res = harness.run_window(batches, {"vision": dps[0], "language": dps[1]}, cost=COST, window_size=4)
    harness.check_window(batches, res, cost=COST, balancer="lpt", vision_start_token_id=syn.VISION_START)
    assert res["language"].reports[0].moved_samples > 0 or dps[1] == 1


@given(st.sampled_from(LAYOUTS), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2**31),
       st.floats(0, 2))
def test_invariants_property(dps, slots, per_group, seed, lw):
    from math import lcm
    g = lcm(*dps)
    batches = windows_for(seed, per_group * g, slots, seq=128)
    cost = CostModel(encoder_weight=1.0, language_weight=lw)
    res = harness.run_window(batches, {"vision": dps[0], "language": dps[1]}, cost=cost, window_size=4)
    harness.check_window(batches, res, cost=cost, balancer="lpt", vision_start_token_id=syn.VISION_START)


def test_short_last_window_and_reports():
    batches = windows_for(3, 8, 4)
    full = harness.run_window(batches, {"vision": 2, "language": 4}, cost=COST, window_size=4)
    short = harness.run_window(batches[:1], {"vision": 2, "language": 4}, cost=COST, window_size=4)
    harness.check_window(batches[:1], short, cost=COST, balancer="lpt", vision_start_token_id=syn.VISION_START)
    assert short["language"].reports[0].slots == 1 and full["language"].reports[0].slots == 4
    rep = full["language"].reports[0]
    assert rep.max_after <= rep.max_before and rep.total_samples == 32
    assert np.allclose(rep.loads_before.sum(axis=1), rep.loads_after.sum(axis=1))


def _run(dp, batches_for_rank, exchanger_kwargs_for_rank=lambda r: {}, error_for_rank=lambda r: None):
    def fn(r, coll):
        kw = dict(grid=Grid(size=dp, dp=dp, rank=r), micro_batch_size=2 * dp, cost=COST, window_size=2,
                  collectives=coll)
        kw.update(exchanger_kwargs_for_rank(r))
        return WindowExchanger(**kw).exchange(batches_for_rank(r), error_for_rank(r))
    return run_emulated(dp, fn, timeout=20, return_exceptions=True)


@pytest.mark.parametrize("case", faults.cases("emulated"), ids=faults.name)
def test_fault_case(case):
    """One rank's bad input, config or data source (tests/faults.py): every rank of the DP group sees
    what the record says; an error is the same on every rank, and where none is expected the window
    is exchanged with nothing lost."""
    p = case.params
    dp = p.get("dp", 2)
    shares = p["shares"]() if "shares" in p else faults.rank_shares(dp)
    config, source_errors = p.get("config", {}), p.get("source_error", {})
    out = _run(dp, lambda r: [] if r in source_errors else [shares[r]], lambda r: config.get(r, {}),
               source_errors.get)
    (seen,) = case.sees
    for got in out:
        seen.check(got if isinstance(got, BaseException) else None)
    if seen.error is not None:
        assert len({str(e) for e in out}) == 1, out  # the same error on every rank
    else:
        held = sorted(i for batches, _ in out for i in batches[0]["sample_id"].tolist())
        assert held == sorted(i for sh in shares for i in sh["sample_id"].tolist())


def test_dp1_local_permutation():
    batches = windows_for(9, 8, 2)
    res = harness.run_window(batches, {"vision": 1, "language": 4}, cost=COST)
    harness.check_window(batches, res, cost=COST, balancer="lpt", vision_start_token_id=syn.VISION_START)
    assert res["vision"].reports[0].sent_bytes == 0


@pytest.mark.parametrize("early", [False, True])
def test_only_kept_slots_are_moved_to_the_device_as_given(monkeypatch, early):
    """A slot the plan rewrites is written straight into its new tensors: its input fields are not
    also moved to `device` (from pinned host memory that would be a second full copy of the
    micro-batch). With early_copy a kept slot reuses the copies made at counting time."""
    from reorder.exchange import round as driver

    moved = []
    real = driver._fields_to
    monkeypatch.setattr(driver, "_fields_to", lambda b, paths, dev: moved.append(b["sample_id"][0].item())
                        or real(b, paths, dev))
    rng = np.random.default_rng(3)
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, cost=COST, window_size=8,
                         device="cpu", early_copy=early)
    window = [syn.make_global_batch(rng, 4, 128, features=4, mix="large", first_id=4 * s, scale=0.05)
              for s in range(8)]
    out, report = ex.exchange(window)
    kept = [4 * s for s in range(8) if (report.orders[s] == np.arange(4)).all()]
    assert 0 < len(kept) < 8, "the window must mix kept and permuted slots"
    assert moved == ([] if early else kept)
    for s, batch in enumerate(out):
        assert batch["sample_id"].tolist() == [4 * s + int(i) for i in report.orders[s]]


def test_early_copy_starts_before_counting_once_the_layout_is_known(monkeypatch):
    """With early_copy, the per-sample fields of a window after the first are sent to `device`
    before the micro-batch is counted (the layout of the window before names them), each once."""
    events = []
    from reorder.exchange.round import WindowRound

    to, count = torch.Tensor.to, WindowRound._count
    monkeypatch.setattr(torch.Tensor, "to", lambda t, *a, **k: (k.get("non_blocking") and events.append(("to", id(t))))
                        or to(t, *a, **k))  # the copies to `device` (counting reads grid_thw blocking)
    monkeypatch.setattr(WindowRound, "_count", lambda self, *a: events.append(("count", None)) or count(self, *a))
    rng = np.random.default_rng(5)
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, cost=COST, device="cpu",
                         early_copy=True)
    fields = ["input_ids", "labels", "loss_mask", "attention_mask", "position_ids", "sample_id"]
    for window in range(2):
        batch = syn.make_global_batch(rng, 4, 128, features=4, mix="large", first_id=4 * window, scale=0.05)
        vit = batch["modality_inputs"]["images"]["vit"]
        ids = {id(batch[f]) for f in fields} | {id(vit["hidden_states"]), id(vit["grid_thw"])}
        events.clear()
        ex.exchange([batch])
        at = events.index(("count", None))
        copied = [i for kind, i in events if kind == "to" and i in ids]
        assert sorted(copied) == sorted(ids)  # every field once
        before = {i for kind, i in events[:at] if kind == "to"} & ids
        assert before == (set() if window == 0 else ids)


def test_cost_benefit_gate_is_identical_everywhere_and_skips_useless_moves():
    batches = windows_for(11, 8, 3)
    from reorder.plan import orders as plan

    # slot 0 gains (max group load 10 -> 6); slot 1 is uniform: nothing to gain, keep natural order
    costs = np.array([[5.0, 5, 1, 1, 2, 2, 3, 3], [1.0] * 8])
    gated_orders, gated = plan.plan_gated_orders(costs, 4, "lpt", 0.0)
    assert gated.tolist() == [False, True] and gated_orders[1].tolist() == list(range(8))
    _, gated_all = plan.plan_gated_orders(costs, 4, "lpt", 0.99)
    assert gated_all.all()

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=4, dp=4, rank=r), micro_batch_size=8, cost=COST, window_size=3,
                             collectives=coll, min_gain=0.99)
        return ex.exchange([syn.rank_share(g, 4, r) for g in batches])
    res = run_emulated(4, fn)
    for out, rep in res:
        assert rep.gated_slots == 3 and rep.moved_samples == 0 and rep.sent_bytes == 0
    assert [o[0]["sample_id"].tolist() for o, _ in res] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("device, early", [(None, False), ("cpu", False), ("cpu", True)])
def test_a_window_kept_natural_builds_no_move_list(monkeypatch, device, early):
    """A fully gated window keeps every slot as read on every rank: it returns them (moved to
    `device` as reorder off would) without building a move list or gathering its buffers."""
    from reorder.exchange import round as driver

    def refuse(*a, **k):
        raise AssertionError("a natural window must not build a move list")
    monkeypatch.setattr(driver, "build_moves", refuse)
    monkeypatch.setattr(driver.WindowRound, "_sources", refuse)
    batches = windows_for(12, 8, 2)

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=4, dp=2, rank=r), micro_batch_size=8, cost=COST, window_size=2,
                             collectives=coll, min_saving=1e18, device=device, early_copy=early)
        mine = [syn.rank_share(g, 2, r) for g in batches]
        return mine, ex.exchange(mine)
    for mine, (out, rep) in run_emulated(2, fn):
        assert rep.gated_slots == 2 and rep.moved_samples == 0 and rep.sent_bytes == 0
        assert set(rep.stage_ms) == {"prepare", "gather", "plan", "pack", "all_to_all", "assemble"}
        for given, got in zip(mine, out):
            assert got is given or device is not None
            assert got["sample_id"].tolist() == given["sample_id"].tolist()
            assert torch.equal(got["input_ids"], given["input_ids"])


def test_min_saving_gate_keeps_slots_that_save_too_little():
    from reorder.plan import orders as plan

    # slot 0 saves 4 in max group load (10 -> 6), slot 1 saves 2 (4 -> 2), slot 2 nothing
    costs = np.array([[5.0, 5, 1, 1, 2, 2, 3, 3], [2.0, 2, 1, 1, 1, 1, 0, 0], [1.0] * 8])
    orders = plan.plan_orders(costs, 4)
    saving = plan.rank_loads(costs, None, 4).max(1) - plan.rank_loads(costs, orders, 4).max(1)
    assert saving.tolist() == [4.0, 2.0, 0.0]
    for threshold, want in ((0.0, [False, False, True]), (1.9, [False, False, True]), (2.0, [False, True, True]),
                            (4.0, [True, True, True])):
        got_orders, gated = plan.plan_gated_orders(costs, 4, "lpt", min_saving=threshold)
        assert gated.tolist() == want, threshold
        assert (got_orders[gated] == np.arange(8)).all() and (got_orders[~gated] == orders[~gated]).all()
    # either threshold gates: the relative one alone keeps slot 1 (gain 0.5), both together drop it
    assert plan.plan_gated_orders(costs, 4, "lpt", min_gain=0.2)[1].tolist() == [False, False, True]
    assert plan.plan_gated_orders(costs, 4, "lpt", min_gain=0.2, min_saving=2.0)[1].tolist() == [False, True, True]


def test_gate_thresholds_are_checked_locally():  # mismatches across ranks: tests/faults.py
    with pytest.raises(ValueError, match=r"min_saving=-1.0 is invalid"):
        WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=2, cost=COST, min_saving=-1.0)


def test_language_cost_weight_is_used_everywhere():
    batches = windows_for(4, 8, 2)
    cost = CostModel(encoder_weight=0.0, language_weight=1.0)  # pure text cost: real tokens only
    res = harness.run_window(batches, {"vision": 2, "language": 4}, cost=cost, window_size=2)
    harness.check_window(batches, res, cost=cost, balancer="lpt", vision_start_token_id=syn.VISION_START)
    real = np.stack([b["attention_mask"].sum(1).numpy() for b in batches]).astype(float)
    from spec import reference as ref
    for s in range(2):
        assert res["vision"].reports[0].orders[s].tolist() == ref.lpt_order(real[s].tolist(), 4)


def test_shadow_mode_plans_and_reports_but_moves_nothing():
    batches = windows_for(21, 8, 2)

    def fn(r, coll, shadow=True):
        kw = dict(grid=Grid(size=4, dp=4, rank=r), micro_batch_size=8, cost=COST, window_size=2, collectives=coll)
        real = WindowExchanger(**kw).exchange([syn.rank_share(g, 4, r) for g in batches])[1]
        mine = [syn.rank_share(g, 4, r) for g in batches]
        out, rep = WindowExchanger(shadow=True, **kw).exchange(mine)
        return real, mine, out, rep
    for real, mine, out, rep in run_emulated(4, fn):
        assert out is mine or all(o is m for o, m in zip(out, mine))  # returned untouched
        assert rep.shadow and rep.sent_bytes == 0
        assert rep.orders.tolist() == real.orders.tolist()  # the same plan the real exchange used
        assert (rep.moved_samples, rep.moved_bytes) == (real.moved_samples, real.moved_bytes) > (0, 0)
        assert np.array_equal(rep.loads_after, real.loads_after)
    # shadow on some ranks only would misalign modules: every rank raises instead (tests/faults.py)


def test_quadratic_vision_cost_drives_the_plan_on_every_rank():
    from spec import reference as ref
    batches = windows_for(13, 8, 2)
    cost = CostModel(encoder_weight=1.0, encoder_quadratic_weight=1e-3)

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=4, dp=4, rank=r), micro_batch_size=8, cost=cost, balancer="lpt",
                             window_size=2, collectives=coll)
        return ex.exchange([syn.rank_share(g, 4, r) for g in batches])
    res = run_emulated(4, fn)
    for s, g in enumerate(batches):
        costs = [ref.sample_cost(g["input_ids"][i].tolist(), None, image_token_id=syn.IMAGE_TOKEN, spatial_merge_size=2,
                                 encoder_weight=1.0, language_weight=0.0, encoder_quadratic_weight=1e-3)
                 for i in range(8)]
        want = ref.lpt_order(costs, 4)
        assert all(rep.orders[s].tolist() == want for _, rep in res)
        held = [i for out, _ in res for i in out[s]["sample_id"].tolist()]
        assert held == [g["sample_id"].tolist()[i] for i in want]


def test_per_image_cost_drives_the_plan_on_both_modules():
    """encoder_image_weight (fixed work per image, e.g. a per-image attention loop): both modules
    plan from it identically, equal to the spec's LPT on its per-sample costs."""
    from spec import reference as ref
    batches = windows_for(17, 8, 2)
    cost = CostModel(encoder_weight=1.0, encoder_image_weight=5000.0)
    res = harness.run_window(batches, {"vision": 2, "language": 4}, cost=cost, window_size=2)
    harness.check_window(batches, res, cost=cost, balancer="lpt", vision_start_token_id=syn.VISION_START)
    differs = False
    for s, g in enumerate(batches):
        def spec_order(image_weight, g=g):
            costs = [ref.sample_cost(g["input_ids"][i].tolist(), None, image_token_id=syn.IMAGE_TOKEN,
                                     spatial_merge_size=2, encoder_weight=1.0, language_weight=0.0,
                                     encoder_image_weight=image_weight, vision_start_token_id=syn.VISION_START)
                     for i in range(8)]
            return ref.lpt_order(costs, 4)
        assert res["vision"].reports[0].orders[s].tolist() == spec_order(5000.0)
        differs |= spec_order(5000.0) != spec_order(0.0)
    assert differs  # the term changes the plan on this data


@pytest.mark.parametrize("dps", [(1, 2), (2, 4), (2, 3), (1, 1)], ids=str)
@pytest.mark.parametrize("slots", [2, 3])
def test_cross_slot_mode_balances_the_window_and_keeps_every_invariant_but_i7(dps, slots):
    """Opt-in cross-slot mode: one equal-count plan over the W x G (slot, group) cells, equal to the
    spec's LPT over W*G groups on the flattened window; both modules agree (bridge alignment per
    slot), B/d samples per rank per slot, byte-exact, nothing lost over the window."""
    from math import lcm

    from spec import invariants as inv
    from spec import reference as ref
    from spec.samples import per_sample_bytes
    g = lcm(*dps)
    B = 2 * g
    batches = windows_for(sum(dps) + slots, B, slots)
    flat_costs = [c for b in batches for c in COST.costs(*[x.numpy() for x in token_counts(COST, b["input_ids"], None)[:2]])]
    want = ref.lpt_order([float(c) for c in flat_costs], g * slots)  # positions: slot-major, then group
    all_ids = [i for b in batches for i in b["sample_id"].tolist()]
    sent = {}
    for b in batches:
        sent.update(zip(b["sample_id"].tolist(), per_sample_bytes(b, vision_start_token_id=syn.VISION_START)))
    held = {}
    for name, d in zip(("vision", "language"), dps):
        def fn(r, coll, d=d):
            ex = WindowExchanger(grid=Grid(size=g, dp=d, rank=r), micro_batch_size=B, cost=COST, balancer="lpt",
                                 window_size=slots, collectives=coll if d > 1 else None, cross_slot=True)
            return ex.exchange([syn.rank_share(x, d, r) for x in batches])
        res = run_emulated(d, fn)
        held[name] = [[out[s]["sample_id"].tolist() for s in range(slots)] for out, _ in res]
        for r, (out, rep) in enumerate(res):
            assert rep.orders.reshape(-1).tolist() == want
            for s in range(slots):
                b = B // d
                assert held[name][r][s] == [all_ids[i] for i in want[s * B + r * b:s * B + (r + 1) * b]]  # I3, I4
                inv.i5_byte_exact(sent, dict(zip(out[s]["sample_id"].tolist(),
                                                 per_sample_bytes(out[s], vision_start_token_id=syn.VISION_START))))
        after = [i for s in range(slots) for r in range(d) for i in held[name][r][s]]
        inv.i6_nothing_lost([all_ids], [after])  # over the whole window
    if dps[1] % dps[0] == 0:
        for s in range(slots):
            inv.i4_bridge_alignment([h[s] for h in held["vision"]], [h[s] for h in held["language"]])


def test_reorder_inside_each_rank_only_moves_nothing_and_keeps_every_invariant():
    """Vision dp 2 on a grid of 4: the plan swaps samples between the two groups of vision rank 0
    only, so no sample changes vision rank (no transfer) but rank 0's order changes; the language
    ranks (dp 4) do exchange. Every invariant, and the bridge alignment, must hold."""
    g = windows_for(31, 8, 1)[0]
    real = [10, 10, 1, 1, 5, 5, 5, 5]  # natural groups (10+10), (1+1), (5+5), (5+5): optimum 11
    mask = torch.zeros_like(g["attention_mask"])
    for i, k in enumerate(real):
        mask[i, :k] = 1
    g["attention_mask"] = mask
    cost = CostModel(encoder_weight=0.0, language_weight=1.0)
    res = harness.run_window([g], {"vision": 2, "language": 4}, cost=cost, balancer="balanced")
    harness.check_window([g], res, cost=cost, balancer="balanced", vision_start_token_id=syn.VISION_START)
    vision = res["vision"]
    order = vision.reports[0].orders[0].tolist()
    assert vision.reports[0].moved_samples == 0 and all(rep.sent_bytes == 0 for rep in vision.reports)
    assert sorted(order[:4]) == [0, 1, 2, 3] and order[:4] != [0, 1, 2, 3]  # reordered inside rank 0
    assert vision.outputs[0][0]["sample_id"].tolist() == [int(g["sample_id"][i]) for i in order[:4]]
    assert res["language"].reports[0].moved_samples == 2


@pytest.mark.parametrize("dps", [(2, 4), (1, 2)], ids=str)
def test_early_copy_gives_the_same_window(dps):
    """early_copy=True (copy to `device` before planning, the synchronous path of `wrap`) and the
    default (copy straight into the output after planning) hand out byte-identical micro-batches."""
    batches = windows_for(41, 8, 3)
    runs = [harness.run_window(batches, {"vision": dps[0], "language": dps[1]}, cost=COST, window_size=4,
                               exchanger_kwargs=dict(device="cpu", early_copy=early)) for early in (False, True)]
    for res in runs:
        harness.check_window(batches, res, cost=COST, balancer="lpt", vision_start_token_id=syn.VISION_START)
    for module in runs[0]:
        for a, b in zip(runs[0][module].outputs, runs[1][module].outputs):
            for x, y in zip(a, b):
                assert per_sample_bytes(x, vision_start_token_id=syn.VISION_START) == \
                    per_sample_bytes(y, vision_start_token_id=syn.VISION_START)


def _stream(seed, windows, batch):
    """Windows of one micro-batch; odd seeds draw some windows of text-only samples (cost 0: the gate
    keeps them), the others images of random sizes."""
    rng = np.random.default_rng(seed)
    out = []
    for k in range(windows):
        mix = "small" if rng.random() < 0.5 else "large"
        out.append([syn.make_global_batch(rng, batch, 128, features=4, mix=mix, first_id=k * batch, scale=0.02)])
    return out


@given(st.integers(0, 2**31), st.integers(1, 4), st.floats(0, 8), st.integers(6, 14))
def test_gate_backoff_skips_the_same_windows_on_every_rank_and_module(seed, max_skip, threshold, windows):
    """Vision dp 1 and language dp 2 stream the same windows with the gate backoff: both skip exactly
    the windows spec.reference.gate_backoff_skips names (from what the gate would do to each window),
    skipped windows keep the natural order, and every module derives the same orders (I2)."""
    from reorder.plan import orders as plan
    from spec import invariants, reference

    batch, groups = 4, 2
    stream = _stream(seed, windows, batch)
    cost = CostModel(image_token_id=syn.IMAGE_TOKEN, vision_start_token_id=syn.VISION_START)
    would_gate = []
    for (g,) in stream:
        counts = token_counts(cost, g["input_ids"], None)
        costs = cost.costs(counts[0].numpy(), counts[1].numpy(), None, counts[2].numpy())[None]
        would_gate.append(bool(plan.plan_gated_orders(costs, groups, "balanced", None, threshold)[1].all()))
    want = reference.gate_backoff_skips(would_gate, max_skip)

    def module(dp):
        def fn(r, coll):
            ex = WindowExchanger(grid=Grid(size=groups, dp=dp, rank=r), micro_batch_size=batch, cost=cost,
                                 collectives=coll if dp > 1 else None, min_saving=threshold, gate_backoff=max_skip)
            got = []
            for (g,) in stream:
                out, rep = ex.exchange([syn.rank_share(g, dp, r)])
                got.append((rep.skipped, rep.orders[0].tolist(), out[0]["sample_id"].tolist()))
            return got
        return run_emulated(dp, fn, timeout=20)

    vision, language = module(1), module(2)
    for k in range(windows):
        skipped = {rank_res[k][0] for res in (vision, language) for rank_res in res}
        assert skipped == {want[k]}, (k, skipped, want)
        orders = {"vision": vision[0][k][1], "language": language[0][k][1]}
        invariants.i2_identical_assignment(orders, {"vision": 1, "language": 2}, batch)
        if want[k]:
            assert orders["vision"] == list(range(batch))
        held = language[0][k][2] + language[1][k][2]
        assert held == vision[0][k][2] == [stream[k][0]["sample_id"][p].item() for p in orders["vision"]]
    assert any(want) == (max_skip > 0 and any(would_gate[:-1]))


def test_gate_backoff_doubles_up_to_its_cap_and_resets_when_a_window_moves():
    from spec import reference
    assert reference.gate_backoff_skips([True] * 12, 4) == [
        False, True, False, True, True, False, True, True, True, True, False, True]
    assert reference.gate_backoff_skips([True, True, False, True, False, False], 8) == [
        False, True, False, False, True, False]
    assert reference.gate_backoff_skips([True] * 5, 0) == [False] * 5


def test_gate_backoff_needs_the_gate():  # a mismatch across ranks: tests/faults.py
    with pytest.raises(ValueError, match=r"gate_backoff=4 needs the cost-benefit gate: set min_gain or min_saving"):
        WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=2, cost=COST, gate_backoff=4)
    with pytest.raises(ValueError, match=r"gate_backoff=-1 is invalid"):
        WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=2, cost=COST, min_gain=0.1, gate_backoff=-1)


def test_a_skipped_window_raises_a_source_error_on_its_own_rank_and_ends_locally():
    """In a skipped window nothing is exchanged: a data-source error raises on the rank that has it
    (as with reorder off) and an empty window ends that rank's stream without a collective."""
    g = windows_for(5, 4, 1)[0]
    ex = WindowExchanger(grid=Grid(size=2, dp=1, rank=0), micro_batch_size=4, cost=COST, min_gain=0.999,
                         gate_backoff=4)
    _, rep = ex.exchange([g])
    assert not rep.skipped and rep.gated_slots == 1
    out, rep = ex.exchange([g])
    assert rep.skipped and out[0] is g and np.isnan(rep.max_before)
    _, rep = ex.exchange([g])  # the second gated window in a row: two skips follow
    assert not rep.skipped
    with pytest.raises(ReorderError, match="reorder failed on rank 0: data source raised OSError: disk"):
        ex.exchange([], OSError("disk"))
    assert ex.exchange([]) == ([], None)


def test_a_skipped_window_moves_only_the_per_sample_fields_and_keeps_the_input_intact():
    """`_fields_to` (skipped windows): the per-sample fields at the given paths go to the device, the
    rest (global metadata) stays where it is, and the caller's dicts are not modified."""
    from reorder.exchange.round import _fields_to

    g = windows_for(6, 4, 1)[0]
    g["global_scale"] = torch.ones(2)
    paths = [("input_ids",), ("modality_inputs", "images", "vit", "hidden_states")]
    out = _fields_to(g, paths, torch.device("meta"))
    assert out["input_ids"].is_meta and out["modality_inputs"]["images"]["vit"]["hidden_states"].is_meta
    assert not out["global_scale"].is_meta and not out["modality_inputs"]["images"]["vit"]["grid_thw"].is_meta
    assert not g["input_ids"].is_meta and not g["modality_inputs"]["images"]["vit"]["hidden_states"].is_meta
    assert _fields_to(g, paths, torch.device("cpu")) is g  # already there: the batch itself
