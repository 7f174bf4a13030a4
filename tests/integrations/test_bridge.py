"""reorder.integrations.bridge: Megatron-Bridge's reorder-buffer interface on this library.

Emulated ranks (threads) and forked Gloo processes: vision dp 2 + language dp 4 and dp-1 modules,
windows 1-3 with short tails, text-only and multi-image samples, every dtype, the vectorized cost
path against the per-sample one, custom costs, and the behaviours upstream publishes (LPT orders,
dp-1 window serving, zero spread, ValueErrors, the worker thread ending with the source)."""

from __future__ import annotations

import functools
import re
import time

import numpy as np
import pytest
import torch

from reorder import ReorderError, run_emulated
from reorder.cli import synthetic as syn
from reorder.cli.processes import run_processes
from reorder.integrations import bridge as br
from spec.reference import lpt_order

VISION = ("input_ids", "position_ids", "sample_id", "names", "modality_inputs")
LANGUAGE = ("input_ids", "labels", "loss_mask", "attention_mask", "position_ids", "sample_id", "names")
COST = functools.partial(br.sample_cost, encoder_cost_weight=1.0, image_token_id=syn.IMAGE_TOKEN, square_merge_size=4)


def _global_batches(n, batch, *, seed=0, dtype=torch.bfloat16, max_images=3, text_only=0.3):
    rng = np.random.default_rng(seed)
    out = []
    for k in range(n):
        g = syn.make_global_batch(rng, batch, 192, features=4, dtype=dtype, mix="small", max_images=max_images,
                                  text_only=text_only, first_id=k * batch)
        g["names"] = [f"s{int(i)}" for i in g["sample_id"]]
        g["step"] = k  # global metadata: passed through
        out.append(g)
    return out


def _images(g):
    """Images per sample: vision-start tokens (77 where a test marks images with another token)."""
    return ((g["input_ids"] == syn.VISION_START) | (g["input_ids"] == 77)).sum(dim=1)


def _costs(g, language_weight=0.0):
    patches = (g["input_ids"] == syn.IMAGE_TOKEN).sum(dim=1).double() * 4
    return (patches + language_weight * g["attention_mask"].sum(dim=1).double()).tolist() if language_weight \
        else patches.tolist()


def _expected(g, idx, fields):
    """Samples `idx` of global batch g, built by plain indexing (independent of the library)."""
    idx = list(idx)
    out = {}
    for k in fields:
        v = g[k]
        if k == "modality_inputs":
            hs, grid = v["images"]["vit"]["hidden_states"], v["images"]["vit"]["grid_thw"]
            n_img = _images(g).tolist()
            img0 = np.concatenate([[0], np.cumsum(n_img)])
            rows = np.concatenate([[0], np.cumsum(grid.prod(dim=1).numpy())])
            hs_parts = [hs[rows[img0[i]]:rows[img0[i + 1]]] for i in idx]
            grid_parts = [grid[img0[i]:img0[i + 1]] for i in idx]
            out[k] = {"images": {"vit": {"hidden_states": torch.cat(hs_parts), "grid_thw": torch.cat(grid_parts)}}}
        elif k == "position_ids":
            out[k] = v[:, idx]
        elif isinstance(v, list):
            out[k] = [v[i] for i in idx]
        else:
            out[k] = v[idx]
    return out


def _share(g, dp, r, fields):
    b = g["input_ids"].shape[0] // dp
    share = _expected(g, range(r * b, (r + 1) * b), fields)
    share["step"] = g["step"]
    share["attention_mask_none"] = None
    return share


def _assert_same(got, want, path=""):
    assert set(want) <= set(got), (path, set(want) - set(got))
    for k, v in want.items():
        if isinstance(v, dict):
            _assert_same(got[k], v, f"{path}/{k}")
        elif isinstance(v, torch.Tensor):
            g = got[k]
            assert g.dtype == v.dtype and g.shape == v.shape, (path, k, g.dtype, v.dtype, g.shape, v.shape)
            assert torch.equal(g.reshape(-1).view(torch.uint8), v.contiguous().reshape(-1).view(torch.uint8)), (path, k)
        else:
            assert got[k] == v, (path, k)


def _run_module(globals_, dp, groups, fields, *, window=1, cost_of=COST, image_count_of=br.image_count_of,
                overlap=False, balancer="lpt", return_exceptions=False, share=_share, verify=0):
    def rank_fn(r, coll):
        buf = br.ReorderingBuffer((share(g, dp, r, fields) for g in globals_), dp_rank=r, dp_size=dp,
                                  n_groups=groups, cost_of=cost_of, dp_group_gloo=coll, dp_group_nccl=coll,
                                  overlap=overlap, image_count_of=image_count_of, window_size=window,
                                  balancer=balancer, verify=verify)
        out = list(buf)
        return out, buf
    return run_emulated(dp, rank_fn, timeout=30, return_exceptions=return_exceptions)


