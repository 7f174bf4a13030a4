"""Module layouts with tensor and pipeline parallelism (reorder.integrations.megatron.check_layout and
wrap) on CPU without megatron: the layouts the MIMO suite runs are accepted with megatron's DP groups,
and each layout megatron-core's MIMO (0.19.2) cannot run is refused at construction with a message that
says why and what to do (exact messages)."""

import numpy as np
import pytest

from reorder.integrations import megatron as rm
from reorder.integrations.config import ReorderConfig

ON = ReorderConfig(megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=True,
                   megatron_mimo_reorder_overlap=False)
NAMES = ["tp", "cp", "pp", "dp", "ep", "expt_dp"]  # the MIMO suite's (and megatron's usual) dim order


class Grid:
    """The attributes of megatron's HyperCommGrid the adapter reads (shape, dim_names, rank_offset)."""

    def __init__(self, tp=1, pp=1, dp=1, offset=0, cp=1):
        self.shape, self.dim_names, self.rank_offset = [tp, cp, pp, dp, 1, 1], list(NAMES), offset
        self.size = int(np.prod(self.shape))


def check(grids, **kw):
    return rm.check_layout(grids, fixed_width_padding=True, **kw)


def refusal(grids, **kw):
    with pytest.raises(ValueError) as e:
        check(grids, **kw)
    return str(e.value)


# ---- accepted: the suite's layouts, with megatron-core 0.19.2's get_rank_enum("dp") groups -------

@pytest.mark.parametrize("grids,expected", [
    # colocated language TP 2 x DP 2, the encoder on the same grid
    ({"images": Grid(tp=2, dp=2), "language": Grid(tp=2, dp=2)},
     {"images": [[0, 2], [1, 3]], "language": [[0, 2], [1, 3]]}),
    # encoder dp 2 + language tp 2 x dp 2 (6 ranks)
    ({"images": Grid(dp=2), "language": Grid(tp=2, dp=2, offset=2)},
     {"images": [[0, 1]], "language": [[2, 4], [3, 5]]}),
    # encoder dp 2 + language pp 2 x dp 2 (6 ranks)
    ({"images": Grid(dp=2), "language": Grid(pp=2, dp=2, offset=2)},
     {"images": [[0, 1]], "language": [[2, 4], [3, 5]]}),
    # encoder tp 2 x dp 2 + language dp 4 (8 ranks, fan-out 2)
    ({"images": Grid(tp=2, dp=2), "language": Grid(dp=4, offset=4)},
     {"images": [[0, 2], [1, 3]], "language": [[4, 5, 6, 7]]}),
    # encoder tp 2 x dp 1 + language pp 3 x dp 2 (8 ranks, fan-out 2, a middle stage)
    ({"images": Grid(tp=2), "language": Grid(pp=3, dp=2, offset=2)},
     {"images": [[0], [1]], "language": [[2, 5], [3, 6], [4, 7]]}),
])
def test_suite_layouts_are_accepted(grids, expected):
    assert check(grids) == expected


def test_language_pp_stages_and_fields():
    g = Grid(pp=3, dp=2, offset=2)  # pp groups [[2, 3, 4], [5, 6, 7]]
    assert [rm.pp_stage(g, r) for r in range(2, 8)] == [(0, 3), (1, 3), (2, 3), (0, 3), (1, 3), (2, 3)]
    stages = [rm.fields_to_load("language", s, ON, pp_size=3) for s in range(3)]
    assert stages == [("input_ids", "position_ids", "labels", "loss_mask"), ("input_ids", "position_ids"),
                      ("input_ids", "position_ids", "labels", "loss_mask")]


# ---- refused: what megatron-core 0.19.2's MIMO cannot run ---------------------------------------

def test_context_parallel_language_is_refused():
    assert refusal({"images": Grid(dp=2), "language": Grid(cp=2, dp=2, offset=2)}) == (
        "module 'language' has context-parallel size 2: megatron-core's MIMO bridges (BridgeCommunicator "
        "between modules, ColocatedBridgeCommunicator within ranks) require CP 1, so the model cannot run; set "
        "the 'language' grid's 'cp' dim to 1 (use TP or PP for the language model instead)")


