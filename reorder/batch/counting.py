"""Counting a micro-batch: the per-sample integers of the cost (torch in, numpy out).

From `input_ids` (and `attention_mask`): image placeholder tokens, real tokens, images (vision-start
tokens) and, for the quadratic cost, the sum over images (runs of placeholders) of patches**2. On the
host with numpy (no torch dispatch); on a CUDA device with one Triton launch (`triton_count`), else
with a few torch ops, then one host copy, which also carries grid_thw when it lives there.
"""

from __future__ import annotations

import logging

import numpy as np
import torch


def token_counts(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """Integer counts per sample: (placeholders, real_tokens, images), each int64 [B] on CPU."""
    counts = count_samples(model, input_ids, attention_mask, squares=False)[0]
    return torch.from_numpy(counts[0]), torch.from_numpy(counts[1]), torch.from_numpy(counts[2])


def count_samples(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, *,
                  squares: bool | None = None, grid_thw: torch.Tensor | None = None) -> tuple:
    """(int64 numpy [4, B]: placeholders, real tokens, images, square patches (0 unless `squares`,
    default: encoder_quadratic_weight > 0), and `grid_thw` (any int tensor) as int64 numpy of its
    shape, or None). Numpy for host tensors (no torch dispatch); on a device a few
    kernels and ONE host copy for all of it (no other synchronization)."""
    _check_inputs(model, input_ids, attention_mask)
    squares = bool(model.encoder_quadratic_weight) if squares is None else squares
    if input_ids.device.type == "cpu" and (attention_mask is None or attention_mask.device.type == "cpu"):
        return _counts_numpy(model, input_ids, attention_mask, squares, grid_thw)
    return _counts_torch(model, input_ids, attention_mask, squares, grid_thw)


def _counts_numpy(model, input_ids, attention_mask, squares, grid_thw):
    ids = input_ids.numpy()
    out = np.zeros((4, len(ids)), dtype=np.int64)
    placeholders = ids == model.image_token_id
    placeholders.sum(axis=1, out=out[0])
    (ids == model.vision_start_token_id).sum(axis=1, out=out[2])
    if attention_mask is not None:
        m = attention_mask if attention_mask.dtype not in _NO_NUMPY else attention_mask.float()
        a = m.numpy()
        real = a != 0
        real.sum(axis=1, out=out[1])
        if a.dtype != np.bool_ and a.size and not (  # a float NaN fails the comparison too
                a.min() >= 0 and a.max() <= 1 if a.dtype.kind in "iu" else (a == real.astype(a.dtype)).all()):
            raise _mask_values_error(attention_mask)
    if squares:
        out[3] = _square_runs_numpy(placeholders) * model.spatial_merge_size ** 4
    return out, None if grid_thw is None else grid_thw.to("cpu", torch.int64).numpy()


def _counts_torch(model, input_ids, attention_mask, squares, grid_thw):
    b, s = input_ids.shape
    device = input_ids.device
    ride = grid_thw is not None and grid_thw.device == device  # travels in the same host copy
    flat = None if squares else _counts_kernel(model, input_ids, attention_mask, grid_thw if ride else None)
    if flat is not None:  # [B, 4] table: placeholders, vision starts, mask ones, mask zeros
        k = 4
    else:
        hits = input_ids.unsqueeze(-1) == _pair(device, model.image_token_id, model.vision_start_token_id)
        parts = [hits.sum(dim=1)]  # [B, 2]: placeholders, vision starts
        if attention_mask is not None:  # [B, 2]: ones (real tokens) and zeros; all S of them prove a 0/1 mask
            parts.append((attention_mask.unsqueeze(-1) == _pair(attention_mask.device, 1, 0)).sum(dim=1))
        if squares:
            parts.append((_square_runs_torch(hits[..., 0]) * model.spatial_merge_size ** 4).unsqueeze(1))
        table = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]  # [B, k]
        flat = torch.cat([table.view(-1), grid_thw.reshape(-1).to(torch.int64)]) if ride else table
        k = table.shape[1]
    host = flat.cpu().numpy()  # the one host sync
    t = host[:b * k].reshape(b, k)
    out = np.zeros((4, b), dtype=np.int64)
    out[0], out[2] = t[:, 0], t[:, 1]
    if attention_mask is not None:
        if (t[:, 2] + t[:, 3] != s).any():
            raise _mask_values_error(attention_mask)
        out[1] = t[:, 2]
    if squares:
        out[3] = t[:, -1]
    if grid_thw is None:
        return out, None
    return out, host[b * k:].reshape(tuple(grid_thw.shape)) if ride else grid_thw.to("cpu", torch.int64).numpy()


_KERNEL = []  # [the Triton counting kernel, or None where triton does not import], filled on first use