def _check_module(globals_, results, dp, groups, fields, language_weight=0.0):
    for r, (out, _) in enumerate(results):
        assert len(out) == len(globals_)
        for g, mb in zip(globals_, out):
            order = lpt_order(_costs(g, language_weight), groups)
            b = len(order) // dp
            mine = order[r * b:(r + 1) * b]
            assert mb["sample_id"].tolist() == [int(g["sample_id"][i]) for i in mine]
            _assert_same(mb, _expected(g, mine, fields))
            assert mb["step"] == g["step"] and mb["attention_mask_none"] is None


# ---- pure functions ---------------------------------------------------------------------------

def test_sample_cost_counts_placeholders_times_square_merge():
    img = 99
    flat = {"input_ids": torch.tensor([[1, img, img, img, 2, 0]])}
    assert br.sample_cost(flat, encoder_cost_weight=1.0, image_token_id=img, square_merge_size=4) == 12
    assert br.sample_cost(flat, encoder_cost_weight=2.5, image_token_id=img, square_merge_size=4) == 30.0
    # without image_token_id: the sum of prod(grid_thw) of the sample's images
    flat["modality_inputs.images.vit.grid_thw"] = torch.tensor([[1, 4, 2], [1, 2, 2]])
    assert br.sample_cost(flat, encoder_cost_weight=1.0) == 12
    assert br.sample_cost({"input_ids": flat["input_ids"]}, encoder_cost_weight=1.0) == 0


def test_sample_cost_language_term_counts_the_attention_mask():
    flat = {"input_ids": torch.tensor([[5, 0, 7, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 1, 0, 0]])}
    assert br.sample_cost(flat, encoder_cost_weight=1.0, language_cost_weight=1.0) == 3  # pad id 0 still counts
    assert br.sample_cost(flat, encoder_cost_weight=0.0, language_cost_weight=0.5, image_token_id=5) == 1.5
    with pytest.raises(ValueError, match="attention_mask"):
        br.sample_cost({"input_ids": flat["input_ids"]}, encoder_cost_weight=1.0, language_cost_weight=1.0)
    assert br.sample_cost({"input_ids": flat["input_ids"]}, encoder_cost_weight=1.0) == 0


def test_canonical_grid_size_and_covered_groups():
    assert br.canonical_grid_size([2, 4]) == 4
    assert br.canonical_grid_size([2, 3]) == 6
    assert br.canonical_grid_size((1, 1)) == 1
    for bad in ([], [0], [None, 2], [2, -1], [1.5]):
        with pytest.raises(ValueError, match="module DP sizes must be positive integers"):
            br.canonical_grid_size(bad)
    assert br.covered_canonical_groups(1, 2, 6) == [3, 4, 5]
    with pytest.raises(ValueError, match="not divisible"):
        br.covered_canonical_groups(0, 4, 6)


def test_image_count_of_counts_vision_start_tokens():
    vs = br.QWEN35_VISION_START_TOKEN_ID
    ids = torch.tensor([[vs, 5, vs, 6], [1, 2, 3, 4], [vs, 9, 9, 9]])
    assert br.image_count_of({"input_ids": ids}).tolist() == [2, 0, 1]
    assert br.image_count_of({"input_ids": ids}).dtype == torch.int64
    assert functools.partial(br.image_count_of, vision_start_token_id=9)({"input_ids": ids}).tolist() == [0, 0, 3]


def test_partials_that_run_vectorized():
    assert br._vectorized_cost(COST) is not None
    cm = br._vectorized_cost(functools.partial(br.sample_cost, encoder_cost_weight=2.0, language_cost_weight=0.5,
                                               image_token_id=7, square_merge_size=9))
    assert (cm.encoder_weight, cm.language_weight, cm.image_token_id, cm.spatial_merge_size) == (2.0, 0.5, 7, 3)

    def sample_cost(flat, **kw):  # Megatron-Bridge's own function, by module and name
        return 0.0
    sample_cost.__module__ = "megatron.bridge.data.megatron_mimo.reorder_buffer"
    assert br._vectorized_cost(functools.partial(sample_cost, encoder_cost_weight=1.0, image_token_id=3)) is not None
    per_sample = [
        functools.partial(br.sample_cost, encoder_cost_weight=1.0),  # grid_thw fallback
        functools.partial(br.sample_cost, encoder_cost_weight=1.0, image_token_id=3, square_merge_size=2),
        functools.partial(br.sample_cost, encoder_cost_weight=-1.0, image_token_id=3),
        functools.partial(br.sample_cost, encoder_cost_weight=0.0, image_token_id=3),
        functools.partial(br.sample_cost, encoder_cost_weight=1.0, image_token_id=3, pad_token_id=0),
        functools.partial(br.sample_cost, {}, encoder_cost_weight=1.0, image_token_id=3),
        lambda f: 0.0,
    ]
    assert [br._vectorized_cost(c) for c in per_sample] == [None] * len(per_sample)


