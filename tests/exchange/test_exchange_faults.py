"""Bad input and mismatched config end in the same ReorderError on every rank, never in a dead
process: config that sizes the metadata (window_size, global micro-batch) differing across the DP
group, on emulated and real Gloo ranks, synchronous and with overlap; an extra per-image field on a
rank whose share holds no image; grid_thw components < 1."""

import os

import pytest
import torch

from reorder import CostModel, Grid, ReorderError, WindowExchanger, run_emulated
from reorder.cli.processes import run_processes
from reorder.cli import synthetic as syn

import faults

COST = CostModel()
MISMATCHES = {  # field -> (rank 0's value, rank 1's value)
    "window_size": (2, 1),
    "micro_batch_size": (4, 8),
}


def _exchanger(field, rank, collectives):
    return _configured({"window_size": 1, "micro_batch_size": 4, field: MISMATCHES[field][rank]}, rank, collectives)


def _configured(cfg, rank, collectives):
    cfg = {"window_size": 1, "micro_batch_size": 4, **cfg}
    ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=rank), cost=COST, collectives=collectives, **cfg)
    return ex, {"input_ids": torch.zeros(cfg["micro_batch_size"] // 2, 8, dtype=torch.int64)}


def _expected(field):
    a, b = MISMATCHES[field]
    return f"config mismatch across the DP group: {field} is {a!r} on ranks [0], {b!r} on ranks [1]"


@pytest.mark.parametrize("field", sorted(MISMATCHES))
def test_config_that_sizes_the_metadata_differs_emulated(field):
    def body(rank, coll):
        ex, batch = _exchanger(field, rank, coll)
        return ex.exchange([batch])

    results = run_emulated(2, body, return_exceptions=True)
    assert [type(r) for r in results] == [ReorderError, ReorderError], results
    assert [str(r) for r in results] == [_expected(field)] * 2


def _gloo_rank(rank, world, config, overlap, outdir):
    import torch.distributed as dist

    from reorder.exchange.dist import TorchCollectives
    from reorder.runtime.buffer import ReorderingBuffer

    ex, batch = _configured(config.get(rank, {}), rank, TorchCollectives(dist.group.WORLD, dist.group.WORLD,
                                                                         timeout=30))
    try:
        if overlap:
            with ReorderingBuffer(iter([batch]), ex, overlap=True) as buf:
                list(buf)
        else:
            ex.exchange([batch])
        text = None
    except ReorderError as e:
        text = f"ReorderError: {e}"
    with open(os.path.join(outdir, f"rank{rank}"), "w") as f:
        f.write(text or "")


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("case", faults.cases("gloo_config"), ids=faults.name)
def test_config_that_sizes_the_metadata_differs_on_gloo(case, overlap, tmp_path):
    """Ranks configured differently in what sizes the window frame (real Gloo processes, which die
    in C++ on a mismatched collective): every rank raises the same ReorderError, none dies."""
    run_processes(_gloo_rank, 2, (case.params["config"], overlap, str(tmp_path)), timeout=60, pg_timeout=30)
    (seen,) = case.sees
    for r in range(2):
        seen.check((tmp_path / f"rank{r}").read_text() or None)


def _image_sizes_batch(rank):
    """Global batch of 2: sample 0 has one 4x4 image (4 placeholders after 2x2 merge), sample 1 none."""
    ids = torch.zeros(1, 16, dtype=torch.int64)
    if rank == 0:
        ids[0, 0] = syn.VISION_START
        ids[0, 1:5] = syn.IMAGE_TOKEN
        enc = {"hidden_states": torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3),
               "grid_thw": torch.tensor([[1, 4, 4]]), "image_sizes": torch.tensor([[64, 64]])}
    else:
        enc = {"hidden_states": torch.zeros(0, 3), "grid_thw": torch.zeros(0, 3, dtype=torch.int64),
               "image_sizes": torch.zeros(0, 2, dtype=torch.int64)}
    ids[0, -1] = 7 + rank  # tell the samples apart
    return {"input_ids": ids, "modality_inputs": {"images": {"vit": enc}}}


def test_extra_per_image_field_on_a_rank_without_images_is_reordered():
    # costs [4, 0] on two groups: already balanced; costs of a window of two identical slots move nothing.
    # Swap the shares so the image sits on rank 1's natural half and the balancer keeps it there.
    def body(rank, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=rank), micro_batch_size=2, cost=COST, collectives=coll)
        return ex.exchange([_image_sizes_batch(rank)])

    results = run_emulated(2, body)
    (out0,), _ = results[0]
    (out1,), _ = results[1]
    enc0, enc1 = out0["modality_inputs"]["images"]["vit"], out1["modality_inputs"]["images"]["vit"]
    assert torch.equal(enc0["image_sizes"], torch.tensor([[64, 64]]))
    assert enc1["image_sizes"].shape == (0, 2)
    assert torch.equal(enc0["hidden_states"], torch.arange(48, dtype=torch.float32).reshape(16, 3))


