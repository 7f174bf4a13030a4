"""Qwen-VL image sizes -> vision patch counts, by the Qwen2-VL / Qwen2.5-VL image-processor resize rule.

The rule (our own implementation, written from its description): both sides are rounded to the
nearest multiple of `factor` = patch_size x merge_size (14 x 2 = 28); if the rounded area exceeds
`max_pixels` the image is scaled down (sides floored to multiples of factor) to fit, if it is below
`min_pixels` it is scaled up (sides ceiled to multiples of factor). An image whose aspect ratio
exceeds 200 is rejected, as Qwen's processor does. The encoder then sees (h / patch) x (w / patch)
patches, i.e. (h / patch) x (w / patch) / merge^2 placeholder tokens in `input_ids`.
"""

from __future__ import annotations

import math

PATCH_SIZE = 14
MERGE_SIZE = 2
MIN_PIXELS = 56 * 56  # 3136
MAX_PIXELS = 14 * 14 * 4 * 1280  # 1003520
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, *, factor: int = PATCH_SIZE * MERGE_SIZE, min_pixels: int = MIN_PIXELS,
                 max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(resized height, resized width) in pixels, both multiples of `factor`.

    Rounding to the nearest multiple uses Python's round() (halves go to the even multiple), like
    the reference processor. A side shorter than one factor is not rejected (as early Qwen2-VL
    processors did): the area rule scales the image up; a side never ends below one factor.
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size {width}x{height} is invalid: width and height must be > 0")
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels={min_pixels} exceeds max_pixels={max_pixels}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"image size {width}x{height} has aspect ratio "
                         f"{max(height, width) / min(height, width):.0f} > {MAX_ASPECT_RATIO}, which Qwen-VL rejects")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = math.floor(height / beta / factor) * factor
        w = math.floor(width / beta / factor) * factor
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return max(factor, h), max(factor, w)


def image_patches(width: int, height: int, *, patch_size: int = PATCH_SIZE, merge_size: int = MERGE_SIZE,
                  min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS) -> int:
    """Vision patches (rows of hidden_states, = prod(grid_thw) for one image) of a width x height image."""
    h, w = smart_resize(height, width, factor=patch_size * merge_size, min_pixels=min_pixels, max_pixels=max_pixels)
    return (h // patch_size) * (w // patch_size)
