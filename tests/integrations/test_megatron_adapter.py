"""Megatron adapter (reorder.integrations.megatron) on CPU without megatron: DP groups from HyperCommGrid-like
objects and plain lists, per-rank field selection, `wrap` rejections, and `wrap` end to end on a
1-process and a 2-process Gloo world (fork start) against the reference LPT plan."""

import datetime
import os
import sys

import numpy as np
import pytest
import torch.distributed as dist

from reorder.integrations import megatron as rm
from reorder.cli import synthetic as syn
from reorder.integrations.config import ReorderConfig
from reorder.plan.cost import CostModel
from spec import reference as ref
from reorder.batch.counting import token_counts

ON = ReorderConfig(megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=True,
                   megatron_mimo_reorder_overlap=False)


class FakeGrid:
    """The attributes of megatron's HyperCommGrid the adapter reads (no get_rank_enum: fallback path)."""

    def __init__(self, shape, dim_names, rank_offset=0):
        self.shape, self.dim_names, self.rank_offset = list(shape), list(dim_names), rank_offset
        self.size = int(np.prod(shape))


class EnumGrid(FakeGrid):
    """A grid that answers get_rank_enum itself: the adapter must use its answer."""

    def get_rank_enum(self, dims):
        self.asked = dims
        return [[7, 9]] if dims == "dp" else [[7], [9]]


def grid4(tp=1, cp=1, pp=1, dp=1, offset=0):
    return FakeGrid([tp, cp, pp, dp], ["tp", "cp", "pp", "dp"], offset)


# ---- DP groups ---------------------------------------------------------------------------------

# expected values follow megatron's HyperCommGrid convention (checked against megatron-core 0.19.2's
# get_rank_enum): the first dim name varies fastest (tp, then cp, pp, dp)
@pytest.mark.parametrize("comm_grid,expected", [
    (grid4(dp=2), [[0, 1]]),
    (grid4(tp=2, dp=2), [[0, 2], [1, 3]]),
    (grid4(tp=2, pp=2, dp=2), [[0, 4], [1, 5], [2, 6], [3, 7]]),
    (grid4(cp=2, dp=2, offset=3), [[3, 5], [4, 6]]),
    (grid4(dp=4, offset=1), [[1, 2, 3, 4]]),
    (FakeGrid([2, 2, 2], ["tp", "dp", "pp"]), [[0, 2], [1, 3], [4, 6], [5, 7]]),
    (FakeGrid([2, 1, 1, 2, 1, 1], ["tp", "cp", "pp", "dp", "ep", "expt_dp"], 2), [[2, 4], [3, 5]]),
])
def test_dp_groups_from_grid(comm_grid, expected):
    assert rm.dp_groups_from_grid(comm_grid) == expected


def test_rank_enum_orders_dims_like_get_rank_enum():
    # get_rank_enum sorts the requested dims by reversed dim_names before enumerating, so ["a", "b"]
    # and ["b", "a"] give the same groups (megatron 0.19.2: [[0, 1, 2, 3], [4, 5, 6, 7]]); its private
    # _gen_rank_enum(["a", "b"]) without that sort would give [[0, 2, 1, 3], [4, 6, 5, 7]]
    for dims in (["a", "b"], ["b", "a"]):
        assert rm._rank_enum([2, 2, 2], ["a", "b", "c"], 0, dims) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rm._rank_enum([2, 3], ["tp", "dp"], 0, "tp") == [[0, 1], [2, 3], [4, 5]]


def test_grid_with_get_rank_enum_is_asked():
    g = EnumGrid([1, 2], ["tp", "dp"])
    assert rm.dp_groups_from_grid(g) == [[7, 9]] and g.asked == "dp"


def test_pp_stage_from_grid():
    g = grid4(tp=2, pp=2, dp=2)  # pp groups [[0,2],[1,3],[4,6],[5,7]]
    assert [rm.pp_stage(g, r) for r in range(8)] == [(0, 2), (0, 2), (1, 2), (1, 2), (0, 2), (0, 2), (1, 2), (1, 2)]
    assert rm.pp_stage([[0, 1]], 1) == (0, 1)
    with pytest.raises(ValueError, match="rank 9 is not in the grid"):
        rm.pp_stage(g, 9)


def test_plain_lists():
    assert rm.dp_groups_from_grid([[0, 1], [2, 3]]) == [[0, 1], [2, 3]]
    assert rm.dp_groups_from_grid([4, 5]) == [[4, 5]]
    assert rm.dp_groups_from_grid((np.int64(0),)) == [[0]]