def test_extra_per_image_field_moves_with_its_sample():
    """Three samples on dp 3: a rank without images receives an image and its image_sizes row."""
    def batch(rank):
        ids = torch.zeros(1, 40, dtype=torch.int64)
        ids[0, -1] = rank
        if rank == 0:  # two images, 16 placeholders -> both heavy samples start on rank 0's share
            ids[0, 0], ids[0, 1:17] = syn.VISION_START, syn.IMAGE_TOKEN
            return {"input_ids": ids, "modality_inputs": {"images": {"vit": {
                "hidden_states": torch.arange(64 * 2, dtype=torch.bfloat16).reshape(64, 2),
                "grid_thw": torch.tensor([[1, 8, 8]]), "image_sizes": torch.tensor([[128, 128]])}}}}
        return {"input_ids": ids, "modality_inputs": {"images": {"vit": {
            "hidden_states": torch.zeros(0, 2, dtype=torch.bfloat16), "grid_thw": torch.zeros(0, 3, dtype=torch.int64),
            "image_sizes": torch.zeros(0, 2, dtype=torch.int64)}}}}

    def body(rank, coll):
        ex = WindowExchanger(grid=Grid(size=3, dp=3, rank=rank), micro_batch_size=3, cost=COST, collectives=coll,
                             balancer="lpt")
        (out,), _ = ex.exchange([batch(rank)])
        return out

    outs = run_emulated(3, body)
    holders = [r for r, o in enumerate(outs) if o["modality_inputs"]["images"]["vit"]["grid_thw"].shape[0]]
    assert len(holders) == 1
    enc = outs[holders[0]]["modality_inputs"]["images"]["vit"]
    assert torch.equal(enc["image_sizes"], torch.tensor([[128, 128]]))
    assert enc["hidden_states"].shape == (64, 2)


@pytest.mark.parametrize("thw,placeholders", [([1, -4, -4], 4), ([1, 4, -4], 4), ([0, 4, 4], 4), ([-1, -1, 4], 1)])
def test_grid_thw_components_must_be_at_least_one(thw, placeholders):
    ids = torch.zeros(2, 16, dtype=torch.int64)
    ids[1, 0], ids[1, 1:1 + placeholders] = syn.VISION_START, syn.IMAGE_TOKEN
    rows = abs(thw[0] * thw[1] * thw[2])
    batch = {"input_ids": ids, "modality_inputs": {"images": {"vit": {
        "hidden_states": torch.zeros(rows, 3), "grid_thw": torch.tensor([thw])}}}}
    ex = WindowExchanger(grid=Grid(size=1, dp=1, rank=0), micro_batch_size=2, cost=COST)
    with pytest.raises(ReorderError) as info:
        ex.exchange([batch])
    assert (f"micro-batch 0 sample 1 image 0: grid_thw {thw} has a component < 1: every t, h, w must be "
            "an integer >= 1") in str(info.value)
