"""Grid, cost and plan against the spec, golden facts and error messages."""

from functools import partial

import numpy as np
import pytest
import torch
from expecttest import TestCase
from hypothesis import given
from hypothesis import strategies as st

import faults
from reorder import CostModel, Grid, ReorderError, WindowExchanger, canonical_grid, plan_orders, rank_loads, run_emulated
from reorder.batch import counting
from reorder.plan.balancers import lpt
from spec import reference as ref
from reorder.batch.counting import count_samples, square_patches, token_counts


class Golden(TestCase):
    def test_known_facts(self):
        self.assertExpectedInline(str(lpt(np.array([1.0, 5, 2, 4]), 2).tolist()), """[1, 0, 3, 2]""")
        order = plan_orders(np.array([[10.0, 10, 10, 1, 1, 1]]), 3)
        loads = rank_loads(np.array([[10.0, 10, 10, 1, 1, 1]]), order, 3)
        self.assertExpectedInline(str(loads.tolist()), """[[11.0, 11.0, 11.0]]""")
        self.assertExpectedInline(str(canonical_grid([2, 3])), """6""")
        self.assertExpectedInline(str(list(Grid(size=canonical_grid([1, 2, 4]), dp=2, rank=1).covered_groups())),
                                  """[2, 3]""")

    def test_grid_errors(self):
        with self.assertRaises(ValueError) as e:
            canonical_grid([2, 0])
        self.assertExpectedInline(str(e.exception), """dp size 0 is invalid: every module's DP size must be an integer >= 1""")
        with self.assertRaises(ValueError) as e:
            Grid(size=6, dp=4, rank=0)
        self.assertExpectedInline(str(e.exception), """canonical grid G=6 is not a multiple of dp=4: G must be the lcm of all module DP sizes""")
        with self.assertRaises(ValueError) as e:
            plan_orders(np.zeros((1, 10)), 4)
        self.assertExpectedInline(str(e.exception), """costs holds B=10 samples per slot, not a positive multiple of groups=4: every group holds B/G samples, so choose B as a multiple of G = lcm(DP sizes)""")
        with self.assertRaises(ValueError) as e:
            Grid(size=4, dp=2, rank=2)
        self.assertExpectedInline(str(e.exception), """rank=2 is out of range for dp=2""")
        with self.assertRaises(ValueError) as e:
            plan_orders(np.zeros((1, 4)), 2, balancer="magic")
        self.assertIn("balancer='magic' is unknown", str(e.exception))

    def test_cost_errors(self):
        with self.assertRaises(ValueError) as e:
            CostModel(encoder_weight=-1.0)
        self.assertExpectedInline(str(e.exception), """encoder_weight=-1.0 is invalid: cost weights must be finite and >= 0""")
        with self.assertRaises(ValueError) as e:
            CostModel(encoder_weight=0.0, language_weight=0.0)
        self.assertExpectedInline(str(e.exception), """encoder_weight=0 and language_weight=0: at least one cost weight must be > 0""")
        with self.assertRaises(ValueError) as e:
            token_counts(CostModel(language_weight=0.5), torch.zeros(2, 4, dtype=torch.long), None)
        self.assertExpectedInline(str(e.exception), """attention_mask is missing but language_weight=0.5: load attention_mask on every rank or set the language cost weights to 0""")
        with self.assertRaises(ValueError) as e:
            token_counts(CostModel(), torch.zeros(4, dtype=torch.long), None)
        self.assertExpectedInline(str(e.exception), """input_ids has shape (4,): expected [B, S]""")


@pytest.mark.parametrize("case", faults.cases("cost"), ids=faults.name)
def test_cost_model_refuses_bad_fields_on_every_rank(case):
    """A wrong input_ids dtype (bfloat16 raised "Got unsupported ScalarType BFloat16", naming neither
    the field nor the fix) or a bad attention_mask (dtype, shape, values other than 0/1) on one rank:
    count_samples raises a ValueError naming the field and the value, and in an exchange every
    rank of the DP group raises the same ReorderError carrying it (run_emulated, dp 2)."""
    shares = faults.rank_shares(2)
    shares[1] = case.params["corrupt"](shares[1])
    local, everywhere = case.sees
    with pytest.raises(ValueError) as e:
        count_samples(CostModel(), shares[1]["input_ids"], shares[1]["attention_mask"])
    local.check(e.value)

    def rank(r, coll):
        return WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=4, cost=CostModel(),
                               collectives=coll).exchange([shares[r]])
    out = run_emulated(2, rank, timeout=20, return_exceptions=True)
    for got in out:
        everywhere.check(got)
    assert isinstance(out[0], ReorderError) and str(out[0]) == str(out[1])