# ---- upstream's published behaviours (dp 1, no communication) ---------------------------------

def _vision_batch(costs, first=0):
    b = len(costs)
    return {"input_ids": torch.arange(first, first + b).view(b, 1),
            "sample_ids": [f"s{first + i}" for i in range(b)],
            "modality_inputs": {"images": {"vit": {"hidden_states": torch.arange(2.0 * b).view(b, 2) + 100 * first,
                                                   "grid_thw": torch.ones(b, 3, dtype=torch.int64)}}}}


def test_lpt_order_of_upstream_example():
    costs = [1.0, 5.0, 2.0, 4.0]  # LPT over 2 groups: [1, 0] and [3, 2]
    buf = br.ReorderingBuffer(iter([_vision_batch(costs)]), dp_rank=0, dp_size=1, n_groups=2,
                              cost_of=lambda f: costs[int(f["input_ids"].item())], dp_group_gloo=None,
                              dp_group_nccl=None, image_count_of=lambda b: torch.ones(4, dtype=torch.long))
    (out,) = list(buf)
    assert out["input_ids"].view(-1).tolist() == [1, 0, 3, 2]
    assert out["sample_ids"] == ["s1", "s0", "s3", "s2"]
    assert out["modality_inputs"]["images"]["vit"]["hidden_states"].tolist() == [[2.0, 3.0], [0.0, 1.0], [6.0, 7.0],
                                                                               [4.0, 5.0]]


def test_dp1_buffer_serves_a_window_in_canonical_order():
    costs = [1.0, 5.0, 2.0, 4.0]
    batches = [{"input_ids": (torch.arange(4) + 10 * s).view(4, 1)} for s in range(2)]
    buf = br.ReorderingBuffer(iter(batches), dp_rank=0, dp_size=1, n_groups=2,
                              cost_of=lambda f: costs[int(f["input_ids"].item()) % 10], dp_group_gloo=None,
                              dp_group_nccl=None, overlap=True, window_size=2)
    assert [b["input_ids"].view(-1).tolist() for b in buf] == [[1, 0, 3, 2], [11, 10, 13, 12]]
    assert buf._thread is None  # dp 1: no worker
    assert [r.slots for r in buf.reports] == [2]


def test_grouped_heavies_get_zero_spread():
    costs = [10.0, 10.0, 10.0, 1.0, 1.0, 1.0]
    buf = br.ReorderingBuffer(iter([{"input_ids": torch.arange(6).view(6, 1)}]), dp_rank=0, dp_size=1, n_groups=3,
                              cost_of=lambda f: costs[int(f["input_ids"].item())], dp_group_gloo=None,
                              dp_group_nccl=None)
    order = next(buf)["input_ids"].view(-1).tolist()
    totals = [sum(costs[i] for i in order[j:j + 2]) for j in (0, 2, 4)]
    assert totals == [11.0, 11.0, 11.0]
    assert buf.last_report.loads_before.tolist() == [[33.0]]


def test_short_tail_window_is_served_at_its_size():
    items = [{"input_ids": torch.tensor([[i]])} for i in range(7)]
    buf = br.ReorderingBuffer(iter(items), dp_rank=0, dp_size=1, n_groups=1, cost_of=lambda f: 0.0,
                              dp_group_gloo=None, dp_group_nccl=None, overlap=False, window_size=3)
    assert [int(b["input_ids"].item()) for b in buf] == list(range(7))
    assert [r.slots for r in buf.reports] == [3, 3, 1]
    with pytest.raises(StopIteration):
        next(buf)
    empty = br.ReorderingBuffer(iter([]), dp_rank=0, dp_size=1, n_groups=1, cost_of=lambda f: 0.0,
                                dp_group_gloo=None, dp_group_nccl=None)
    assert list(empty) == []


def test_dp1_output_stays_on_the_input_device():
    g = _global_batches(1, 4)[0]
    out = next(br.ReorderingBuffer(iter([_share(g, 1, 0, VISION)]), dp_rank=0, dp_size=1, n_groups=2, cost_of=COST,
                                   dp_group_gloo=None, dp_group_nccl=None, image_count_of=br.image_count_of))
    assert out["input_ids"].device.type == "cpu"
    assert out["sample_id"].tolist() == [int(g["sample_id"][i]) for i in lpt_order(_costs(g), 2)]


# ---- refusals ---------------------------------------------------------------------------------

def _kw(**over):
    kw = dict(dp_rank=0, dp_size=2, n_groups=2, cost_of=lambda f: 0.0, dp_group_gloo=None, dp_group_nccl=None)
    kw.update(over)
    return kw