def _counts_kernel(model, input_ids, attention_mask, grid_thw, interpret: bool = False):
    """The [B, 4] count table and grid_thw's values (int64, flat, on input_ids' device) from one
    Triton launch, or None where it does not apply: not a CUDA tensor (unless `interpret`: CPU
    tensors through Triton's interpreter, for tests), triton missing, an empty input_ids, a field
    not contiguous, or a kernel that failed to launch once (logged; the torch ops count those)."""
    if not interpret and input_ids.device.type != "cuda":
        return None
    if not _KERNEL:
        try:
            from reorder.batch.triton_count import count_rows
        except Exception:  # not installed, or a broken install: counting must not stop training
            count_rows = None
        _KERNEL.append(count_rows)
    kernel = _KERNEL[0]
    if kernel is None or not input_ids.numel() or not input_ids.is_contiguous() or (attention_mask is not None and (
            attention_mask.device != input_ids.device or not attention_mask.is_contiguous())) or (
            grid_thw is not None and not grid_thw.is_contiguous()):
        return None
    b, s = input_ids.shape
    n_thw = 0 if grid_thw is None else grid_thw.numel()
    out = torch.empty(4 * b + n_thw, dtype=torch.int64, device=input_ids.device)
    args = (input_ids, input_ids if attention_mask is None else attention_mask,
            input_ids if grid_thw is None else grid_thw, out, s, n_thw, model.image_token_id,
            model.vision_start_token_id)
    meta = dict(HAS_MASK=attention_mask is not None, HAS_THW=n_thw > 0, BLOCK=1024)
    try:
        if interpret:
            kernel[(b,)](*args, **meta)
        else:
            with torch.cuda.device(input_ids.device):  # Triton launches on the current device and stream
                kernel[(b,)](*args, **meta, num_warps=4)
    except Exception as e:  # e.g. no Triton compiler for this GPU: the torch ops count from now on
        _KERNEL[0] = None
        logging.getLogger("reorder").warning("reorder: the Triton counting kernel failed (%s: %s); counting "
                                             "with torch ops from now on", type(e).__name__, e)
        return None
    return out


def _check_input_ids(input_ids):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids has shape {tuple(getattr(input_ids, 'shape', ()))}: expected [B, S]")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids has dtype {input_ids.dtype}: it must hold integer token ids (torch.int64 or "
                         "torch.int32); load the tokens as integers, not cast to a float dtype")


def _check_inputs(model, input_ids, attention_mask):
    """The cost fields are what counting can read: a [B, S] integer input_ids and, when given, an
    attention_mask of the same [B, S], bool, integer or float (its values, 0 or 1, are checked
    while counting)."""
    _check_input_ids(input_ids)
    if attention_mask is None:
        if model.language_weight > 0 or model.language_quadratic_weight > 0:
            which = f"language_weight={model.language_weight}"
            if model.language_quadratic_weight:
                which += f", language_quadratic_weight={model.language_quadratic_weight}"
            raise ValueError(f"attention_mask is missing but {which}: load attention_mask on every rank or "
                             "set the language cost weights to 0")
    elif not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a [B, S] tensor; got {type(attention_mask).__name__}: give 1 for "
                         "real tokens and 0 for padding, shape [B, S] like input_ids")
    elif not (attention_mask.dtype == torch.bool or attention_mask.dtype.is_floating_point
              or attention_mask.dtype in _INTEGER):
        raise ValueError(f"attention_mask must be a bool, integer or float 0/1 mask; got {attention_mask.dtype}: "
                         "give 1 for real tokens and 0 for padding")
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has "
                         f"{tuple(input_ids.shape)}: give one mask entry per token, shape [B, S] like input_ids")


_INTEGER = {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
            *(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))}
_NO_NUMPY = {d for d in (torch.bfloat16, *(getattr(torch, n) for n in dir(torch) if n.startswith("float8_")))
             if isinstance(d, torch.dtype)}


def _mask_values_error(attention_mask) -> ValueError:
    """The error for a mask holding values other than 0 and 1, naming the first one and where it is."""
    m = attention_mask.detach().to("cpu")
    m = m.double() if m.is_floating_point() else m
    i, j = (int(x) for x in (m != (m != 0).to(m.dtype)).nonzero()[0])
    value = m[i, j].item()
    return ValueError(f"attention_mask holds {value!r} at sample {i}, token {j}: expected a 0/1 mask (1 = real "
                      "token, 0 = padding); an additive mask (0 = attend, -inf = masked) converts with "
                      "(attention_mask == 0)")


def square_patches(model, input_ids: torch.Tensor) -> torch.Tensor:
    """int64 [B] on CPU: sum over the sample's images (runs of placeholder tokens) of patches**2."""
    _check_input_ids(input_ids)
    merge4 = model.spatial_merge_size ** 4
    m = input_ids == model.image_token_id
    if m.device.type == "cpu":
        return torch.from_numpy(_square_runs_numpy(m.numpy()) * merge4)
    return (_square_runs_torch(m) * merge4).cpu()


_PAIRS = {}  # (device, first, second) -> int64 [2] on that device


def _pair(device, first: int, second: int) -> torch.Tensor:
    """Two integers as a tensor on `device`, made once (no host-to-device copy per call): the token
    ids counted, or the mask values 1 and 0."""
    key = (device, first, second)
    t = _PAIRS.get(key)
    if t is None:
        t = _PAIRS[key] = torch.tensor([first, second], device=device)
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