@pytest.mark.parametrize("bad,msg", [
    ([], "empty"),
    ([[0, 1], [2]], "same size"),
    ([[0, 1], [1, 2]], "more than once"),
    ([[0, -1]], "not a global rank"),
    ("01", "neither"),
    (FakeGrid([2, 2], ["tp", "pp"]), "no 'dp' dim"),
])
def test_bad_dp_groups(bad, msg):
    with pytest.raises(ValueError, match=msg):
        rm.dp_groups_from_grid(bad)


# ---- field selection ---------------------------------------------------------------------------

W0 = ON
W05 = ReorderConfig(megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=True,
                    megatron_mimo_reorder_language_cost_weight=0.5)


@pytest.mark.parametrize("module,stage,pp,cfg,expected", [
    ("images", 0, 1, W0, ("input_ids", "modality_inputs")),
    ("images", 0, 1, W05, ("input_ids", "attention_mask", "modality_inputs")),
    ("language", 0, 1, W0, ("input_ids", "position_ids", "labels", "loss_mask")),
    ("language", 0, 1, W05, ("input_ids", "attention_mask", "position_ids", "labels", "loss_mask")),
    ("language", 0, 3, W0, ("input_ids", "position_ids", "labels", "loss_mask")),
    ("language", 1, 3, W0, ("input_ids", "position_ids")),
    ("language", 1, 3, W05, ("input_ids", "attention_mask", "position_ids")),
    ("language", 2, 3, W0, ("input_ids", "position_ids", "labels", "loss_mask")),
    (["images", "language"], 0, 1, W0, ("input_ids", "modality_inputs", "position_ids", "labels", "loss_mask")),
])
def test_fields_to_load(module, stage, pp, cfg, expected):
    assert rm.fields_to_load(module, stage, cfg, pp_size=pp) == expected


def test_fields_to_load_every_stage_can_compute_the_cost():
    g = syn.make_global_batch(np.random.default_rng(0), 4, 96, mix="small")
    for cfg in (W0, W05):
        cost = CostModel(language_weight=cfg.language_weight)
        costs = set()
        for module, stage, pp in [("images", 0, 1), ("language", 0, 4), ("language", 1, 4), ("language", 3, 4)]:
            view = rm.select_fields(g, rm.fields_to_load(module, stage, cfg, pp_size=pp))
            p, r, _ = token_counts(cost, view["input_ids"], view.get("attention_mask"))
            costs.add(tuple(cost.costs(p.numpy(), r.numpy())))
        assert len(costs) == 1  # I1: same cost on every module and stage


def test_fields_to_load_accepts_upstream_objects_and_rejects_bad_stage():
    class DatasetConfig:  # what a Megatron-Bridge dataset config carries
        megatron_mimo_scalable_dp = True
        megatron_mimo_intra_microbatch_reorder = True
        megatron_mimo_reorder_language_cost_weight = 0.25
    assert "attention_mask" in rm.fields_to_load("language", 0, DatasetConfig())
    with pytest.raises(ValueError, match=r"pp_stage=2: must be an integer in \[0, pp_size=2\)"):
        rm.fields_to_load("language", 2, ON, pp_size=2)
    with pytest.raises(ValueError, match="pipeline-parallel vision encoder"):
        rm.fields_to_load("images", 0, ON, pp_size=2)


# ---- wrap: off, rejections ---------------------------------------------------------------------

def test_wrap_off_passes_micro_batches_through_a_closeable_buffer():
    """Off or on, wrap's result is a context manager with ReorderingBuffer's interface; off, it yields
    the source's micro-batches unchanged (the same objects)."""
    from reorder.runtime.buffer import ReorderingBuffer

    items = [{"input_ids": 1}, {"input_ids": 2}]
    off = ReorderConfig()
    with rm.wrap(iter(items), config=off, module="language", grids={"language": [[0, 1]]}, micro_batch_size=4,
                 fixed_width_padding=False) as it:
        got = list(it)
        assert it.last_report is None and len(it.reports) == 0 and not it.worker_alive and not it.overlap
    assert all(a is b for a, b in zip(got, items)) and len(got) == 2
    public = {n for n in dir(ReorderingBuffer) if not n.startswith("_")} | {"__enter__", "__exit__", "__next__"}
    assert all(hasattr(it, n) for n in public), sorted(n for n in public if not hasattr(it, n))
    it = rm.wrap(iter(items), config=off, module="language", grids={"language": [[0, 1]]}, micro_batch_size=4,
                 fixed_width_padding=False)
    assert next(it) is items[0]
    it.close()
    with pytest.raises(StopIteration):
        next(it)
    # a rank that loads nothing (Megatron passes None, and tests `data_iterator is not None`) keeps None
    assert rm.wrap(None, config={"megatron_mimo_scalable_dp": True}, module="x", grids={}, micro_batch_size=3,
                   fixed_width_padding=True) is None


