"""Synthetic Qwen-VL-like micro-batches (demo, tests, benchmarks): 0-4 images per sample from a
realistic size mix, placeholders = patches / merge^2 inside vision-start/end runs, MRoPE
position_ids [3, B, S], padded to a fixed sequence length; plus helpers to cut a global
micro-batch into a module rank's contiguous share."""

from __future__ import annotations

import numpy as np
import torch

from reorder.batch.blocks import byte_fields, field_buffers, shard_counts, view_block
from reorder.batch.layout import BatchLayout, Shard, describe, rebuild
from reorder.exchange.executors import select_executor
from reorder.plan.counts import SampleCounts
from reorder.plan.moves import take_moves

IMAGE_TOKEN = 248056
VISION_START = 248053
VISION_END = 248054
PAD = 0

# (probability, min side, max side) in merged 2x2 units; rows = (2h) * (2w) patches
SIZE_MIXES = {
    "realistic": [(0.55, 2, 8), (0.35, 8, 20), (0.10, 20, 40)],
    "small": [(1.0, 1, 4)],
    "skewed": [(0.8, 1, 4), (0.2, 16, 32)],
    "large": [(1.0, 16, 64)],  # 1k-16k patches per image
}


def draw_images(rng: np.random.Generator, n: int, mix: str = "realistic", scale: float = 1.0) -> np.ndarray:
    """[n, 3] grid_thw (t=1, h, w in patches, both even) drawn from a named size mix."""
    bands = SIZE_MIXES[mix]
    probs = np.array([p for p, _, _ in bands])
    band = rng.choice(len(bands), size=n, p=probs / probs.sum())
    lo = np.array([b[1] for b in bands])[band]
    hi = np.array([b[2] for b in bands])[band]
    h = np.maximum(1, (rng.integers(lo, hi + 1) * scale).astype(int))
    w = np.maximum(1, (rng.integers(lo, hi + 1) * scale).astype(int))
    return np.stack([np.ones(n, dtype=np.int64), 2 * h, 2 * w], axis=1)


def make_global_batch(rng: np.random.Generator, batch: int, seq_len: int, *, features: int = 8,
                      dtype: torch.dtype = torch.bfloat16, mix: str = "realistic", max_images: int = 4,
                      text_only: float = 0.2, first_id: int = 0, scale: float = 1.0) -> dict:
    """One global micro-batch of `batch` samples padded to `seq_len` tokens (images that do not fit
    are dropped). Every sample carries a unique `sample_id` (first_id + i) for invariant checks."""
    ids = np.full((batch, seq_len), PAD, dtype=np.int64)
    mask = np.zeros((batch, seq_len), dtype=np.int64)
    pos = np.zeros((3, batch, seq_len), dtype=np.int64)
    thw = []  # grid_thw rows of the images kept, sample by sample
    for s in range(batch):
        k = 0 if rng.random() < text_only else int(rng.integers(1, max_images + 1))
        drawn = draw_images(rng, k, mix, scale) if k else np.zeros((0, 3), np.int64)
        text = int(rng.integers(8, max(9, seq_len // 8)))
        toks, kept = list(rng.integers(1000, 150000, size=text)), []
        for img in drawn:
            n_ph = int(img.prod()) // 4
            if len(toks) + n_ph + 2 > seq_len:
                break
            toks += [VISION_START] + [IMAGE_TOKEN] * n_ph + [VISION_END]
            kept.append(img)
        toks = toks[:seq_len]
        ids[s, :len(toks)] = toks
        mask[s, :len(toks)] = 1
        pos[:, s, :len(toks)] = np.arange(len(toks))[None, :] + np.arange(3)[:, None] * (s % 3)
        thw += kept
    grid_thw = np.array(thw, dtype=np.int64).reshape(-1, 3)
    rows = int(grid_thw.prod(axis=1).sum())
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    hidden = torch.randn(rows, features, generator=gen).to(dtype)
    input_ids = torch.from_numpy(ids)
    labels = torch.where((input_ids == IMAGE_TOKEN) | (input_ids == PAD), -100, input_ids)
    return {
        "input_ids": input_ids,
        "labels": labels,
        "loss_mask": torch.from_numpy(mask).float(),
        "attention_mask": torch.from_numpy(mask),
        "position_ids": torch.from_numpy(pos),
        "sample_id": torch.arange(first_id, first_id + batch, dtype=torch.int64),
        "modality_inputs": {"images": {"vit": {"hidden_states": hidden, "grid_thw": torch.from_numpy(grid_thw)}}},
    }


VISION_FIELDS = ("input_ids", "position_ids", "sample_id", "modality_inputs")
LANGUAGE_FIELDS = ("input_ids", "labels", "loss_mask", "attention_mask", "position_ids", "sample_id")
MODULE_FIELDS = {"vision": VISION_FIELDS, "language": LANGUAGE_FIELDS}


def module_fields(name: str, cost) -> tuple | None:
    """Fields a module's ranks load: its own, plus attention_mask when the language cost needs it."""
    fields = MODULE_FIELDS.get(name)
    if fields is not None and cost.language_weight > 0:
        fields = tuple(fields) + ("attention_mask",)
    return fields


def take_samples(batch: dict, index, *, vision_start_token_id: int = VISION_START) -> dict:
    """A micro-batch holding samples `index` of `batch` (vision rows follow their samples)."""
    layout, shard = describe(batch, batch["input_ids"].shape[0], vision_start_token_id=vision_start_token_id)
    return rebuild(batch, layout, take(layout, [shard], index))


def take(layout: BatchLayout, shards: list, index, device: torch.device | str | None = None) -> Shard:
    """Samples `index` (into the concatenation of `shards`; repeats and subsets allowed) as a new
    shard of views into one block on `device` (None: where the first shard's input_ids lives)."""
    layout = layout.resolved()  # a field left "any" (no image, or one row each) packs alike either way
    blobs = [s.list_blobs() if layout.lists else [] for s in shards]
    counts = SampleCounts(np.concatenate([shard_counts(s, b).table for s, b in zip(shards, blobs)]))
    moves = take_moves(byte_fields(layout), counts, [s.n for s in shards], index)
    dev = torch.device(device) if device is not None else next(iter(shards[0].dense.values())).device
    sources = [t if t.device == dev else t.to(dev) for s, b in zip(shards, blobs) for t in field_buffers(layout, s, b)]
    block = torch.empty(moves.block_bytes, dtype=torch.uint8, device=dev)
    select_executor(dev).run(moves.segments, sources, [block])
    return view_block(layout, block, moves.regions, moves.out_counts)


def rank_share(batch: dict, dp: int, rank: int) -> dict:
    """Rank `rank`'s contiguous 1/dp share of a global micro-batch (scalable reads)."""
    b = batch["input_ids"].shape[0] // dp
    return take_samples(batch, np.arange(rank * b, (rank + 1) * b))


def to_device(batch, device, non_blocking: bool = False):
    """Every tensor of a (nested) batch moved to `device`."""
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    return batch.to(device, non_blocking=non_blocking) if isinstance(batch, torch.Tensor) else batch


def pin(batch):
    """Every tensor of a (nested) batch in pinned host memory (fast, asynchronous H2D copies)."""
    if isinstance(batch, dict):
        return {k: pin(v) for k, v in batch.items()}
    return batch.pin_memory() if isinstance(batch, torch.Tensor) else batch