@pytest.mark.parametrize("w", [0, -1])
def test_window_size_below_one_is_refused(w):
    with pytest.raises(ValueError, match=f"window_size must be >= 1, got {w}"):
        br.ReorderingBuffer(iter([]), **_kw(dp_size=1, window_size=w))


def test_overlap_is_refused_under_a_single_hardware_queue(monkeypatch):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.raises(ValueError, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        br.ReorderingBuffer(iter([]), overlap=True, **_kw())
    assert br.ReorderingBuffer(iter([]), overlap=False, **_kw())._thread is None
    br.ReorderingBuffer(iter([]), overlap=True, **_kw(dp_size=1))  # dp 1: nothing runs beside the training
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS")
    br.ReorderingBuffer(iter([]), overlap=True, **_kw())


def test_other_refusals():
    with pytest.raises(ValueError, match="not a multiple of dp=2"):
        br.ReorderingBuffer(iter([]), **_kw(n_groups=3))
    with pytest.raises(ValueError, match="balancer"):
        br.ReorderingBuffer(iter([]), **_kw(balancer="fastest"))
    buf = br.ReorderingBuffer(iter([{"input_ids": torch.zeros(2, 3, dtype=torch.long)}]), **_kw())
    with pytest.raises(ValueError, match="needs dp_group_gloo and dp_group_nccl"):
        next(buf)
    g = _global_batches(1, 4, max_images=3, text_only=0.0, seed=3)[0]
    assert _images(g).max() > 1
    with pytest.raises(ValueError, match="one image per sample"):
        next(br.ReorderingBuffer(iter([_share(g, 1, 0, VISION)]), **_kw(dp_size=1, cost_of=COST)))
    moved = dict(_share(g, 1, 0, VISION))
    moved["vision"] = moved.pop("modality_inputs")["images"]["vit"]
    with pytest.raises(ValueError, match="must sit inside modality_inputs"):
        next(br.ReorderingBuffer(iter([moved]), **_kw(dp_size=1, cost_of=COST, image_count_of=br.image_count_of)))


def test_surface_matches_upstream():
    buf = br.ReorderingBuffer(iter([]), **_kw(dp_size=1))
    assert iter(buf) is buf and callable(buf.shutdown)
    assert not hasattr(buf, "close") and not hasattr(buf, "__enter__")
    buf.shutdown()  # nothing to stop


# ---- heterogeneous modules on emulated ranks ----------------------------------------------------

@pytest.mark.parametrize("window", [1, 2, 3])
@pytest.mark.parametrize("layout", [(2, 4, 8), (1, 2, 4), (2, 2, 4)], ids=lambda x: f"v{x[0]}l{x[1]}")
def test_modules_agree_and_bytes_travel(layout, window):
    dv, dl, batch = layout
    globals_ = _global_batches(5, batch, seed=window)  # 5 micro-batches: a short last window for W 2 and 3
    counts = torch.cat([_images(g) for g in globals_])
    assert (counts == 0).any() and (counts > 1).any()  # text-only and multi-image samples
    groups = br.canonical_grid_size([dv, dl])
    vision = _run_module(globals_, dv, groups, VISION, window=window)
    language = _run_module(globals_, dl, groups, LANGUAGE, window=window)
    _check_module(globals_, vision, dv, groups, VISION)
    _check_module(globals_, language, dl, groups, LANGUAGE)
    k = dl // dv
    for step in range(len(globals_)):  # vision rank v holds language ranks v*k .. v*k+k-1, in order
        for v in range(dv):
            lang = [int(x) for q in range(v * k, (v + 1) * k) for x in language[q][0][step]["sample_id"]]
            assert vision[v][0][step]["sample_id"].tolist() == lang
    assert [r.slots for r in language[0][1].reports] == [window] * (5 // window) + ([5 % window] if 5 % window else [])
    assert language[0][1]._thread is None  # no CUDA: upstream runs no worker either


@pytest.mark.parametrize("verify", [0, 1, 2])
def test_the_self_check_runs_behind_the_bridge_interface(verify):
    """verify (an addition): the same micro-batches, and the windows and samples the check found
    intact, alike on every rank (every checked window moves samples here; the last is compared at the
    end of the stream)."""
    globals_ = _global_batches(6, 8, seed=3)
    groups = br.canonical_grid_size([2, 4])
    language = _run_module(globals_, 4, groups, LANGUAGE, window=2, verify=verify)
    _check_module(globals_, language, 4, groups, LANGUAGE)
    counts = {(buf.verified_windows, buf.verified_samples) for _, buf in language}
    moved = [bool((r.orders != np.arange(8)).any()) for r in language[0][1].reports]
    checked = sum(m for k, m in enumerate(moved) if verify and k % verify == 0)
    assert counts == {(checked, 2 * 8 * checked)} and (checked > 0) == bool(verify)


@pytest.mark.parametrize("verify", [-1, True, 1.5])
def test_a_bad_verify_is_refused_by_name(verify):
    with pytest.raises(ValueError, match=re.escape(f"verify={verify!r} is invalid")):
        br.ReorderingBuffer(iter([]), **_kw(dp_size=1), verify=verify)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32,
                                   torch.bool, torch.uint8, torch.complex64])
