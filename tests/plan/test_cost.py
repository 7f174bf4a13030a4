"""Input checks of the grid and the cost model, word for word, on every bad input they must refuse
(and the good inputs next to them they must accept); the quadratic cost through the public
`count_samples` path against the spec's `sample_cost`, and a plan it changes."""

import inspect
import math

import numpy as np
import pytest
import torch

from reorder import CostModel, Grid, canonical_grid, plan_orders
from reorder.plan import grid as grid_module
from reorder.plan.grid import check_global_batch, check_micro_batch_size
from spec import reference as ref
from reorder.batch.counting import count_samples, token_counts

WEIGHTS = ("encoder_weight", "language_weight", "encoder_quadratic_weight", "language_quadratic_weight",
           "encoder_image_weight")


def message(call):
    with pytest.raises(ValueError) as e:
        call()
    return str(e.value)


# --- grid -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dp", [0, -2, 2.0, "2", None])
def test_grid_refuses_a_bad_dp(dp):
    assert message(lambda: Grid(size=4, dp=dp, rank=0)) == \
        f"dp={dp!r} is invalid: a module's DP size must be an integer >= 1"


@pytest.mark.parametrize("size", [0, -4, 4.0, "4", None])
def test_grid_refuses_a_bad_size(size):
    assert message(lambda: Grid(size=size, dp=1, rank=0)) == \
        f"size={size!r} is invalid: the canonical grid size G must be an integer >= 1"


def warned_at(call, line: int, fn) -> str:
    """`call()` warns once, at the caller's line: `line` of this file, or, where `fn` runs inside a
    wrapper (a mutation run wraps functions in mutmut's trampoline), where that wrapper calls what it
    wraps, the place a stacklevel=2 warning of every wrapped function names (check_global_batch's)."""
    with pytest.warns(DeprecationWarning) as seen:
        call()
    (w,) = seen
    if fn.__code__.co_filename == grid_module.__file__:
        assert (w.filename, w.lineno) == (__file__, line)
    else:
        with pytest.warns(DeprecationWarning) as probe:
            check_global_batch(4, 4)
        assert (w.filename, w.lineno) == (probe[0].filename, probe[0].lineno)
    return str(w.message)


def test_grid_accepts_its_old_keyword_and_attribute_with_a_deprecation_warning():
    here = inspect.currentframe().f_lineno
    text = warned_at(lambda: Grid(groups=4, dp=2, rank=1), here + 1, Grid.__init__)
    assert text == "Grid(groups=) is renamed Grid(size=) (the canonical grid size G); groups= is removed in 0.3.0"
    old = Grid(size=4, dp=2, rank=1)
    here = inspect.currentframe().f_lineno
    text = warned_at(lambda: old.groups, here + 1, Grid.groups.fget)
    assert text == "Grid.groups is renamed Grid.size (the canonical grid size G); groups is removed in 0.3.0"
    with pytest.raises(TypeError) as e:
        Grid(size=4, groups=4, dp=2, rank=1)
    assert str(e.value) == "give size= (the canonical grid size G) only: groups= is its old name"


@pytest.mark.parametrize("rank", [-1, 2, 3])
def test_grid_refuses_a_rank_out_of_range(rank):
    assert message(lambda: Grid(size=4, dp=2, rank=rank)) == f"rank={rank} is out of range for dp=2"


def test_grid_accepts_the_edges():
    g = Grid(size=1, dp=1, rank=0)
    assert (g.groups_per_rank, list(g.covered_groups()), g.owner(0)) == (1, [0], 0)
    g = Grid(size=6, dp=3, rank=2)
    assert (g.groups_per_rank, list(g.covered_groups())) == (2, [4, 5])
    assert g.owner(np.arange(6)).tolist() == [0, 0, 1, 1, 2, 2]
    assert message(lambda: Grid(size=6, dp=4, rank=0)) == \
        "canonical grid G=6 is not a multiple of dp=4: G must be the lcm of all module DP sizes"


