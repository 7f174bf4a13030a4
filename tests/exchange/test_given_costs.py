"""Per-sample costs and image counts given by the caller: they travel bit for bit in the window
frame, every rank plans from them, a rank without them is a config mismatch, and bad values raise
on every rank."""

import numpy as np
import pytest
import torch

from reorder import CostModel, Grid, ReorderError, WindowExchanger, run_emulated
from reorder.plan.balancers import lpt

COSTS = [0.1, 5.25, 2.0, 4.0]  # natural order over dp 2: rank 0 holds 0, 1; rank 1 holds 2, 3


def _batch(rank):
    ids = torch.zeros(2, 8, dtype=torch.int64)
    ids[:, -1] = torch.tensor([2 * rank, 2 * rank + 1])
    return {"input_ids": ids}


def _run(sample_costs, balancer="lpt"):
    def body(rank, coll):
        ex = WindowExchanger(grid=Grid(size=2, dp=2, rank=rank), micro_batch_size=4, cost=CostModel(),
                             balancer=balancer, collectives=coll, sample_costs=sample_costs(rank))
        (out,), rep = ex.exchange([_batch(rank)])
        return out["input_ids"][:, -1].tolist(), rep.orders[0].tolist(), rep.loads_after.tolist()

    return run_emulated(2, body, return_exceptions=True)


def test_given_costs_drive_the_plan_on_every_rank():
    results = _run(lambda r: (lambda b: np.array(COSTS[2 * r:2 * r + 2])))
    want = lpt(np.array(COSTS), 2).tolist()
    assert [res[1] for res in results] == [want, want]
    assert results[0][0] + results[1][0] == want  # rank 0 then rank 1 hold the canonical order
    assert results[0][2] == [[5.25 + 0.1, 2.0 + 4.0]] or results[0][2][0][0] == pytest.approx(
        sum(COSTS[i] for i in want[:2]))


def test_a_rank_without_given_costs_is_a_config_mismatch():
    results = _run(lambda r: (lambda b: np.array([1.0, 2.0])) if r == 0 else None)
    assert [str(e) for e in results] == ["config mismatch across the DP group: given_costs is 1 on ranks [0], "
                                         "0 on ranks [1]"] * 2


@pytest.mark.parametrize("bad,text", [([1.0, float("nan")], "sample 1 the value nan"),
                                      ([1.0, -2.0], "sample 1 the value -2.0"),
                                      ([1.0], "expected 2 numbers, one per sample")])
def test_bad_given_costs_raise_on_every_rank(bad, text):
    results = _run(lambda r: (lambda b: np.array(bad)) if r == 1 else (lambda b: np.array([1.0, 2.0])))
    assert all(isinstance(e, ReorderError) and "rank 1: sample_costs" in str(e) and text in str(e)
               for e in results), results