def test_every_dtype_travels_byte_exact(dtype):
    globals_ = _global_batches(2, 8, seed=5)
    for g in globals_:
        hs = g["modality_inputs"]["images"]["vit"]["hidden_states"]
        g["modality_inputs"]["images"]["vit"]["hidden_states"] = (torch.arange(hs.numel()).view(hs.shape) % 7).to(dtype)
        g["extra"] = (torch.arange(8 * 3).view(8, 3) % 5).to(dtype)
    fields = VISION + ("extra",)
    res = _run_module(globals_, 2, 2, fields, window=2)
    _check_module(globals_, res, 2, 2, fields)
    assert res[0][0][0]["extra"].dtype == dtype


def test_vectorized_and_per_sample_costs_give_the_same_plans():
    globals_ = _global_batches(4, 8, seed=7)
    cost = functools.partial(br.sample_cost, encoder_cost_weight=1.0, language_cost_weight=0.25,
                             image_token_id=syn.IMAGE_TOKEN, square_merge_size=4)
    fields = LANGUAGE
    fast = _run_module(globals_, 4, 4, fields, window=2, cost_of=cost)
    slow = _run_module(globals_, 4, 4, fields, window=2, cost_of=lambda f: cost(f))
    assert fast[0][1]._vectorized and not slow[0][1]._vectorized
    for (a, _), (b, _) in zip(fast, slow):
        assert [m["sample_id"].tolist() for m in a] == [m["sample_id"].tolist() for m in b]
    _check_module(globals_, fast, 4, 4, fields, language_weight=0.25)
    got = np.concatenate([r.loads_before.reshape(-1) for r in fast[0][1].reports])
    want = [sum(_costs(g, 0.25)[q * 2:(q + 1) * 2]) for g in globals_ for q in range(4)]
    assert got.tolist() == want


def test_custom_cost_is_honoured_bit_for_bit():
    """Costs no integer count could carry (thirds, a sample's own id) reach every rank's plan exactly."""
    globals_ = _global_batches(3, 8, seed=9)

    def cost_of(flat):
        sid = int(flat["sample_id"].item())
        assert flat["input_ids"].shape[0] == 1 and flat["names"] == [f"s{sid}"]  # upstream's per-sample format
        rows = flat["modality_inputs.images.vit.hidden_states"].shape[0]  # this sample's own patch rows
        assert rows == int(flat["modality_inputs.images.vit.grid_thw"].prod(dim=1).sum())
        return rows / 3 + (sid * 7 % 11) / 7

    res = _run_module(globals_, 2, 4, VISION, window=2, cost_of=cost_of)
    for r, (out, _) in enumerate(res):
        for g, mb in zip(globals_, out):
            rows = [int(x) for x in g["modality_inputs"]["images"]["vit"]["grid_thw"].prod(dim=1)]
            n_img = np.concatenate([[0], np.cumsum(_images(g).tolist())])
            costs = [sum(rows[n_img[i]:n_img[i + 1]]) / 3 + (int(s) * 7 % 11) / 7 for i, s in enumerate(g["sample_id"])]
            assert any(c != round(c) for c in costs)
            order = lpt_order(costs, 4)
            assert mb["sample_id"].tolist() == [int(g["sample_id"][i]) for i in order[r * 4:(r + 1) * 4]]


def test_grid_thw_fallback_cost_where_every_rank_carries_vision():
    globals_ = _global_batches(2, 8, seed=11)
    res = _run_module(globals_, 2, 2, VISION, cost_of=functools.partial(br.sample_cost, encoder_cost_weight=1.0))
    assert not res[0][1]._vectorized
    _check_module(globals_, res, 2, 2, VISION)  # prod(grid_thw) == placeholders x 4 here


def test_balanced_balancer_is_never_worse_than_lpt():
    globals_ = _global_batches(3, 8, seed=13, max_images=4, text_only=0.1)
    lpt = _run_module(globals_, 4, 4, LANGUAGE)
    bal = _run_module(globals_, 4, 4, LANGUAGE, balancer="balanced")
    for a, b in zip(lpt[0][1].reports, bal[0][1].reports):
        assert b.loads_after.max() <= a.loads_after.max()
        assert b.moved_samples <= a.moved_samples


def test_overlap_worker_on_emulated_ranks(monkeypatch):
    monkeypatch.setattr(br, "_output_device", lambda dp: torch.device("cpu") if dp > 1 else None)
    globals_ = _global_batches(5, 8, seed=15)
    res = _run_module(globals_, 2, 4, VISION, window=2, overlap=True)
    _check_module(globals_, res, 2, 4, VISION)
    for _, buf in res:
        assert buf._thread is not None
        buf._thread.join(5.0)
        assert not buf._thread.is_alive()


