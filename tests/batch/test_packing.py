"""Byte-exact take (a local reorder or selection through the move list and the torch executor):
every dtype, empty tensors, text-only and multi-image samples, MRoPE, lists."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reorder.cli.synthetic import take
from reorder.cli import synthetic as syn
from reorder.batch.layout import LayoutError, Shard, describe, rebuild
from spec.samples import per_sample_bytes

DTYPES = [d for d in (getattr(torch, n, None) for n in (
    "float16 bfloat16 float32 float64 complex32 complex64 complex128 int8 int16 int32 int64 uint8 uint16 uint32 "
    "uint64 bool float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz float8_e8m0fnu").split()) if d is not None]


def random_of(dtype, shape, gen):
    """Random bit patterns of any dtype (NaNs, infs, subnormals included)."""
    raw = torch.randint(0, 256, (*shape, dtype.itemsize), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).squeeze(-1) if dtype != torch.bool else raw.squeeze(-1) % 2 == 1


def pack_roundtrip(batch, index):
    b = batch["input_ids"].shape[0]
    layout, shard = describe(batch, b, vision_start_token_id=syn.VISION_START)
    return rebuild(batch, layout, take(layout, [shard], index))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_roundtrips_bit_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(0, 9, (5, 6), generator=gen), "x": random_of(dtype, (5, 3, 2), gen),
             "pos": random_of(dtype, (5,), gen), "position_ids": random_of(dtype, (3, 5, 6), gen)}
    out = pack_roundtrip(batch, [4, 0, 2])
    want = per_sample_bytes(batch, vision_start_token_id=syn.VISION_START)
    got = per_sample_bytes(out, vision_start_token_id=syn.VISION_START)
    assert got == [want[i] for i in [4, 0, 2]]
    assert out["x"].dtype == dtype and out["position_ids"].shape == (3, 3, 6)


def test_empty_tensors_and_zero_samples():
    batch = {"input_ids": torch.zeros(3, 4, dtype=torch.long), "e": torch.zeros(3, 0, dtype=torch.float32)}
    out = pack_roundtrip(batch, [2, 1])
    assert out["e"].shape == (2, 0)
    out = pack_roundtrip(batch, [])
    assert out["input_ids"].shape == (0, 4)


@given(st.integers(0, 2**31), st.integers(1, 8), st.data())
def test_vision_text_only_multi_image_mrope_lists(seed, b, data):
    rng = np.random.default_rng(seed)
    batch = syn.make_global_batch(rng, b, 256, features=5, text_only=0.3, mix="small")
    batch["note"] = [f"s{i}" * (i % 3) for i in range(b)]  # per-sample list entries of varying size
    batch["step"] = torch.tensor(7)  # global metadata
    index = data.draw(st.lists(st.integers(0, b - 1), max_size=2 * b))
    out = pack_roundtrip(batch, index)
    want = per_sample_bytes(batch, vision_start_token_id=syn.VISION_START)
    assert per_sample_bytes(out, vision_start_token_id=syn.VISION_START) == [want[i] for i in index]
    assert out["step"] is batch["step"]


def test_take_concatenates_shards_in_order():
    rng = np.random.default_rng(1)
    a, b = (syn.make_global_batch(rng, 3, 128, features=4, mix="small", first_id=k * 10) for k in range(2))
    la, sa = describe(a, 3, vision_start_token_id=syn.VISION_START)
    _, sb = describe(b, 3, vision_start_token_id=syn.VISION_START)
    out = rebuild(a, la, take(la, [sa, sb], [5, 0, 3]))
    assert out["sample_id"].tolist() == [12, 0, 10]
    want = per_sample_bytes(a, vision_start_token_id=syn.VISION_START) + \
        per_sample_bytes(b, vision_start_token_id=syn.VISION_START)
    assert per_sample_bytes(out, vision_start_token_id=syn.VISION_START) == [want[i] for i in [5, 0, 3]]


def test_layout_errors_name_the_field():
    rng = np.random.default_rng(2)
    batch = syn.make_global_batch(rng, 4, 256, features=4, mix="small", text_only=0.0)
    batch["modality_inputs"]["images"]["vit"]["grid_thw"] = batch["modality_inputs"]["images"]["vit"]["grid_thw"][1:]
    with pytest.raises(LayoutError, match="grid_thw' has .* images but input_ids holds .* vision-start tokens"):
        describe(batch, 4, vision_start_token_id=syn.VISION_START)
    with pytest.raises(LayoutError, match="field 'labels' has shape \\(3, 5\\): expected 4 samples along dim 0"):
        describe({"input_ids": torch.zeros(4, 5, dtype=torch.long), "labels": torch.zeros(3, 5)}, 4,
                 vision_start_token_id=1)
    with pytest.raises(LayoutError, match="'input_ids' must be a \\[B, S\\] tensor"):
        describe({"labels": torch.zeros(4, 5)}, 4, vision_start_token_id=1)


def test_take_returns_contiguous_fields():
    """A selection that is one run inside a larger shard (e.g. a rank's share) is still a contiguous
    tensor per field, MRoPE position_ids [3, B, S] (batch dim 1) included."""
    g = syn.make_global_batch(np.random.default_rng(5), 8, 64, features=4)
    layout, shard = describe(g, 8, vision_start_token_id=syn.VISION_START)
    for index in (np.arange(4, 8), np.array([5, 6, 0, 1])):
        out = take(layout, [shard], index)
        for t in list(out.dense.values()) + list(out.ragged.values()):
            assert t.is_contiguous(), t.shape
        assert out.dense[("position_ids",)].equal(g["position_ids"][:, index])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_take_across_shards_is_bit_exact_for_every_dtype(dtype):
    """Every dtype, vision rows included, through one shard and through the concatenation of two."""
    gen = torch.Generator().manual_seed(1)
    batch = syn.make_global_batch(np.random.default_rng(3), 5, 64, features=3, mix="small", text_only=0.2)
    batch.update(x=random_of(dtype, (5, 3, 2), gen), pos=random_of(dtype, (5,), gen),
                 position_ids=random_of(dtype, (3, 5, 6), gen))
    vit = batch["modality_inputs"]["images"]["vit"]
    vit["hidden_states"] = random_of(dtype, tuple(vit["hidden_states"].shape), gen)
    layout, shard = describe(batch, 5, vision_start_token_id=syn.VISION_START)
    want = per_sample_bytes(batch, vision_start_token_id=syn.VISION_START)
    empty = Shard(n=0, dense={f.path: shard.dense[f.path][:0] if f.batch_dim == 0 else shard.dense[f.path][:, :0]
                              for f in layout.dense},
                  ragged={f.path: shard.ragged[f.path][:0] for f in layout.ragged},
                  row_counts=shard.row_counts[:0], image_counts=shard.image_counts[:0])
    for index in ([4, 0, 2], [1, 1, 3, 0], [], [0, 1, 2, 3, 4][::-1]):
        for shards in ([shard], [empty, shard, empty]):
            out = rebuild(batch, layout, take(layout, shards, index))
            assert per_sample_bytes(out, vision_start_token_id=syn.VISION_START) == [want[i] for i in index]
            assert out["x"].dtype == dtype and out["position_ids"].shape == (3, len(index), 6)
