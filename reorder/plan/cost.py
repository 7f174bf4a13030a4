"""Per-sample cost model from counts (numbers in, numbers out; the counts of tensors come from
`reorder.batch.counting`) of fields identical on every module and PP stage (input_ids, attention_mask).

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

    def costs(self, placeholders, real_tokens, square_patches=None, images=None) -> np.ndarray:
        """float64 [B] costs from integer counts (array-like; images = vision-start tokens per
        sample, needed when encoder_image_weight > 0); same bits on every rank."""
        p = np.asarray(placeholders, dtype=np.float64)
        r = np.asarray(real_tokens, dtype=np.float64)
        merge2 = float(self.spatial_merge_size * self.spatial_merge_size)
        cost = self.encoder_weight * (p * merge2)
        if self.encoder_quadratic_weight:
            if square_patches is None:
                raise ValueError("encoder_quadratic_weight > 0 needs square_patches (reorder.batch.counting.square_patches)")
            cost = cost + self.encoder_quadratic_weight * np.asarray(square_patches, dtype=np.float64)
        if self.encoder_image_weight:
            if images is None:
                raise ValueError("encoder_image_weight > 0 needs the per-sample image counts (reorder.batch.counting.token_counts)")
            cost = cost + self.encoder_image_weight * np.asarray(images, dtype=np.float64)
        if self.language_weight:
            cost = cost + self.language_weight * r
        if self.language_quadratic_weight:
            cost = cost + self.language_quadratic_weight * (r * r)
        return cost