def test_bad_image_counts_on_one_rank_raise_on_every_rank():
    globals_ = _global_batches(2, 8, seed=17, text_only=0.0)

    def counts(batch):
        c = br.image_count_of(batch)
        return c + 1 if int(batch["sample_id"][0]) == 4 else c  # rank 1, first micro-batch

    res = _run_module(globals_, 2, 2, VISION, image_count_of=counts, return_exceptions=True)
    assert all(isinstance(e, ReorderError) and "mis-sourced" in str(e) for e in res), res


def test_one_rank_ending_early_raises_on_every_rank():
    globals_ = _global_batches(3, 8, seed=19)

    def rank_fn(r, coll):
        src = (_share(g, 2, r, VISION) for g in globals_[:3 if r == 0 else 2])
        return list(br.ReorderingBuffer(src, dp_rank=r, dp_size=2, n_groups=2, cost_of=COST, dp_group_gloo=coll,
                                        dp_group_nccl=coll, image_count_of=br.image_count_of))
    res = run_emulated(2, rank_fn, timeout=30, return_exceptions=True)
    assert all(isinstance(e, ReorderError) and "differs across the DP group" in str(e) for e in res), res


# ---- real torch.distributed (forked Gloo processes) ----------------------------------------------

def _world(rank, world, dv, dl, window, overlap, n):
    """Vision ranks [0, dv), language ranks [dv, dv + dl); main DP groups as Megatron makes them, then
    build_module_dp_process_groups (a world collective) and the buffer; rank 0 gathers what every rank
    received (sample ids per micro-batch) and checks, per rank, the output device."""
    import torch.distributed as dist

    mains = [dist.new_group(list(range(dv))), dist.new_group(list(range(dv, dv + dl)))]
    vision = rank < dv
    main = mains[0] if vision else mains[1]
    dp_rank, dp_size, gloo, data = br.build_module_dp_process_groups(main, overlap=overlap)
    assert (dp_rank, dp_size) == ((rank, dv) if vision else (rank - dv, dl))
    assert (data is main) == (not overlap)
    fields = VISION if vision else LANGUAGE
    globals_ = _global_batches(n, 8, seed=21)
    buf = br.ReorderingBuffer((_share(g, dp_size, dp_rank, fields) for g in globals_), dp_rank=dp_rank,
                              dp_size=dp_size, n_groups=br.canonical_grid_size([dv, dl]), cost_of=COST,
                              dp_group_gloo=gloo if dp_size > 1 else None, dp_group_nccl=data if dp_size > 1 else None,
                              overlap=overlap, image_count_of=br.image_count_of, window_size=window)
    out = list(buf)
    for g, mb in zip(globals_, out):
        order = lpt_order(_costs(g), br.canonical_grid_size([dv, dl]))
        b = 8 // dp_size
        mine = order[dp_rank * b:(dp_rank + 1) * b]
        _assert_same(mb, _expected(g, mine, fields))
    got = [mb["sample_id"].tolist() for mb in out]
    every = [None] * world
    dist.all_gather_object(every, (rank, got, buf._thread is None))
    return every


@pytest.mark.parametrize("layout", [(2, 4, 2, False), (1, 2, 3, True)], ids=["v2l4w2", "v1l2w3-overlap"])
def test_gloo_world(layout):
    dv, dl, window, overlap = layout
    every = run_processes(_world, dv + dl, (dv, dl, window, overlap, 5), timeout=120)
    G = br.canonical_grid_size([dv, dl])
    globals_ = _global_batches(5, 8, seed=21)
    orders = [lpt_order(_costs(g), G) for g in globals_]
    for rank, got, no_thread in every:
        dp, r = (dv, rank) if rank < dv else (dl, rank - dv)
        b = 8 // dp
        want = [[int(g["sample_id"][i]) for i in o[r * b:(r + 1) * b]] for g, o in zip(globals_, orders)]
        assert got == want, rank
        assert no_thread  # CPU: no worker, as upstream


