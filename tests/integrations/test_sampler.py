"""CanonicalBatchSampler: every module rank reads its contiguous share of one global micro-batch."""

import math

import expecttest
import pytest
import torch
from hypothesis import given, settings, strategies as st

from reorder.integrations.sampler import CanonicalBatchSampler

MODES = [("single", True), ("cyclic", True), ("cyclic", False)]  # (mode, data_sharding)
GRID_PAIRS = [(1, 2), (2, 4), (2, 3)]


def make(n, b, dp, rank, grid, mode="single", sharding=True, **kw):
    return CanonicalBatchSampler(n, b, data_parallel_size=dp, data_parallel_rank=rank, grid_size=grid,
                                 dataloader_type=mode, data_sharding=sharding, **kw)


def epoch(n, b, dp, rank, grid, mode, sharding, **kw):
    return list(make(n, b, dp, rank, grid, mode, sharding, **kw))


@pytest.mark.parametrize("mode,sharding", MODES)
@pytest.mark.parametrize("pair", GRID_PAIRS)
def test_rank_share_is_block_of_dp1_window(pair, mode, sharding):
    grid = math.lcm(*pair)
    n, b = 101, 4 * grid
    whole = epoch(n, b, 1, 0, grid, mode, sharding)
    assert len(whole) == n // b and all(len(w) == b for w in whole)
    for dp in (*pair, 1):
        share = b // dp
        for r in range(dp):
            got = epoch(n, b, dp, r, grid, mode, sharding)
            assert got == [w[r * share:(r + 1) * share] for w in whole], (dp, r)
    # nested DP sizes: vision rank v == concatenation of its k language ranks ({2,3} is not nested)
    d1, d2 = pair
    k = d2 // d1
    for v in range(d1 if d2 % d1 == 0 else 0):
        lang = [epoch(n, b, d2, v * k + j, grid, mode, sharding) for j in range(k)]
        assert epoch(n, b, d1, v, grid, mode, sharding) == [sum(ws, []) for ws in zip(*lang)]


@settings(max_examples=40, deadline=None)
@given(dps=st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=3),
       per_group=st.integers(1, 3), extra=st.integers(0, 40), mode=st.sampled_from(MODES),
       seed=st.integers(0, 5))