@pytest.mark.parametrize("grids,kw,msg", [
    ({"images": grid4(pp=2, dp=1), "language": grid4(dp=2, offset=2)}, {}, "encoder_pp=2"),
    ({"images": [[0, 1]], "language": [[2, 3]]}, {"pp_sizes": {"images": 2}}, "encoder_pp=2"),
    ({"images": [[0, 1, 2, 3]], "language": [[4, 5]]}, {}, "encoder_dp=4 > language_dp=2"),
    ({"images": grid4(dp=2), "language": grid4(dp=3, offset=2)}, {}, "not a multiple of encoder_dp=2"),
    ({"images": [[0]], "language": [[1, 2]]}, {"fixed_width_padding": False}, "fixed_width_padding=False"),
    ({"images": [[0]], "language": [[1, 2]]}, {"fixed_width_padding": None}, "fixed_width_padding=None"),
    ({"images": [[0]]}, {}, "no 'language' module"),
    ({"images": [[0]], "language": [[1]]}, {"module": "audio"}, "module='audio' is not in grids"),
    ({"images": [[0]], "language": [[1]]}, {"rank": 0, "module": "language"}, "rank 0 is in no DP group"),
    ({"images": [[0], [1]], "language": [[0, 1]]}, {"rank": 1, "module": "language"},
     "colocated modules 'images' and 'language' have different DP groups"),
    ({"images": [[0]], "language": [[1]]}, {"rank": 1, "data_iterator": None}, "data_iterator is None"),
])
def test_wrap_rejections(grids, kw, msg):
    args = dict(config=ON, module="language", grids=grids, micro_batch_size=4, fixed_width_padding=True, rank=1)
    it = kw.pop("data_iterator", iter([]))
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        rm.wrap(it, **args)