def test_every_counting_entry_checks_the_fields():
    """token_counts, count_samples and square_patches check input_ids too; the device path (run here on
    CPU tensors) checks the mask values inside its one host copy; bool masks and float 0/1 masks pass."""
    ids = torch.tensor([[5, 7, 7, 9]])
    m = CostModel(image_token_id=7, vision_start_token_id=9)
    for call in (lambda: token_counts(m, ids.float(), None), lambda: count_samples(m, ids.half(), None),
                 lambda: square_patches(m, ids.to(torch.bool))):
        with pytest.raises(ValueError, match=r"^input_ids has dtype torch\.(float32|float16|bool): it must hold integer"):
            call()
    mask = torch.tensor([[1, 1, 2, 0]])
    for path in (counting._counts_numpy, counting._counts_torch):
        with pytest.raises(ValueError) as e:
            path(m, ids, mask, False, None)
        assert str(e.value) == faults.MASK_VALUES.format(2, 0, 2)
        for ok in (mask.clamp(max=1).bool(), mask.clamp(max=1).to(torch.bfloat16), torch.tensor([[0.0, 1, 1, 0]])):
            assert path(m, ids, ok, False, None)[0][1].tolist() == [int(ok.count_nonzero())]
    with pytest.raises(ValueError, match=r"^attention_mask must be a \[B, S\] tensor; got list"):
        token_counts(m, ids, [[1, 1, 1, 1]])


@given(st.lists(st.integers(1, 6), min_size=1, max_size=4), st.data())
def test_grid_matches_spec(dps, data):
    g = canonical_grid(dps)
    assert g == ref.canonical_grid(dps)
    for d in dps:
        for r in range(d):
            grid = Grid(size=g, dp=d, rank=r)
            assert list(grid.covered_groups()) == ref.covered_groups(d, g, r)
            assert [grid.owner(j) for j in grid.covered_groups()] == [ref.owner(j, d, g) for j in grid.covered_groups()]


@given(st.integers(1, 6), st.integers(1, 40), st.floats(0, 4), st.floats(0, 4), st.integers(1, 3), st.data())
def test_cost_matches_spec(b, s, ew, lw, merge, data):
    if ew == 0 and lw == 0:
        ew = 1.0
    ids = torch.tensor(data.draw(st.lists(st.lists(st.sampled_from([5, 7, 9]), min_size=s, max_size=s),
                                          min_size=b, max_size=b)))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=s, max_size=s), min_size=b, max_size=b)))
    m = CostModel(encoder_weight=ew, language_weight=lw, image_token_id=7, vision_start_token_id=9,
                  spatial_merge_size=merge)
    p, r, _ = token_counts(m, ids, mask)
    got = m.costs(p.numpy(), r.numpy())
    want = [ref.sample_cost(ids[i].tolist(), mask[i].tolist(), image_token_id=7, spatial_merge_size=merge,
                            encoder_weight=ew, language_weight=lw) for i in range(b)]
    assert got.tolist() == want  # bit-exact (I1 depends on it)


costs_st = st.integers(1, 64).flatmap(lambda g: st.tuples(st.just(g), st.integers(1, 16).flatmap(
    lambda k: st.lists(st.sampled_from([0.0, 1.0, 2.0, 3.0, 7.5, 1e4]) | st.floats(0, 1e5), min_size=g * k,
                       max_size=g * k))))


@given(costs_st)
def test_lpt_matches_spec(gc):
    groups, costs = gc
    assert lpt(np.array(costs), groups).tolist() == ref.lpt_order(costs, groups)


@given(costs_st)
def test_plan_equal_count_and_loads(gc):
    groups, costs = gc
    c = np.array([costs, costs[::-1]])
    orders = plan_orders(c, groups)
    for s in range(2):
        assert sorted(orders[s].tolist()) == list(range(len(costs)))  # I3/I6: a permutation
        want = ref.group_loads(c[s].tolist(), orders[s].tolist(), groups)
        assert np.allclose(rank_loads(c[s:s + 1], orders[s:s + 1], groups)[0], want)


@given(st.integers(1, 5), st.integers(1, 30), st.floats(0, 2), st.floats(0, 1e-3), st.floats(0, 2),
       st.floats(0, 1e-3), st.floats(0, 500), st.integers(1, 3), st.data())
def test_quadratic_cost_matches_spec(b, s, ew, eq, lw, lq, ei, merge, data):
    if not (ew or eq or lw or lq or ei):
        ew = 1.0
    ids = torch.tensor(data.draw(st.lists(st.lists(st.sampled_from([5, 7, 7, 9]), min_size=s, max_size=s),
                                          min_size=b, max_size=b)))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=s, max_size=s), min_size=b, max_size=b)))
    m = CostModel(encoder_weight=ew, language_weight=lw, encoder_quadratic_weight=eq, language_quadratic_weight=lq,
                  encoder_image_weight=ei, image_token_id=7, vision_start_token_id=9, spatial_merge_size=merge)
    p, r, images = token_counts(m, ids, mask)
    got = m.costs(p.numpy(), r.numpy(), square_patches(m, ids).numpy(), images.numpy())
    want = [ref.sample_cost(ids[i].tolist(), mask[i].tolist(), image_token_id=7, spatial_merge_size=merge,
                            encoder_weight=ew, language_weight=lw, encoder_quadratic_weight=eq,
                            language_quadratic_weight=lq, encoder_image_weight=ei, vision_start_token_id=9)
            for i in range(b)]
    assert got.tolist() == want  # bit-exact, runs of placeholders = images