def _worker_ends(rank, world, stop_early):
    """Overlap worker on Gloo (the CUDA requirement lifted): it ends by itself within 5 s once the
    source is exhausted, or at shutdown()."""
    import torch.distributed as dist

    br._output_device = lambda dp: torch.device("cpu") if dp > 1 else None
    main = dist.new_group([0, 1])
    dp_rank, dp_size, gloo, data = br.build_module_dp_process_groups(main, overlap=True)
    globals_ = _global_batches(6, 8, seed=23)
    buf = br.ReorderingBuffer((_share(g, 2, dp_rank, LANGUAGE) for g in globals_), dp_rank=dp_rank, dp_size=2,
                              n_groups=2, cost_of=COST, dp_group_gloo=gloo, dp_group_nccl=data, overlap=True,
                              image_count_of=br.image_count_of)
    first = next(buf)
    thread = buf._thread
    assert thread is not None and thread.is_alive()
    assert buf._inner._ex.collectives.launch_rendezvous  # the overlap thread meets its peers before each launch
    if stop_early:
        buf.shutdown()
        thread.join(5.0)
        return not thread.is_alive(), first["sample_id"].tolist()
    rest = list(buf)
    t0 = time.monotonic()
    thread.join(5.0)
    assert len(rest) == 5
    return not thread.is_alive() and time.monotonic() - t0 < 5.0, first["sample_id"].tolist()


@pytest.mark.parametrize("stop_early", [False, True], ids=["exhausted", "shutdown"])
def test_overlap_worker_is_gone_within_five_seconds(stop_early):
    gone, first = run_processes(_worker_ends, 2, (stop_early,), timeout=120)
    assert gone
    g = _global_batches(1, 8, seed=23)[0]
    assert first == [int(g["sample_id"][i]) for i in lpt_order(_costs(g), 2)[:4]]


def test_image_counts_come_from_image_count_of():
    """The example's own image_count_of closure is honoured (here the data marks images with another
    token than Qwen3.5's vision start), also where the cost runs vectorized."""
    globals_ = _global_batches(2, 8, seed=25)
    for g in globals_:
        g["input_ids"] = torch.where(g["input_ids"] == syn.VISION_START, 77, g["input_ids"])
    res = _run_module(globals_, 2, 2, VISION, image_count_of=lambda b: (b["input_ids"] == 77).sum(dim=1))
    assert res[0][1]._vectorized
    for r, (out, _) in enumerate(res):
        for g, mb in zip(globals_, out):
            mine = lpt_order(_costs(g), 2)[r * 4:(r + 1) * 4]
            assert mb["sample_id"].tolist() == [int(g["sample_id"][i]) for i in mine]
            n_img = (g["input_ids"] == 77).sum(dim=1)
            assert mb["modality_inputs"]["images"]["vit"]["grid_thw"].shape[0] == int(n_img[mine].sum())


# ---- costs and image counts through the exchanger's hooks ----------------------------------------

def test_micro_batches_sharing_one_input_ids_tensor_keep_their_own_costs():
    """Costs belong to the micro-batch they were computed from, even where two micro-batches of a
    window hold the very same input_ids tensor object."""
    ids = torch.zeros(4, 1, dtype=torch.long)
    batches = [{"input_ids": ids, "sample_id": torch.arange(4) + 10 * s} for s in range(2)]
    costs = {0: 1.0, 1: 5.0, 2: 2.0, 3: 4.0, 10: 4.0, 11: 2.0, 12: 5.0, 13: 1.0}
    buf = br.ReorderingBuffer(iter(batches), dp_rank=0, dp_size=1, n_groups=2, window_size=2,
                              cost_of=lambda f: costs[int(f["sample_id"].item())], dp_group_gloo=None,
                              dp_group_nccl=None)
    want = [[10 * s + i for i in lpt_order([costs[10 * s + i] for i in range(4)], 2)] for s in range(2)]
    assert [b["sample_id"].tolist() for b in buf] == want == [[1, 0, 3, 2], [12, 13, 10, 11]]


def _two_ranks(cost_of_rank, image_count_of_rank=lambda r: br.image_count_of, n=2):
    """Vision dp 2 over emulated ranks, each rank with its own cost_of / image_count_of."""
    globals_ = _global_batches(n, 8, seed=27)

    def rank_fn(r, coll):
        return list(br.ReorderingBuffer((_share(g, 2, r, VISION) for g in globals_), dp_rank=r, dp_size=2,
                                        n_groups=2, cost_of=cost_of_rank(r), dp_group_gloo=coll, dp_group_nccl=coll,
                                        image_count_of=image_count_of_rank(r)))
    return run_emulated(2, rank_fn, timeout=30, return_exceptions=True)


def test_a_cost_of_that_raises_on_one_rank_raises_on_every_rank():
    def boom(flat):
        raise RuntimeError("no cost for this sample")

    res = _two_ranks(lambda r: boom if r == 1 else (lambda f: COST(f)))
    assert all(isinstance(e, ReorderError) and "cost_of raised RuntimeError: no cost for this sample" in str(e)
               for e in res), res


@pytest.mark.parametrize("value,text", [(float("nan"), "the value nan"), (-1.0, "the value -1.0"),
                                        (float("inf"), "the value inf")])
def test_a_bad_cost_on_one_rank_raises_on_every_rank(value, text):
    res = _two_ranks(lambda r: (lambda f: value) if r == 1 else (lambda f: COST(f)))
    assert all(isinstance(e, ReorderError) and "sample_costs" in str(e) and text in str(e) for e in res), res