def test_property_any_dp_on_grid(dps, per_group, extra, mode, seed):
    grid = math.lcm(*dps)
    b = grid * per_group
    n = b + extra
    whole = epoch(n, b, 1, 0, grid, *mode, seed=seed)
    flat = sum(whole, [])
    assert len(set(flat)) == len(flat) and max(flat) < (n // b) * b  # truncated, no duplicates
    for dp in dps:
        for r in range(dp):
            got = epoch(n, b, dp, r, grid, *mode, seed=seed)
            assert got == [w[r * b // dp:(r + 1) * b // dp] for w in whole]


def test_truncation_54_samples_b8_g4():
    for mode, sharding in MODES:
        for dp in (1, 2, 4):
            for r in range(dp):
                batches = epoch(54, 8, dp, r, 4, mode, sharding)
                assert len(batches) == 6 and all(len(x) == 8 // dp for x in batches)
        whole = epoch(54, 8, 1, 0, 4, mode, sharding)
        assert sorted(sum(whole, [])) == list(range(48))  # one epoch covers exactly the first 48
    assert epoch(54, 8, 1, 0, 4, "single", True)[1] == list(range(8, 16))
    assert epoch(54, 8, 4, 3, 4, "single", True)[1] == [14, 15]


def test_cyclic_group_semantics():
    n, b, grid = 54, 8, 4  # bucket = 12 samples per group
    whole = epoch(n, b, 1, 0, grid, "cyclic", True)
    for g in range(grid):  # data sharding: group g only ever reads its own bucket
        assert sorted(sum((w[2 * g:2 * g + 2] for w in whole), [])) == list(range(12 * g, 12 * g + 12))
    # no sharding: the window's set is a contiguous slice of one epoch permutation, order independent of dp
    a = [set(w) for w in epoch(n, b, 1, 0, 4, "cyclic", False)]
    c = [set(w) for w in epoch(n, b, 1, 0, 8, "cyclic", False)]
    assert a == c


def _megatron_random_stream(n, mbs, dp, rank, sharding, epoch):
    """Independent restatement of Megatron's MegatronPretrainingRandomSampler (epoch seed, offset 0)."""
    gen = torch.Generator()
    gen.manual_seed(epoch)
    if sharding:
        bucket = (n // (mbs * dp)) * mbs
        idx = [rank * bucket + x for x in torch.randperm(bucket, generator=gen).tolist()]
    else:
        idx = torch.randperm((n // mbs) * mbs, generator=gen).tolist()[rank::dp]
    return [idx[i:i + mbs] for i in range(0, len(idx) - mbs + 1, mbs)]


@pytest.mark.parametrize("sharding", [True, False])
def test_group_stream_matches_megatron_at_g_equal_dp(sharding):
    n = 54 if sharding else 48  # unsharded Megatron does not truncate to whole global batches
    for e in range(2):
        for g in range(4):
            got = epoch(n, 8, 4, g, 4, "cyclic", sharding, consumed_samples=48 * e)
            assert got == _megatron_random_stream(n, 2, 4, g, sharding, e)[:6]


def test_cyclic_epochs_reshuffle_and_depend_on_seed():
    s = make(54, 8, 2, 1, 4, "cyclic")
    e0, e1 = list(s), list(s)
    assert len(e0) == len(e1) == 6 and e0 != e1 and s.epoch == 2
    assert list(make(54, 8, 2, 1, 4, "cyclic", seed=1)) == e1  # seed + epoch
    assert list(make(54, 8, 2, 1, 4, "cyclic", seed=7)) != e0


@pytest.mark.parametrize("mode,sharding", MODES)
@pytest.mark.parametrize("k", [0, 1, 5, 6, 7, 11, 13])
def test_resume_reproduces_tail(mode, sharding, k):
    def stream(sampler, epochs):
        return [batch for _ in range(epochs) for batch in sampler]

    epochs = 1 if mode == "single" else 3
    full = stream(make(54, 8, 2, 1, 4, mode, sharding), epochs)
    if mode == "single" and k > 6:
        return
    resumed = make(54, 8, 2, 1, 4, mode, sharding, consumed_samples=8 * k)
    tail = stream(resumed, epochs)[: len(full) - k]
    assert tail == full[k:]


def test_state_dict_round_trip_and_dp_change():
    s = make(54, 8, 2, 0, 4, "cyclic", False, seed=3)
    assert len(list(s)) == 6  # one iter() == the rest of one epoch
    it = iter(s)
    second = [next(it), next(it)]  # state is taken after the 8th batch, inside epoch 1
    state = s.state_dict()
    assert state["consumed_samples"] == 64 and s.epoch == 1 and len(second) == 2
    expected = list(it)
    t = make(54, 8, 2, 0, 4, "cyclic", False, seed=3)
    t.load_state_dict(state)
    assert len(t) == 4 and list(t) == expected
    # the state is global: a dp-4 module on the same grid resumes at the same window
    u = make(54, 8, 4, 1, 4, "cyclic", False, seed=3)
    u.load_state_dict(state)
    assert list(u) == [x[2:4] for x in expected]


def test_single_pass_ends():
    s = make(54, 8, 1, 0, 4, "single", consumed_samples=48)
    assert len(s) == 0 and list(s) == []
    s = make(54, 8, 1, 0, 4, "single")
    assert len(list(s)) == 6 and list(s) == []


class TestErrors(expecttest.TestCase):
    def err(self, **kw):
        args = dict(total_samples=54, micro_batch_size=8, data_parallel_size=2, data_parallel_rank=0, grid_size=4)
        args.update(kw)
        with self.assertRaises(ValueError) as cm:
            CanonicalBatchSampler(args.pop("total_samples"), args.pop("micro_batch_size"), **args)
        return str(cm.exception)

    def test_messages(self):
        self.assertExpectedInline(self.err(micro_batch_size=10),
                                  """micro_batch_size=10 is not a multiple of the canonical grid G=4""")
        self.assertExpectedInline(self.err(drop_last=False), """drop_last=False is not supported: modules with different DP sizes must all see whole global micro-batches, so the dataset is truncated to a multiple of micro_batch_size; pass drop_last=True""")
        self.assertExpectedInline(self.err(grid_size=3, micro_batch_size=6), """grid_size=3 is not a multiple of data_parallel_size=2: the canonical grid G must be the lcm of all module DP sizes""")
        self.assertExpectedInline(self.err(data_parallel_rank=2), """data_parallel_rank=2 is out of range for data_parallel_size=2: must be in [0, 2)""")
        self.assertExpectedInline(self.err(dataloader_type="random"), """dataloader_type='random': must be one of ['single', 'cyclic']""")
        self.assertExpectedInline(self.err(total_samples=5), """total_samples=5 is smaller than micro_batch_size=8: not even one global micro-batch""")
        self.assertExpectedInline(self.err(consumed_samples=12), """consumed_samples=12 is not a multiple of micro_batch_size=8""")
        self.assertExpectedInline(self.err(consumed_samples=56), """consumed_samples=56 exceeds the 48 samples of the single pass (dataloader_type 'single' does not wrap around)""")
        self.assertExpectedInline(self.err(data_parallel_size=0), """data_parallel_size=0: must be an integer >= 1""")

    def test_state_mismatch(self):
        state = make(54, 8, 2, 0, 4, "cyclic").state_dict()
        with self.assertRaises(ValueError) as cm:
            make(54, 8, 2, 0, 2, "cyclic").load_state_dict(state)
        self.assertExpectedInline(str(cm.exception), """grid_size=4 in the state dict does not match this sampler's grid_size=2""")


def test_megatron_names_and_deprecated_aliases():
    """Megatron's names (Megatron-Bridge's canonical MIMO sampler: micro_batch_size is the global
    micro-batch); the older keywords still build the same sampler, with a DeprecationWarning."""
    new = CanonicalBatchSampler(54, micro_batch_size=8, data_parallel_size=2, data_parallel_rank=1, grid_size=4,
                                dataloader_type="cyclic", seed=3)
    assert (new.micro_batch_size, new.data_parallel_size, new.data_parallel_rank, new.grid_size,
            new.dataloader_type) == (8, 2, 1, 4, "cyclic")
    with pytest.warns(DeprecationWarning, match=r"\(global_batch_size=, dp=, rank=, grid=, mode=\) is deprecated: use "
                                                r"micro_batch_size=, data_parallel_size=, data_parallel_rank=, "
                                                r"grid_size=, dataloader_type="):
        old = CanonicalBatchSampler(54, global_batch_size=8, dp=2, rank=1, grid=4, mode="cyclic", seed=3)
    assert list(old) == list(new)
    state = {"consumed_samples": 16, "total_samples": 54, "global_batch_size": 8, "grid": 4, "mode": "cyclic",
             "data_sharding": True, "seed": 3}  # saved under the older names
    fresh = make(54, 8, 2, 1, 4, "cyclic", seed=3)
    fresh.load_state_dict(state)
    assert fresh.consumed_samples == 16
    with pytest.raises(TypeError, match="unexpected keyword argument 'world'"):
        CanonicalBatchSampler(54, 8, data_parallel_size=2, data_parallel_rank=0, grid_size=2, world=2)
    with pytest.raises(TypeError, match="missing argument 'grid_size'"):
        CanonicalBatchSampler(54, 8, data_parallel_size=2, data_parallel_rank=0)