def test_canonical_grid_refuses_bad_sizes():
    assert message(lambda: canonical_grid([])) == \
        "dp_sizes is empty: give the DP size of every module, e.g. [2, 4]"
    for d in (0, -1, 2.0, "2"):
        assert message(lambda: canonical_grid([2, d])) == \
            f"dp size {d!r} is invalid: every module's DP size must be an integer >= 1"
    assert canonical_grid(iter([4, 6])) == 12 and canonical_grid([1]) == 1 and canonical_grid((3, 1, 2)) == 6


@pytest.mark.parametrize("batch", [0, -4, 6, 3])
def test_micro_batch_size_must_be_a_positive_multiple(batch):
    assert message(lambda: check_micro_batch_size(batch, 4)) == (
        f"micro_batch_size={batch} (B, the global micro-batch) is not a positive multiple of the canonical grid "
        "G=4: choose B as a multiple of lcm(DP sizes)")


def test_micro_batch_size_accepts_multiples():
    for batch in (1, 4, 8):
        check_micro_batch_size(batch, 1)
    check_micro_batch_size(4, 4)
    check_micro_batch_size(12, 4)


def test_the_old_name_warns_and_still_checks():
    here = inspect.currentframe().f_lineno
    text = warned_at(lambda: check_global_batch(12, 4), here + 1, check_global_batch)
    assert text == "check_global_batch is deprecated: use check_micro_batch_size"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match="micro_batch_size=6"):
        check_global_batch(6, 4)


# --- cost model: weights --------------------------------------------------------------------------

@pytest.mark.parametrize("name", WEIGHTS)
@pytest.mark.parametrize("bad", [-1.0, -1e-300, math.inf, -math.inf, math.nan, "1", None, [1.0]])
def test_every_weight_must_be_a_finite_number_at_least_zero(name, bad):
    kw = {name: bad}
    if name != "encoder_weight":
        kw["encoder_weight"] = 1.0
    assert message(lambda: CostModel(**kw)) == f"{name}={bad!r} is invalid: cost weights must be finite and >= 0"


@pytest.mark.parametrize("name", WEIGHTS)
def test_any_one_positive_weight_is_enough(name):
    zeros = dict.fromkeys(WEIGHTS, 0.0)
    m = CostModel(**{**zeros, name: 2})
    assert getattr(m, name) == 2
    assert CostModel(**{**zeros, name: 1e-300}) is not None
    assert message(lambda: CostModel(**zeros)) == \
        "encoder_weight=0 and language_weight=0: at least one cost weight must be > 0"
    assert message(lambda: CostModel(**{**zeros, name: 0})) == \
        "encoder_weight=0 and language_weight=0: at least one cost weight must be > 0"


@pytest.mark.parametrize("merge", [0, -1, 2.0, "2", None])
def test_spatial_merge_size_must_be_a_positive_integer(merge):
    assert message(lambda: CostModel(spatial_merge_size=merge)) == \
        f"spatial_merge_size={merge!r} is invalid: must be an integer >= 1"


def test_spatial_merge_size_one_is_valid():
    m = CostModel(spatial_merge_size=1)
    assert m.costs([3, 0], [0, 0]).tolist() == [3.0, 0.0]


# --- cost model: costs ----------------------------------------------------------------------------