def test_image_counts_of_the_wrong_length_raise_on_every_rank():
    res = _two_ranks(lambda r: COST, lambda r: (lambda b: br.image_count_of(b)[:-1]) if r == 0 else br.image_count_of)
    assert all(isinstance(e, ReorderError) and "image_count_of returned 3 counts for a micro-batch of 4 samples"
               in str(e) for e in res), res


def test_vectorized_on_one_rank_and_per_sample_on_another_is_a_config_mismatch():
    """The cost models agree (the same weights and ids), but only one rank's costs are given per sample."""
    res = _two_ranks(lambda r: COST if r == 0 else (lambda f: COST(f)))
    assert [str(e) for e in res] == ["config mismatch across the DP group: given_costs is 0 on ranks [0], "
                                     "1 on ranks [1]"] * 2


# ---- functional_tests/bridge_cuda.py on the CPU ---------------------------------------------------

def _bridge_cuda(world, *extra):
    """(exit status, the RESULT dict) of functional_tests/bridge_cuda.py at toy sizes on the CPU."""
    import ast
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = [str(root / "functional_tests" / "bridge_cuda.py"), "--device", "cpu", "--seq-len", "256",
              "--features", "8", "--mix", "small", "--micro-batch", "8", "--timeout", "90", *extra]
    launcher = [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                    "--nproc-per-node", str(world)]
    # a new process group of its own (start_new_session): on a timeout the launcher and its workers are
    # ended together, none left behind
    proc = subprocess.Popen(launcher + script, cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-3000:] + err[-3000:]
    return proc.returncode, ast.literal_eval(lines[0][len("RESULT "):])


@pytest.mark.parametrize("world", [1, 2], ids=["dp1", "dp1+dp2-gloo"])
def test_bridge_cuda_script_runs_on_cpu(world):
    """The GPU check's own code paths at toy sizes: dp 1 in one process, and under torchrun a dp-2
    module over Gloo as well (GPUs hidden by --device cpu)."""
    rc, result = _bridge_cuda(world)
    assert rc == 0 and result["ok"] and result["mismatches"] == [], result
    assert result["device"] == f"cpu x{world}"
    assert result["checked"] == 15 * world * (1 if world == 1 else 2)  # 3 cases x 5 micro-batches per rank and dp
    assert len(result["ms_per_micro_batch"]) == (3 if world == 1 else 6)


def test_bridge_cuda_check_catches_a_changed_token():
    """The script's check fails on one changed token of one received micro-batch (in process: the
    subprocess runs above cover the script as a whole)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "functional_tests" / "bridge_cuda.py"
    spec = importlib.util.spec_from_file_location("bridge_cuda", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng = np.random.default_rng(0)
    globals_ = [syn.make_global_batch(rng, 8, 128, features=4, mix="small", first_id=8 * k) for k in range(2)]
    wants = [script.per_sample_bytes(g, vision_start_token_id=syn.VISION_START) for g in globals_]
    costs = {kind: [script.reference_costs(g, kind) for g in globals_] for kind in ("vectorized", "custom")}
    for inject in (False, True):
        bad, checked, _, _ = script.run_case(script.CASES[0], globals_, wants, costs, dp=1, rank=0, groups={},
                                             dev=torch.device("cpu"), inject=inject)
        assert checked == 2
        assert bad == ([f"{script.CASES[0][0]}: micro-batch 0: rank 0's samples differ from reorder off's bytes "
                        "in canonical order"] if inject else [])


def test_bridge_cuda_check_counts_what_the_self_check_found_intact(monkeypatch):
    """With --verify the script requires the buffer's self-check to have found every window that moved
    samples intact: a buffer whose count says otherwise is a mismatch."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "functional_tests" / "bridge_cuda.py"
    spec = importlib.util.spec_from_file_location("bridge_cuda", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rng = np.random.default_rng(0)
    globals_ = [syn.make_global_batch(rng, 8, 128, features=4, mix="large", first_id=8 * k, scale=0.05)
                for k in range(3)]
    wants = [script.per_sample_bytes(g, vision_start_token_id=syn.VISION_START) for g in globals_]
    costs = {kind: [script.reference_costs(g, kind) for g in globals_] for kind in ("vectorized", "custom")}
    run = functools.partial(script.run_case, script.CASES[0], globals_, wants, costs, dp=1, rank=0, groups={},
                            dev=torch.device("cpu"), verify=1)
    bad, checked, _, orders = run()
    moved = sum(o != sorted(o) for o in orders)
    assert bad == [] and checked == 3 and moved > 0
    monkeypatch.setattr(br.ReorderingBuffer, "verified_windows", property(lambda self: 0))
    bad, _, _, _ = run()
    assert bad == [f"{script.CASES[0][0]}: the self-check found 0 windows intact, expected {moved}"]