@given(st.integers(1, 5), st.integers(1, 30), st.integers(1, 3), st.booleans(), st.data())
def test_both_counting_paths_match_spec(b, s, merge, with_grid, data):
    """The numpy path (host tensors) and the torch path (device tensors: one host copy, no other
    sync), run here on CPU tensors, give the same counts as the spec, and carry grid_thw along."""
    ids = torch.tensor(data.draw(st.lists(st.lists(st.sampled_from([5, 7, 7, 9]), min_size=s, max_size=s),
                                          min_size=b, max_size=b)))
    mask = torch.tensor(data.draw(st.lists(st.lists(st.integers(0, 1), min_size=s, max_size=s), min_size=b, max_size=b)))
    grid_thw = torch.tensor(data.draw(st.lists(st.integers(1, 99), min_size=0, max_size=12)), dtype=torch.int32)
    grid_thw = grid_thw[:len(grid_thw) // 3 * 3].reshape(-1, 3) if with_grid else None
    m = CostModel(encoder_weight=1.0, image_token_id=7, vision_start_token_id=9, spatial_merge_size=merge)
    kw = dict(image_token_id=7, spatial_merge_size=merge, vision_start_token_id=9)
    want = [[ref.sample_cost(ids[i].tolist(), mask[i].tolist(), encoder_weight=w, language_weight=lw,
                             encoder_quadratic_weight=q, encoder_image_weight=im, **kw)
             for i in range(b)] for w, lw, q, im in ((1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0))]
    for path in (partial(counting._counts_numpy, m), partial(counting._counts_torch, m)):
        counts, g = path(ids, mask, True, grid_thw)
        assert counts.dtype == np.int64 and counts.shape == (4, b)
        assert (counts[0] * merge * merge).tolist() == want[0]
        assert counts[1:].tolist() == want[1:]
        assert (g is None) == (grid_thw is None)
        assert g is None or (g.dtype == np.int64 and g.tolist() == grid_thw.tolist())
        no_sq, _ = path(ids, mask, False, None)
        assert no_sq[:3].tolist() == counts[:3].tolist() and not no_sq[3].any()
        no_mask, g2 = path(ids, None, True, grid_thw)
        assert no_mask[[0, 2, 3]].tolist() == counts[[0, 2, 3]].tolist() and not no_mask[1].any()
        assert (g2 is None) == (grid_thw is None) and (g2 is None or g2.tolist() == grid_thw.tolist())


def test_quadratic_cost_golden():
    # two images of 2 and 3 placeholders (merge 2: 8 and 12 patches) -> 8^2 + 12^2 = 208
    ids = torch.tensor([[7, 7, 5, 7, 7, 7], [5, 5, 5, 5, 5, 5]])
    m = CostModel(encoder_weight=0.0, encoder_quadratic_weight=1.0, image_token_id=7, vision_start_token_id=9)
    assert square_patches(m, ids).tolist() == [208, 0]
    with pytest.raises(ValueError, match="needs square_patches"):
        m.costs([5, 0], [0, 0])


@given(st.integers(1, 3), st.sampled_from([(2, 2), (2, 4), (4, 2), (3, 3), (2, 8)]), st.data(),
       st.one_of(st.none(), st.floats(0, 0.5)), st.one_of(st.none(), st.floats(0, 50)))
def test_planning_only_slots_that_can_pay_changes_nothing(w, shape, data, min_gain, min_saving):
    """plan_gated_orders skips planning slots whose lower bound already fails the gate: same result
    as planning every slot and then gating by the spec's gate (integer costs: every load sum is
    exact, in the spec's plain Python as in numpy)."""
    from reorder.plan.orders import plan_gated_orders
    groups, m = shape
    costs = np.array(data.draw(st.lists(st.lists(st.integers(0, 30), min_size=groups * m, max_size=groups * m),
                                        min_size=w, max_size=w)), dtype=np.float64)
    planned = plan_orders(costs, groups, "balanced")
    want = ref.gated_orders(costs.tolist(), planned.tolist(), groups, min_gain, min_saving) \
        if (min_gain is not None or min_saving is not None) else (planned, None)
    got = plan_gated_orders(costs, groups, "balanced", min_gain, min_saving)
    assert np.array_equal(got[0], want[0])
    if want[1] is not None:
        assert np.array_equal(got[1], want[1])