def test_costs_need_the_counts_of_their_terms():
    assert message(lambda: CostModel(encoder_weight=0.0, encoder_quadratic_weight=1.0).costs([1], [0])) == \
        "encoder_quadratic_weight > 0 needs square_patches (reorder.batch.counting.square_patches)"
    assert message(lambda: CostModel(encoder_image_weight=2.0).costs([1], [0], [0])) == \
        "encoder_image_weight > 0 needs the per-sample image counts (reorder.batch.counting.token_counts)"
    # a term whose weight is 0 needs nothing
    assert CostModel().costs([1, 2], [5, 5]).tolist() == [4.0, 8.0]


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_each_term_alone_against_the_spec(merge):
    ids = [[7, 7, 5, 9, 7, 7, 7, 5], [5, 9, 7, 5, 5, 5, 5, 5], [5] * 8, [7] * 8]
    mask = [[1, 1, 1, 1, 1, 0, 0, 0], [1] * 8, [0] * 8, [1, 1, 0, 1, 0, 1, 1, 1]]
    for name in WEIGHTS:
        for w in (1.0, 0.5, 3.0):
            m = CostModel(**{**dict.fromkeys(WEIGHTS, 0.0), name: w}, image_token_id=7, vision_start_token_id=9,
                          spatial_merge_size=merge)
            counts, _ = count_samples(m, torch.tensor(ids), torch.tensor(mask), squares=True)
            got = m.costs(counts[0], counts[1], counts[3], counts[2])
            want = [ref.sample_cost(i, a, image_token_id=7, spatial_merge_size=merge, vision_start_token_id=9,
                                    **{**dict.fromkeys(WEIGHTS, 0.0), name: w}) for i, a in zip(ids, mask)]
            assert got.dtype == np.float64 and got.tolist() == want, (name, w)


# --- the quadratic term through the public counting path -----------------------------------------------

IDS = torch.tensor([[7, 7, 7, 7, 5, 5, 5, 5],     # one image of 4 placeholders
                    [7, 7, 5, 7, 7, 5, 5, 5],     # two images of 2: same patches, half the square
                    [9, 5, 5, 9, 5, 5, 5, 5],     # two vision starts, no placeholder
                    [7, 5, 7, 5, 7, 5, 7, 5]])    # four images of 1
MASK = torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0], [1] * 8, [1, 1, 1, 0, 0, 0, 0, 0], [1] * 8])


def spec_counts(merge=2):
    kw = dict(image_token_id=7, spatial_merge_size=merge, vision_start_token_id=9)
    return [[ref.sample_cost(i, a, encoder_weight=ew, language_weight=lw, encoder_quadratic_weight=qw, **kw)
             for i, a in zip(IDS.tolist(), MASK.tolist())]
            for ew, lw, qw in ((1, 0, 0), (0, 1, 0), (0, 0, 1))]


def test_counts_default_squares_follow_the_quadratic_weight():
    patches, real, squares = spec_counts()
    assert squares == [256.0, 128.0, 0.0, 64.0]
    quad = CostModel(encoder_quadratic_weight=1.0, image_token_id=7, vision_start_token_id=9)
    counts, grid = count_samples(quad, IDS, MASK)
    assert counts.dtype == np.int64 and counts.shape == (4, 4) and grid is None
    assert (counts[0] * 4).tolist() == patches and counts[1].tolist() == real and counts[3].tolist() == squares
    linear = CostModel(image_token_id=7, vision_start_token_id=9)
    counts, _ = count_samples(linear, IDS, MASK)
    assert counts[3].tolist() == [0, 0, 0, 0]
    counts, _ = count_samples(linear, IDS, MASK, squares=True)
    assert counts[3].tolist() == squares
    counts, _ = count_samples(quad, IDS, MASK, squares=False)
    assert counts[3].tolist() == [0, 0, 0, 0]


def test_counts_carry_grid_thw_on_the_host_path():
    m = CostModel(encoder_quadratic_weight=1.0, image_token_id=7, vision_start_token_id=9)
    grid = torch.tensor([[1, 4, 4], [1, 2, 2], [1, 2, 2], [2, 6, 8]], dtype=torch.int32)
    counts, g = count_samples(m, IDS, MASK, squares=True, grid_thw=grid)
    assert isinstance(g, np.ndarray) and g.dtype == np.int64 and g.shape == (4, 3)
    assert g.tolist() == grid.tolist()
    assert counts[3].tolist() == spec_counts()[2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.bool,
                                   torch.uint8, torch.int32, torch.int64])