def test_module_import_needs_no_megatron():
    import importlib
    import subprocess
    code = ("import sys; sys.modules['megatron'] = None; import reorder.integrations.megatron as m; "
            "assert 'megatron.core' not in sys.modules; print(m.dp_groups_from_grid([[0, 1]]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0 and out.stdout.strip() == "[[0, 1]]", out.stderr
    assert importlib.util.find_spec("reorder.integrations.megatron") is not None


# ---- wrap end to end on Gloo -------------------------------------------------------------------

B, S = 8, 96


def _global_batches(n, seed=3):
    rng = np.random.default_rng(seed)
    return [syn.make_global_batch(rng, B, S, features=4, mix="small", first_id=k * B) for k in range(n)]


def _expected_ids(g, cfg, dp, rank, groups):
    cost = CostModel(language_weight=cfg.language_weight)
    p, r, _ = token_counts(cost, g["input_ids"], g["attention_mask"])
    order = ref.lpt_order([float(c) for c in cost.costs(p.numpy(), r.numpy())], groups)
    ids = g["sample_id"].tolist()
    return [ids[i] for i in order[rank * B // dp:(rank + 1) * B // dp]]


def _rank_main(rank, world, grids, cfg_kwargs):
    cfg = ReorderConfig(megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=True, **cfg_kwargs)
    dp = len(rm.dp_groups_from_grid(grids["language"])[0])
    fields = rm.fields_to_load(["images", "language"], 0, cfg)
    src = (rm.select_fields(syn.rank_share(g, dp, rank % dp), fields + ("sample_id",)) for g in _global_batches(5))
    buf = rm.wrap(src, config=cfg, module="language", grids=grids, micro_batch_size=B, fixed_width_padding=True,
                  timeout=datetime.timedelta(seconds=60))
    assert buf.ahead == cfg.overlap_ahead
    assert buf._ex.early_copy == (not cfg.overlap)  # synchronous: the copy to the device starts before planning
    assert (buf._ex.min_saving, buf._ex.gate_backoff) == (cfg.min_saving, cfg.gate_backoff)
    got = [mb["sample_id"].tolist() for mb in buf]
    buf.close()
    everyone = [None] * world
    dist.all_gather_object(everyone, got)
    return everyone


def _launch(world, grids, **cfg_kwargs):
    """wrap() on `world` forked Gloo ranks (reorder.cli.processes: bounded, one thread per child);
    the balancer is the reference-checkable "lpt"."""
    from reorder.cli.processes import run_processes

    return run_processes(_rank_main, world, (grids, dict(cfg_kwargs, megatron_mimo_reorder_balancer="lpt")), timeout=120)


def test_wrap_dp1_permutes_locally():
    got = _launch(1, {"images": [[0]], "language": [[0]]}, megatron_mimo_reorder_window_size=2)
    cfg = ReorderConfig()
    assert got[0] == [_expected_ids(g, cfg, 1, 0, 1) for g in _global_batches(5)]
    assert got[0][0] != list(range(B))  # the plan did move samples (costs are not already sorted)


@pytest.mark.parametrize("overlap", [False, True])
def test_wrap_colocated_dp2_from_grids(overlap):
    grids = {"images": grid4(dp=2), "language": grid4(dp=2)}  # colocated: both modules on ranks 0, 1
    got = _launch(2, grids, megatron_mimo_reorder_overlap=overlap, megatron_mimo_reorder_language_cost_weight=0.5,
                  megatron_mimo_reorder_overlap_ahead=2 if overlap else 1)
    cfg = ReorderConfig(megatron_mimo_reorder_language_cost_weight=0.5)
    for rank in range(2):
        assert got[rank] == [_expected_ids(g, cfg, 2, rank, 2) for g in _global_batches(5)]


@pytest.mark.parametrize("overlap", [False, True])
def test_wrap_passes_the_gate_and_its_backoff(overlap):
    """A gate no window can pass, with backoff: every rank streams its natural share, planned or
    skipped, with and without the overlap thread."""
    grids = {"images": grid4(dp=2), "language": grid4(dp=2)}
    got = _launch(2, grids, megatron_mimo_reorder_overlap=overlap,
                  megatron_mimo_reorder_min_saving=1e18, megatron_mimo_reorder_gate_backoff=4)
    for rank in range(2):
        assert got[rank] == [g["sample_id"].tolist()[rank * B // 2:(rank + 1) * B // 2] for g in _global_batches(5)]


def test_rank_enum_matches_megatron_golden_table():
    """Golden values read from megatron-core 0.19.2's HyperCommGrid(shape, names, rank_offset=3)
    .get_rank_enum(dims) (WORLD_SIZE=64, Python 3.12). With a real grid, `rank_enum` calls the grid's
    own get_rank_enum, so this fallback only serves grid-like objects without it."""
    golden = {
        ((2, 1, 2, 2), ("tp", "cp", "pp", "dp"), ("dp",)): [[3, 7], [4, 8], [5, 9], [6, 10]],
        ((2, 1, 2, 2), ("tp", "cp", "pp", "dp"), ("tp", "pp")): [[3, 4, 5, 6], [7, 8, 9, 10]],
        ((2, 1, 2, 2), ("tp", "dp", "cp", "pp"), ("dp",)): [[3], [4], [5], [6], [7], [8], [9], [10]],
        ((2, 1, 2, 2), ("tp", "dp", "cp", "pp"), ("tp", "pp")): [[3, 4, 7, 8], [5, 6, 9, 10]],
        ((1, 2, 2, 4), ("tp", "cp", "pp", "dp"), ("dp",)): [[3, 7, 11, 15], [4, 8, 12, 16], [5, 9, 13, 17],
                                                           [6, 10, 14, 18]],
        ((1, 2, 2, 4), ("tp", "cp", "pp", "dp"), ("tp", "pp")): [[3, 5], [4, 6], [7, 9], [8, 10], [11, 13],
                                                                [12, 14], [15, 17], [16, 18]],
        ((1, 2, 2, 4), ("tp", "dp", "cp", "pp"), ("dp",)): [[3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14],
                                                           [15, 16], [17, 18]],
        ((1, 2, 2, 4), ("tp", "dp", "cp", "pp"), ("tp", "pp")): [[3, 7, 11, 15], [4, 8, 12, 16], [5, 9, 13, 17],
                                                                [6, 10, 14, 18]],
    }
    for (shape, names, dims), want in golden.items():
        assert rm._rank_enum(list(shape), list(names), 3, list(dims)) == want, (shape, names, dims)
        if dims == ("dp",):
            assert rm.dp_groups_from_grid(FakeGrid(list(shape), list(names), 3)) == want

def test_wrap_takes_megatrons_micro_batch_size_and_the_deprecated_global_batch():
    off = ReorderConfig()
    grids = {"language": [[0, 1]]}
    it = rm.wrap(iter([]), config=off, module="language", grids=grids, micro_batch_size=8, fixed_width_padding=True)
    assert it.micro_batch_size == 8
    with pytest.warns(DeprecationWarning, match=r"wrap\(global_batch=...\) is deprecated: use micro_batch_size="):
        it = rm.wrap(iter([]), config=off, module="language", grids=grids, global_batch=8, fixed_width_padding=True)
    assert it.state_dict()["micro_batch_size"] == 8
    with pytest.raises(TypeError, match="missing keyword argument 'micro_batch_size'"):
        rm.wrap(iter([]), config=off, module="language", grids=grids, fixed_width_padding=True)
