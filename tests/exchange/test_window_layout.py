"""A window's micro-batches may differ in what a rank's share tells about a vision field: a share
without images (or with one patch row per image) leaves `pixel_values` "any" (per row or per image
alike), a share with images makes it per row. The window agrees on one layout, as the DP group does;
only real differences (fields, dtypes, shapes) are refused, naming the field first."""

import numpy as np
import pytest

from reorder import CostModel, Grid, ReorderError, WindowExchanger, run_emulated
from reorder.cli import synthetic as syn
from support import harness

COST = CostModel()


def qwen_batch(seed, batch, *, text_only, first_id):
    """A global micro-batch whose vision rows are `pixel_values` (Qwen-VL's name: per row, no
    "hidden_states" hint), every sample text-only or every sample with images."""
    g = syn.make_global_batch(np.random.default_rng(seed), batch, 512, features=4, mix="small", text_only=text_only,
                              first_id=first_id)
    vit = g["modality_inputs"]["images"]["vit"]
    vit["pixel_values"] = vit.pop("hidden_states")
    return g


@pytest.mark.parametrize("dps", [(1, 2), (2, 4), (2, 2)], ids=str)
@pytest.mark.parametrize("text_first", [True, False])
def test_a_window_with_a_text_only_share_and_an_image_share_is_exchanged(dps, text_first):
    flags = [1.0, 0.0] if text_first else [0.0, 1.0]
    batches = [qwen_batch(7 + s, 8, text_only=t, first_id=8 * s) for s, t in enumerate(flags)]
    assert batches[flags.index(0.0)]["modality_inputs"]["images"]["vit"]["grid_thw"].shape[0] > 0
    res = harness.run_window(batches, {"vision": dps[0], "language": dps[1]}, cost=COST, window_size=2)
    harness.check_window(batches, res, cost=COST, balancer="lpt", vision_start_token_id=syn.VISION_START)


def test_a_real_layout_difference_inside_a_window_names_the_field_first():
    a = qwen_batch(1, 4, text_only=0.0, first_id=0)
    b = qwen_batch(2, 4, text_only=0.0, first_id=4)
    vit = b["modality_inputs"]["images"]["vit"]
    vit["pixel_values"] = vit["pixel_values"].float()

    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=1, dp=1, rank=0), micro_batch_size=4, cost=COST, window_size=2)
        return ex.exchange([a, b])

    with pytest.raises(ReorderError) as e:
        run_emulated(1, fn)
    msg = str(e.value)
    assert msg.startswith("reorder failed on rank 0: micro-batch 1 of the window: field "
                          "'modality_inputs/images/vit/pixel_values' is float32 [4] per row, micro-batch 0 has "
                          "bfloat16 [4] per row"), msg


def _two_ranks(shares, error_for_rank=lambda r: None):
    def fn(r, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=r), micro_batch_size=4, cost=COST, window_size=1,
                             collectives=coll)
        return ex.exchange([shares[r]], error_for_rank(r))
    return run_emulated(2, fn, timeout=20, return_exceptions=True)


def test_an_error_longer_than_the_window_frame_reaches_every_rank_whole():
    g = syn.make_global_batch(np.random.default_rng(3), 4, 64, mix="small")
    shares = [syn.rank_share(g, 2, r) for r in range(2)]
    why = "\u00e9" * 2000 + " and then the part that names the field"
    out = _two_ranks(shares, lambda r: OSError(why) if r == 1 else None)
    assert [str(e) for e in out] == [f"reorder failed on rank 1: data source raised OSError: {why}"] * 2


def test_a_layout_mismatch_across_ranks_names_the_field_whatever_the_layout_length():
    g = syn.make_global_batch(np.random.default_rng(4), 4, 64, mix="small")
    for i in range(60):  # a signature of about 3 kB: the differing field lies far past the frame's text
        g[f"an_extra_per_sample_field_{i:02d}"] = g["input_ids"].clone()
    shares = [syn.rank_share(g, 2, r) for r in range(2)]
    shares[1]["an_extra_per_sample_field_59"] = shares[1]["an_extra_per_sample_field_59"].int()
    out = _two_ranks(shares)
    assert [str(e) for e in out] == [
        "batch layout differs across ranks: field 'an_extra_per_sample_field_59' is int64 [64] (batch dim 0) on "
        "ranks [0], int32 [64] (batch dim 0) on ranks [1]; fields, dtypes and per-sample shapes must match (pad to "
        "a fixed sequence length)"] * 2