def test_every_mask_dtype_counts_the_same_real_tokens(dtype):
    m = CostModel(language_weight=1.0, image_token_id=7, vision_start_token_id=9)
    counts, _ = count_samples(m, IDS, MASK.to(dtype))
    assert counts[1].tolist() == spec_counts()[1] == [6.0, 8.0, 3.0, 8.0]


def test_the_quadratic_term_changes_the_plan():
    """Samples 0 and 1 have the same patches (16) but one image of 16 against two of 8: with the
    quadratic weight the plan must see the difference (spec costs; LPT, so the plan is the spec's)."""
    patches, _, squares = spec_counts()
    assert patches[0] == patches[1] and squares[0] != squares[1]
    ids = IDS[[0, 1, 2, 3, 0, 1, 2, 3]]
    mask = MASK[[0, 1, 2, 3, 0, 1, 2, 3]]
    kw = dict(image_token_id=7, vision_start_token_id=9)
    plans = {}
    for q in (0.0, 0.25):
        model = CostModel(encoder_quadratic_weight=q, **kw)
        counts, _ = count_samples(model, ids, mask)
        costs = model.costs(counts[0], counts[1], counts[3], counts[2])
        want = [ref.sample_cost(i, a, encoder_weight=1.0, language_weight=0.0, encoder_quadratic_weight=q,
                                spatial_merge_size=2, **kw) for i, a in zip(ids.tolist(), mask.tolist())]
        assert costs.tolist() == want
        plans[q] = plan_orders(costs[None, :], 4, "lpt")[0].tolist()
        assert plans[q] == ref.lpt_order(want, 4)
    assert plans[0.0] != plans[0.25]


@pytest.mark.parametrize("kind", ["int32", "float32", "list", "torch", "uint16"])
def test_costs_are_float64_whatever_array_the_counts_come_in(kind):
    """Counts in any integer or float array give the bits of float64 counts (float64 arithmetic
    throughout: no int32 overflow of real_tokens**2, no float32 rounding)."""
    counts = np.array([[50000, 3, 0, 12345], [50000, 7, 1, 0], [40000, 9, 0, 7], [3, 1, 0, 2]])   # p, r, squares, images
    m = CostModel(encoder_weight=0.3, language_weight=0.1, encoder_quadratic_weight=0.7,
                  language_quadratic_weight=0.3, encoder_image_weight=0.1, spatial_merge_size=3)
    want = m.costs(*counts.astype(np.float64))
    conv = {"int32": lambda a: a.astype(np.int32), "float32": lambda a: a.astype(np.float32), "list": lambda a: a.tolist(),
            "torch": lambda a: torch.from_numpy(a.astype(np.int32)), "uint16": lambda a: (a % 60000).astype(np.uint16)}[kind]
    if kind == "uint16":
        counts = counts % 60000
        want = m.costs(*counts.astype(np.float64))
    got = m.costs(*(conv(c) for c in counts))
    assert got.dtype == np.float64 and got.tolist() == want.tolist()
    # sample 0, term by term in the model's order, in float64
    assert want[0] == 0.3 * (50000 * 9.0) + 0.7 * 40000.0 + 0.1 * 3.0 + 0.1 * 50000.0 + 0.3 * (50000.0 * 50000.0)


def test_token_counts_are_the_first_three_count_rows():
    m = CostModel(language_weight=1.0, encoder_quadratic_weight=1.0, image_token_id=7, vision_start_token_id=9)
    got = count_samples(m, IDS, MASK, squares=False)[0][:3]
    patches, real, _ = spec_counts()
    assert isinstance(got, np.ndarray) and got.dtype == np.int64 and got.shape == (3, 4)
    assert (got[0] * 4).tolist() == patches and got[1].tolist() == real
    assert got[2].tolist() == [0, 0, 2, 0]
    p, r, images = token_counts(m, IDS, MASK)
    assert [p.tolist(), r.tolist(), images.tolist()] == got.tolist()
