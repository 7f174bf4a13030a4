"""Per-sample cost from fields identical on every module and PP stage (input_ids, attention_mask).

cost = encoder_weight * patches + encoder_quadratic_weight * sum over images of patches**2
       + encoder_image_weight * images
       + language_weight * real_tokens + language_quadratic_weight * real_tokens**2,
patches = image placeholders * spatial_merge_size**2; for the quadratic term an image is one run of
consecutive placeholder tokens in input_ids (full-attention ViTs cost ~ patches**2 per image); for the
per-image term (fixed work per image: kernel launches of a per-image attention loop, padding) images
are the vision-start tokens. Never the padded length, never grid_thw or pixels (absent on language
ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class CostModel:
    """Weights and token ids of the cost model; validated on construction."""

    encoder_weight: float = 1.0
    language_weight: float = 0.0
    encoder_quadratic_weight: float = 0.0
    language_quadratic_weight: float = 0.0
    encoder_image_weight: float = 0.0
    image_token_id: int = 248056
    vision_start_token_id: int = 248053
    spatial_merge_size: int = 2

    def __post_init__(self):
        for name in ("encoder_weight", "language_weight", "encoder_quadratic_weight", "language_quadratic_weight",
                     "encoder_image_weight"):
            w = getattr(self, name)
            if not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
                raise ValueError(f"{name}={w!r} is invalid: cost weights must be finite and >= 0")
        if not (self.encoder_weight or self.language_weight or self.encoder_quadratic_weight
                or self.language_quadratic_weight or self.encoder_image_weight):
            raise ValueError("encoder_weight=0 and language_weight=0: at least one cost weight must be > 0")
        if not isinstance(self.spatial_merge_size, int) or self.spatial_merge_size < 1:
            raise ValueError(f"spatial_merge_size={self.spatial_merge_size!r} is invalid: must be an integer >= 1")

    def token_counts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
        """Integer counts per sample: (placeholders, real_tokens, images), each int64 [B] on CPU."""
        counts = self.count_array(input_ids, attention_mask)
        return torch.from_numpy(counts[0]), torch.from_numpy(counts[1]), torch.from_numpy(counts[2])

    def count_array(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> np.ndarray:
        """`token_counts` as one int64 numpy array [3, B] (placeholders, real tokens, images)."""
        return self.counts(input_ids, attention_mask, squares=False)[0][:3]

    def counts(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *, squares: bool | None = None,
               grid: torch.Tensor | None = None) -> tuple:
        """(int64 numpy [4, B]: placeholders, real tokens, images, square patches (0 unless `squares`,
        default: encoder_quadratic_weight > 0), and `grid` (any int tensor, e.g. grid_thw) as int64
        numpy of its shape, or None). Numpy for host tensors (no torch dispatch); on a device a few
        kernels and ONE host copy for all of it (no other synchronization)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: expected [B, S]")
        self._check_mask(attention_mask, input_ids)
        squares = bool(self.encoder_quadratic_weight) if squares is None else squares
        if input_ids.device.type == "cpu" and (attention_mask is None or attention_mask.device.type == "cpu"):
            return self._counts_numpy(input_ids, attention_mask, squares, grid)
        return self._counts_torch(input_ids, attention_mask, squares, grid)

    def _counts_numpy(self, input_ids, attention_mask, squares, grid):
        ids = input_ids.numpy()
        out = np.zeros((4, len(ids)), dtype=np.int64)
        placeholders = ids == self.image_token_id
        placeholders.sum(axis=1, out=out[0])
        (ids == self.vision_start_token_id).sum(axis=1, out=out[2])
        if attention_mask is not None:
            m = attention_mask if attention_mask.dtype != torch.bfloat16 else attention_mask.float()
            (m.numpy() != 0).sum(axis=1, out=out[1])
        if squares:
            out[3] = _square_runs_numpy(placeholders) * self.spatial_merge_size ** 4
        return out, None if grid is None else grid.to("cpu", torch.int64).numpy()

    def _counts_torch(self, input_ids, attention_mask, squares, grid):
        b = len(input_ids)
        tokens = _token_pair(input_ids.device, self.image_token_id, self.vision_start_token_id)
        hits = input_ids.unsqueeze(-1) == tokens  # [B, S, 2]: placeholder, vision start
        parts = [hits.sum(dim=1).reshape(-1)]  # [B * 2], sample-major
        if attention_mask is not None:
            parts.append((attention_mask != 0).sum(dim=1))
        if squares:
            parts.append(_square_runs_torch(hits[..., 0]) * self.spatial_merge_size ** 4)
        ride = grid is not None and grid.device == input_ids.device  # travels in the same host copy
        if ride:
            parts.append(grid.reshape(-1).to(torch.int64))
        host = (torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy()  # the one host sync
        out, at = np.zeros((4, b), dtype=np.int64), 2 * b
        out[[0, 2]] = host[:at].reshape(b, 2).T
        for row, present in ((1, attention_mask is not None), (3, squares)):
            if present:
                out[row], at = host[at:at + b], at + b
        if grid is None:
            return out, None
        return out, host[at:].reshape(tuple(grid.shape)) if ride else grid.to("cpu", torch.int64).numpy()

    def _check_mask(self, attention_mask, input_ids):
        if attention_mask is None:
            if self.language_weight > 0 or self.language_quadratic_weight > 0:
                which = f"language_weight={self.language_weight}"
                if self.language_quadratic_weight:
                    which += f", language_quadratic_weight={self.language_quadratic_weight}"
                raise ValueError(f"attention_mask is missing but {which}: load attention_mask on every rank or "
                                 "set the language cost weights to 0")
        elif attention_mask.dim() != 2 or attention_mask.shape[0] != input_ids.shape[0]:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}: expected "
                             f"[B, S] = {tuple(input_ids.shape)} for the language cost")

    def square_patches(self, input_ids: torch.Tensor) -> torch.Tensor:
        """int64 [B] on CPU: sum over the sample's images (runs of placeholder tokens) of patches**2."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}: expected [B, S]")
        merge4 = self.spatial_merge_size ** 4
        m = input_ids == self.image_token_id
        if m.device.type == "cpu":
            return torch.from_numpy(_square_runs_numpy(m.numpy()) * merge4)
        return (_square_runs_torch(m) * merge4).cpu()

    def costs(self, placeholders, real_tokens, square_patches=None, images=None) -> np.ndarray:
        """float64 [B] costs from integer counts (array-like; images = vision-start tokens per
        sample, needed when encoder_image_weight > 0); same bits on every rank."""
        p = np.asarray(placeholders, dtype=np.float64)
        r = np.asarray(real_tokens, dtype=np.float64)
        merge2 = float(self.spatial_merge_size * self.spatial_merge_size)
        cost = self.encoder_weight * (p * merge2)
        if self.encoder_quadratic_weight:
            if square_patches is None:
                raise ValueError("encoder_quadratic_weight > 0 needs square_patches (CostModel.square_patches)")
            cost = cost + self.encoder_quadratic_weight * np.asarray(square_patches, dtype=np.float64)
        if self.encoder_image_weight:
            if images is None:
                raise ValueError("encoder_image_weight > 0 needs the per-sample image counts (CostModel.token_counts)")
            cost = cost + self.encoder_image_weight * np.asarray(images, dtype=np.float64)
        if self.language_weight:
            cost = cost + self.language_weight * r
        if self.language_quadratic_weight:
            cost = cost + self.language_quadratic_weight * (r * r)
        return cost


_TOKENS = {}  # (device, image_token_id, vision_start_token_id) -> int64 [2] on that device


def _token_pair(device, image_token_id: int, vision_start_token_id: int) -> torch.Tensor:
    """The two token ids as a tensor on `device`, made once (no host-to-device copy per call)."""
    key = (device, image_token_id, vision_start_token_id)
    t = _TOKENS.get(key)
    if t is None:
        t = _TOKENS[key] = torch.tensor([image_token_id, vision_start_token_id], device=device)
    return t


def _square_runs_numpy(m: np.ndarray) -> np.ndarray:
    """int64 [B]: per row of the bool [B, S] `m`, the sum over runs of True of (run length)**2, as
    the sum over run positions k = 0, 1, ... of 2k + 1 (no run list, no data-dependent shapes)."""
    b, s = m.shape
    start = m.copy()
    start[:, 1:] &= ~m[:, :-1]
    idx = np.arange(s, dtype=np.int64)
    run_start = np.maximum.accumulate(np.where(start, idx, 0), axis=1)
    return np.where(m, 2 * (idx - run_start) + 1, 0).sum(axis=1, dtype=np.int64)


def _square_runs_torch(m: torch.Tensor) -> torch.Tensor:
    """`_square_runs_numpy` on m's device, with no host synchronization."""
    b, s = m.shape
    start = m.clone()
    start[:, 1:] &= ~m[:, :-1]
    idx = torch.arange(s, device=m.device, dtype=torch.int64)
    run_start = torch.where(start, idx, 0).cummax(dim=1).values
    return torch.where(m, 2 * (idx - run_start) + 1, 0).sum(dim=1)