def test_context_parallel_encoder_is_refused():
    assert refusal({"images": Grid(cp=2), "language": Grid(dp=2, offset=2)}).startswith(
        "module 'images' has context-parallel size 2: megatron-core's MIMO bridges")


def test_colocated_modules_with_different_dp_groups_are_refused():
    # encoder tp 1 x dp 4 on the ranks of language tp 2 x dp 2: ColocatedBridgeCommunicator fan-in
    assert refusal({"images": Grid(dp=4), "language": Grid(tp=2, dp=2)}) == (
        "colocated modules 'images' and 'language' have different DP groups ('images': [[0, 1, 2, 3]], "
        "'language': [[0, 2], [1, 3]]): megatron-core's ColocatedBridgeCommunicator splits the encoder's "
        "image-token rows into equal shares per DP rank (it assumes one token count per sample), so variable "
        "image sizes would reach other samples' placeholders, and each rank would need one micro-batch stream "
        "per module; give the encoder the language model's TP and DP sizes, or place it on its own ranks")


def test_modules_sharing_some_ranks_are_refused():
    assert refusal({"images": Grid(dp=2), "language": Grid(tp=2, dp=2)}) == (
        "modules 'images' (ranks [0, 1]) and 'language' (ranks 0..3) share ranks [0, 1] but not all of them: "
        "megatron-core's MimoModel runs either colocated (every module on the same ranks) or non-colocated "
        "(disjoint ranks); give both modules the same ranks or disjoint ones")
    assert refusal({"images": [[0]], "language": [[0, 1]]}).startswith(
        "modules 'images' (ranks [0]) and 'language' (ranks [0, 1]) share ranks [0] but not all of them")


def test_colocated_pipeline_parallel_language_is_refused():
    assert refusal({"images": Grid(pp=2, dp=2), "language": Grid(pp=2, dp=2)}) == (
        "module 'language' has pipeline-parallel size 2 colocated with 'images': megatron-core's colocated "
        "MimoModel runs every module on every rank with PP 1 (ColocatedBridgeCommunicator requires PP 1); "
        "place the encoder on its own ranks (non-colocated) to pipeline the language model")


def test_pipeline_parallel_encoder_is_refused():
    assert refusal({"images": Grid(pp=2), "language": Grid(dp=2, offset=2)}) == (
        "encoder_pp=2: reorder does not support a pipeline-parallel vision encoder; set the encoder's "
        "pipeline-parallel size to 1")


def test_fan_in_is_refused_with_tensor_parallel_grids():
    # encoder dp 4 (tp 1) feeding language tp 2 x dp 2 on their own ranks: fan-in
    assert refusal({"images": Grid(dp=4), "language": Grid(tp=2, dp=2, offset=4)}) == (
        "encoder_dp=4 > language_dp=2: MimoModel's fan-in path asserts on variable image-token counts; give "
        "the language module at least the encoder's DP size")


@pytest.mark.parametrize("grids,msg", [
    ({"images": Grid(dp=2), "language": Grid(cp=2, dp=2, offset=2)}, "context-parallel size 2"),
    ({"images": Grid(dp=4), "language": Grid(tp=2, dp=2)}, "colocated modules 'images' and 'language'"),
    ({"images": Grid(dp=2), "language": Grid(tp=2, dp=2)}, "share ranks [0, 1] but not all of them"),
    ({"images": Grid(pp=2, dp=2), "language": Grid(pp=2, dp=2)}, "pipeline-parallel size 2 colocated"),
])
def test_wrap_refuses_before_creating_groups(grids, msg):
    """wrap runs check_layout first: the refusal comes without an initialized process group."""
    with pytest.raises(ValueError) as e:
        rm.wrap(iter([]), config=ON, module="language", grids=grids, micro_batch_size=8, fixed_width_padding=True,
                rank=0)
    assert msg in str(e.value)
