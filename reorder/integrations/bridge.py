"""Drop-in replacement for Megatron-Bridge's MIMO reorder buffer.

Megatron-Bridge ships `megatron.bridge.data.megatron_mimo.reorder_buffer` (and `canonical_grid_size`
in `canonical_sampler`); its Qwen3.5-VL MIMO example wires them as::

    dp_rank, dp_size, dp_group_gloo, dp_group_nccl = build_module_dp_process_groups(
        grid.get_pg(["dp"]), overlap=overlap)
    cost_of = functools.partial(sample_cost, encoder_cost_weight=..., language_cost_weight=...,
                                image_token_id=..., square_merge_size=...)
    train_iter = ReorderingBuffer(train_iter, dp_rank=dp_rank, dp_size=dp_size, n_groups=n_groups,
                                  cost_of=cost_of, dp_group_gloo=dp_group_gloo,
                                  dp_group_nccl=dp_group_nccl, overlap=overlap,
                                  image_count_of=image_count_of, window_size=window_size)

This module has the same names, signatures and behaviour, built on `WindowExchanger` (one
fixed-size metadata all-gather and one ragged all_to_all per window, vectorized packing) and this
library's `ReorderingBuffer`. Changing the import line is all a user does.

Costs. A `functools.partial` of `sample_cost` (this module's, or Bridge's own) with an integer
`image_token_id`, a perfect-square `square_merge_size` and finite non-negative weights (not both 0)
runs as this library's vectorized `CostModel`: counts for the whole micro-batch in a few tensor ops,
bit-identical costs. Any other `cost_of` is honoured exactly as upstream does: called once per
sample on a per-sample flat dict (dotted keys, batch dim kept with size 1: upstream's format; here
views, nothing is copied), and its float64 costs travel, bit for bit, in the metadata all-gather.

Plans. The default balancer is `lpt`, upstream's equal-count LPT bit for bit: every rank receives the
same samples in the same order as with upstream. `balancer="balanced"` (an extra keyword) gives a max
load never above LPT's with far fewer samples moved.

Nothing here imports megatron, and torch is imported inside functions.
"""

from __future__ import annotations

import functools
import math
import operator
import os

__all__ = ["ReorderingBuffer", "build_module_dp_process_groups", "canonical_grid_size",
           "covered_canonical_groups", "image_count_of", "sample_cost"]

QWEN35_VISION_START_TOKEN_ID = 248053
_BRIDGE_MODULE = "megatron.bridge.data.megatron_mimo.reorder_buffer"
_COST_KEYWORDS = {"encoder_cost_weight", "language_cost_weight", "image_token_id", "square_merge_size"}


# ---- canonical grid ---------------------------------------------------------------------------

def canonical_grid_size(module_dp_sizes) -> int:
    """The shared grid: the least common multiple of every module's DP size."""
    sizes = list(module_dp_sizes) if module_dp_sizes is not None else []
    try:
        ok = bool(sizes) and all(dp is not None and not isinstance(dp, bool) and operator.index(dp) >= 1
                                 for dp in sizes)
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"module DP sizes must be positive integers (got {module_dp_sizes}).")
    from reorder import canonical_grid

    return canonical_grid([operator.index(dp) for dp in sizes])


def covered_canonical_groups(dp_rank: int, dp_size: int, grid_size: int) -> list:
    """The grid_size // dp_size consecutive canonical groups rank dp_rank of a dp_size module reads."""
    if grid_size % dp_size != 0:
        raise ValueError(f"canonical grid size ({grid_size}) is not divisible by the module DP size ({dp_size}); "
                         "module DP sizes must divide their least common multiple.")
    span = grid_size // dp_size
    return list(range(dp_rank * span, (dp_rank + 1) * span))


# ---- costs ------------------------------------------------------------------------------------

def sample_cost(flat, *, encoder_cost_weight: float, language_cost_weight: float = 0.0,
                image_token_id: int | None = None, square_merge_size: int = 1) -> float:
    """encoder_cost_weight * patches + language_cost_weight * real_tokens for one per-sample flat dict.

    patches: image placeholders in input_ids times square_merge_size (spatial_merge_size**2) when
    `image_token_id` is given (identical on every module); else the sum of prod(grid_thw) over the
    sample's '*.grid_thw' entries (absent on language ranks: only for batches that carry it
    everywhere). real_tokens: nonzero attention_mask entries, counted only when
    language_cost_weight is nonzero (then attention_mask is required: ValueError).

    Passed as `cost_of=functools.partial(sample_cost, ...)`, the buffer computes it vectorized over
    the micro-batch instead of calling it per sample (same values).
    """
    import torch

    patches = 0
    if image_token_id is not None:
        input_ids = flat.get("input_ids")
        if isinstance(input_ids, torch.Tensor) and input_ids.numel():
            patches = int((input_ids == image_token_id).sum().item()) * square_merge_size
    else:
        for key, val in flat.items():
            if key.endswith(".grid_thw") and isinstance(val, torch.Tensor) and val.numel():
                patches += int(torch.prod(val, dim=1).sum().item())
    tokens = 0
    if language_cost_weight:
        input_ids = flat.get("input_ids")
        if isinstance(input_ids, torch.Tensor) and input_ids.numel():
            mask = flat.get("attention_mask")
            if not isinstance(mask, torch.Tensor):
                raise ValueError(f"language_cost_weight={language_cost_weight} counts real tokens from "
                                 "attention_mask, which this sample lacks: load attention_mask on every rank "
                                 "or set language_cost_weight=0")
            if mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has "
                                 f"{tuple(input_ids.shape)}: they must match for the language cost")
            tokens = int((mask != 0).sum().item())
    return encoder_cost_weight * patches + language_cost_weight * tokens


def image_count_of(batch, vision_start_token_id: int = QWEN35_VISION_START_TOKEN_ID):
    """Per-sample image counts (int64 [B]): vision-start tokens in each input_ids row (one per image).
    The default id is Qwen3.5-VL's; pass `functools.partial(image_count_of, vision_start_token_id=...)`
    for other models."""
    import torch

    return (batch["input_ids"] == vision_start_token_id).sum(dim=1).to(torch.long)


def _vectorized_cost(cost_of):
    """The CostModel equivalent to `cost_of` when it is a partial of sample_cost whose costs the
    vectorized counts reproduce exactly, else None (then cost_of is called per sample)."""
    if not isinstance(cost_of, functools.partial) or cost_of.args:
        return None
    fn = cost_of.func
    if fn is not sample_cost and not (getattr(fn, "__module__", None) == _BRIDGE_MODULE
                                      and getattr(fn, "__name__", None) == "sample_cost"):
        return None
    kw = dict(cost_of.keywords)
    if "encoder_cost_weight" not in kw or not set(kw) <= _COST_KEYWORDS:
        return None
    enc, lang = kw["encoder_cost_weight"], kw.get("language_cost_weight", 0.0)
    token, merge = kw.get("image_token_id"), kw.get("square_merge_size", 1)
    for w in (enc, lang):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            return None
    if not (enc or lang) or isinstance(token, bool) or not isinstance(token, int):
        return None
    if isinstance(merge, bool) or not isinstance(merge, int) or merge < 1 or math.isqrt(merge) ** 2 != merge:
        return None
    from reorder import CostModel

    return CostModel(encoder_weight=enc, language_weight=lang, image_token_id=token,
                     spatial_merge_size=math.isqrt(merge))


def _vision_start_of(image_count):
    """The vision-start token id when `image_count` is this module's image_count_of (or a partial of
    it): the vectorized counts then give the image counts too. Else None."""
    if image_count is image_count_of:
        return QWEN35_VISION_START_TOKEN_ID
    if isinstance(image_count, functools.partial) and image_count.func is image_count_of and not image_count.args \
            and set(image_count.keywords) <= {"vision_start_token_id"}:
        token = image_count.keywords.get("vision_start_token_id", QWEN35_VISION_START_TOKEN_ID)
        return token if isinstance(token, int) and not isinstance(token, bool) else None
    return None


class _BridgeCost:
    """What WindowExchanger reads of a cost model (counts, costs, the header's weights and ids), fed
    with each micro-batch's image counts (from image_count_of) and, for a per-sample `cost_of`, its
    costs. `_Source` registers them per micro-batch (keyed by its input_ids tensor) when it reads the
    micro-batch; the exchanger asks for them, on the same thread, when it counts the window.

    Per-sample costs ride in the square-patches column of the metadata as float64 bit patterns, so
    every rank plans from the very same bits; the placeholders column then holds each sample's patch
    rows (merge size 1), which the exchanger checks against grid_thw where vision travels."""

    def __init__(self, model, per_sample: bool):
        self.model, self.per_sample = model, per_sample
        for name in ("encoder_weight", "language_weight", "encoder_quadratic_weight", "language_quadratic_weight",
                     "encoder_image_weight", "image_token_id", "vision_start_token_id", "spatial_merge_size"):
            setattr(self, name, getattr(model, name))
        self._pending = {}  # id(input_ids) -> (image counts | None, patch rows | None, costs | None)

    def register(self, input_ids, images, rows, costs) -> None:
        self._pending[id(input_ids)] = (images, rows, costs)

    def counts(self, input_ids, attention_mask, *, squares=None, grid_thw=None, grid=None):
        import numpy as np

        images, rows, costs = self._pending.pop(id(input_ids), (None, None, None))
        if not self.per_sample:
            out, grid_host = self.model.counts(input_ids, attention_mask, squares=False,
                                               grid_thw=grid if grid_thw is None else grid_thw)
            if images is not None:
                out[2] = images
            return out, grid_host
        if costs is None:
            raise ValueError("no per-sample costs were computed for this micro-batch (it did not come from the "
                             "buffer's source)")
        out = np.zeros((4, len(costs)), dtype=np.int64)
        if rows is not None:
            out[0] = rows
        if images is not None:
            out[2] = images
        out[3] = np.ascontiguousarray(costs, dtype=np.float64).view(np.int64)
        return out, None

    def costs(self, placeholders, real_tokens, square_patches=None, images=None):
        import numpy as np

        if self.per_sample:
            return np.ascontiguousarray(square_patches, dtype=np.int64).view(np.float64)
        return self.model.costs(placeholders, real_tokens, None, images)


# ---- per-sample views (upstream's flat format) ------------------------------------------------

def _is_visual(value) -> bool:
    """Upstream's patch-packed vision dict: {hidden_states: [rows, ...], grid_thw: [n_images, 3], ...}."""
    import torch

    return (isinstance(value, dict) and isinstance(value.get("hidden_states"), torch.Tensor)
            and isinstance(value.get("grid_thw"), torch.Tensor) and value["hidden_states"].dim() >= 1
            and value["grid_thw"].dim() == 2 and value["grid_thw"].size(-1) == 3)


def _visual_dicts(obj, path=()):
    """(path, dict) of every vision dict in a nested batch."""
    if isinstance(obj, dict):
        if _is_visual(obj):
            yield path, obj
            return
        for k, v in obj.items():
            yield from _visual_dicts(v, path + (str(k),))


def _image_offsets(counts, n_images: int, b: int):
    """[0, c0, c0 + c1, ...] from per-sample image counts (None: one image per sample)."""
    if counts is None:
        if n_images != b:
            raise ValueError(f"Vision reorder without per-sample image counts expects one image per sample "
                             f"(n_images={n_images}, n_samples={b}); pass image_count_of for variable counts.")
        return list(range(b + 1))
    cu = [0]
    for c in counts.tolist():
        cu.append(cu[-1] + int(c))
    if cu[-1] != n_images:
        raise ValueError(f"Per-sample image counts sum to {cu[-1]} but grid_thw has {n_images} images; "
                         "image_count_of is likely mis-sourced (wrong token id / off-by-one).")
    return cu


def _flatten(value, path: str, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{path}.{k}" if path else str(k), out)
    else:
        out[path] = value


def _sample_flats(batch: dict, b: int, cu_img) -> list:
    """b per-sample flat dicts in upstream's format: dotted keys; tensors keep their batch dim (size 1;
    dim 1 for [3, B, S] position_ids); a sample's vision rows and grid_thw rows; lists of length b
    as one-element lists; everything else as is. Views: nothing is copied."""
    import torch

    flats = [{} for _ in range(b)]

    def fill(d, prefix):
        for key, value in d.items():
            path = f"{prefix}{key}"
            if isinstance(value, torch.Tensor):
                dim = 1 if key == "position_ids" and value.dim() >= 3 and value.size(0) == 3 else 0
                if value.dim() > dim and value.size(dim) == b:
                    for i in range(b):
                        flats[i][path] = value.narrow(dim, i, 1)
                else:
                    for f in flats:
                        f[path] = value
            elif isinstance(value, dict) and _is_visual(value):
                hs, grid = value["hidden_states"], value["grid_thw"]
                rows = [0] + torch.prod(grid, dim=1).cumsum(0).tolist()
                for i in range(b):
                    lo, hi = cu_img[i], cu_img[i + 1]
                    sub = dict(value, hidden_states=hs[rows[lo]:rows[hi]], grid_thw=grid[lo:hi])
                    _flatten(sub, path, flats[i])
            elif isinstance(value, dict):
                fill(value, f"{path}.")
            elif isinstance(value, list) and len(value) == b:
                for i in range(b):
                    flats[i][path] = [value[i]]
            else:
                for f in flats:
                    f[path] = value

    fill(batch, "")
    return flats


class _Source:
    """This rank's micro-batch iterator, registering each micro-batch's image counts (and per-sample
    costs, for a per-sample cost_of) with the cost adapter as it is read. Errors raised here (a bad
    image_count_of, a cost_of that raises) reach the exchanger as data-source errors: every rank of
    the DP group raises them together."""

    def __init__(self, source, cost: _BridgeCost, cost_of, image_count, counts_from_model: bool):
        self.source, self.cost, self.cost_of, self.image_count = source, cost, cost_of, image_count
        self.counts_from_model = counts_from_model

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.source)
        self._register(batch)
        return batch

    def _register(self, batch) -> None:
        import numpy as np
        import torch

        ids = batch.get("input_ids") if isinstance(batch, dict) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() < 1:
            return  # the exchanger refuses the micro-batch (input_ids is required on every rank)
        b = ids.shape[0]
        visuals = list(_visual_dicts(batch))
        for path, _ in visuals:
            if len(path) < 2 or path[0] != "modality_inputs":
                where = "/".join(path) or "<root>"
                raise ValueError(f"vision dict (hidden_states + grid_thw) at {where!r}: it must sit inside "
                                 "modality_inputs, e.g. modality_inputs['images'][encoder]")
        if len(visuals) > 1:
            raise ValueError(f"the micro-batch holds {len(visuals)} vision dicts "
                             f"({', '.join('/'.join(p) for p, _ in visuals)}): one vision encoder per batch is "
                             "supported")
        per_sample = self.cost.per_sample
        counts = None
        if self.image_count is not None and (per_sample or not self.counts_from_model):
            got = self.image_count(batch)
            counts = np.asarray(got.tolist() if isinstance(got, torch.Tensor) else list(got), dtype=np.int64)
            if counts.shape != (b,):
                raise ValueError(f"image_count_of returned {counts.size} counts for a micro-batch of {b} samples")
        cu = rows = None
        if visuals:
            grid = visuals[0][1]["grid_thw"]
            if self.image_count is None:  # upstream's fallback: exactly one image per sample
                cu, counts = _image_offsets(None, grid.shape[0], b), np.ones(b, dtype=np.int64)
            elif counts is not None:
                cu = _image_offsets(counts, grid.shape[0], b)
            # else: counted from the vision-start ids with the placeholders (checked by the exchanger)
            if per_sample:
                csum = np.concatenate([[0], np.cumsum(grid.to("cpu", torch.int64).prod(dim=1).numpy())])
                rows = csum[cu[1:]] - csum[cu[:-1]]
        costs = None
        if per_sample:
            costs = np.array([float(self.cost_of(f)) for f in _sample_flats(batch, b, cu)], dtype=np.float64)
        self.cost.register(ids, counts, rows, costs)


# ---- process groups ---------------------------------------------------------------------------

def build_module_dp_process_groups(dp_group_nccl_main, *, overlap: bool):
    """(dp_rank, dp_size, dp_group_gloo, dp_group_nccl) for this rank's module DP group.

    A collective over the whole world (`dist.new_group` is): every rank of every module calls it,
    in the same order. Each rank's main DP group ranks are all-gathered, deduplicated and sorted; a
    Gloo group (metadata) is created for each, and with `overlap` a second data group (the overlap
    thread's, never interleaved with the training stream's collectives): NCCL when CUDA is
    available, else Gloo. Without overlap the main DP group carries the payloads.
    """
    import torch
    import torch.distributed as dist

    dp_rank = dist.get_rank(dp_group_nccl_main)
    dp_size = dist.get_world_size(dp_group_nccl_main)
    mine = list(dist.get_process_group_ranks(dp_group_nccl_main))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    unique = sorted({tuple(sorted(ranks)) for ranks in gathered})
    me = dist.get_rank()
    gloo = None
    for ranks in unique:
        g = dist.new_group(ranks=list(ranks), backend="gloo")
        if me in ranks:
            gloo = g
    data = dp_group_nccl_main
    if overlap:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
        for ranks in unique:
            g = dist.new_group(ranks=list(ranks), backend=backend)
            if me in ranks:
                data = g
    return dp_rank, dp_size, gloo, data


def _output_device(dp_size: int):
    """Where reordered micro-batches go: the current CUDA device when dp > 1 and CUDA is available (as
    upstream, which exchanges on the GPU), else None (they stay where the input lives)."""
    import torch

    if dp_size > 1 and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _local_size(batch) -> int:
    """Samples in one rank's micro-batch (upstream's rule: input_ids, labels, loss_mask, position_ids)."""
    import torch

    if isinstance(batch, dict):
        for key in ("input_ids", "labels", "loss_mask", "position_ids"):
            t = batch.get(key)
            if isinstance(t, torch.Tensor) and t.dim() >= 1:
                return t.size(1 if key == "position_ids" and t.dim() >= 3 and t.size(0) == 3 else 0)
    raise ValueError("Cannot determine batch size: no input_ids/labels/loss_mask/position_ids tensor.")


def _is_collectives(obj) -> bool:
    return callable(getattr(obj, "all_gather", None)) and callable(getattr(obj, "all_to_all", None))


# ---- the buffer -------------------------------------------------------------------------------

class ReorderingBuffer:
    """Iterator of cost-balanced micro-batches over `data_iterator` (this rank's contiguous
    B/dp_size share of each global micro-batch), Megatron-Bridge's interface.

    Reads windows of `window_size` micro-batches (a short last window at its real size), plans each
    micro-batch over the canonical grid `n_groups` (lcm of the module DP sizes: every module derives
    the same order), exchanges the window in one all_to_all and yields the micro-batches in canonical
    order, then StopIteration. At dp_size 1 it permutes locally (no communication; groups may be
    None). With `overlap`, CUDA and dp_size > 1, a worker thread exchanges the next window while the
    current one is consumed; it ends on its own when the source is exhausted, or at `shutdown()`.
    Outputs are on the current CUDA device when dp_size > 1 and CUDA is available, else where the
    input lives.

    cost_of: per-sample cost (see `sample_cost`; a partial of it is vectorized). image_count_of:
    batch -> per-sample image counts (None: one image per sample where vision travels).
    dp_group_gloo / dp_group_nccl: from `build_module_dp_process_groups` (or one reorder
    `Collectives` object passed as both). balancer (an addition): "lpt" (default, upstream's plan
    bit for bit) or "balanced" / "identity".

    A bad micro-batch, a source that raises or ends early on one rank, or a config that differs
    across the DP group raises the same `ReorderError` (a ValueError) on every rank of the group.
    """

    def __init__(self, data_iterator, *, dp_rank: int, dp_size: int, n_groups: int, cost_of, dp_group_gloo,
                 dp_group_nccl, overlap: bool = True, image_count_of=None, window_size: int = 1,
                 balancer: str = "lpt"):
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}.")
        if overlap and dp_size > 1 and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            raise ValueError("ReorderingBuffer overlap=True deadlocks under CUDA_DEVICE_MAX_CONNECTIONS=1 (one "
                             "hardware queue: the overlap thread's all-to-all and the DDP all-reduce can wait on "
                             "each other). Pass overlap=False (--no-overlap-intra-microbatch-reorder) or unset "
                             "the variable.")
        import numpy as np

        from reorder import CostModel, Grid, plan_orders

        self._grid = Grid(groups=n_groups, dp=dp_size, rank=dp_rank)
        plan_orders(np.zeros((1, n_groups)), n_groups, balancer)  # an unknown balancer raises here
        model = _vectorized_cost(cost_of)
        self._vectorized = model is not None
        start = _vision_start_of(image_count_of)
        if model is None:
            model = CostModel(encoder_weight=1.0, spatial_merge_size=1, image_token_id=-1,
                              vision_start_token_id=QWEN35_VISION_START_TOKEN_ID if start is None else start)
        elif start is not None:
            model = CostModel(encoder_weight=model.encoder_weight, language_weight=model.language_weight,
                              image_token_id=model.image_token_id, spatial_merge_size=model.spatial_merge_size,
                              vision_start_token_id=start)
        self._cost = _BridgeCost(model, per_sample=not self._vectorized)
        self._source = _Source(iter(data_iterator), self._cost, cost_of, image_count_of,
                               counts_from_model=start is not None)
        self._groups = (dp_group_gloo, dp_group_nccl)
        self._window_size, self._balancer = window_size, balancer
        self._device = _output_device(dp_size)
        self._overlap = bool(overlap) and dp_size > 1 and self._device is not None
        self._inner = None
        self._ended = False

    @property
    def _thread(self):
        """The overlap worker thread (None without overlap, CUDA and dp > 1, or before the first window)."""
        return None if self._inner is None else self._inner._thread

    @property
    def reports(self):
        """Per-window WindowReports (planning and exchange times, loads before/after, bytes moved)."""
        return () if self._inner is None else self._inner.reports

    @property
    def last_report(self):
        return None if self._inner is None else self._inner.last_report

    def __iter__(self):
        return self

    def __next__(self):
        if self._inner is None:
            if self._ended:
                raise StopIteration
            self._start()
            if self._inner is None:
                raise StopIteration
        return next(self._inner)

    def _start(self) -> None:
        """Build the exchanger once the first micro-batch gives B = local size x dp_size."""
        import itertools

        from reorder import ReorderingBuffer as _Buffer
        from reorder import WindowExchanger

        try:
            first = next(self._source.source)
        except StopIteration:
            self._ended = True
            return
        grid = self._grid
        global_batch = _local_size(first) * grid.dp
        collectives = None
        if grid.dp > 1:
            gloo, data = self._groups
            if gloo is None or data is None:
                raise ValueError(f"dp_size={grid.dp} needs dp_group_gloo and dp_group_nccl "
                                 "(build_module_dp_process_groups); only a dp_size 1 module may pass None")
            if _is_collectives(gloo):
                collectives = gloo
            else:
                from reorder.exchange.dist import TorchCollectives

                collectives = TorchCollectives(gloo, data, meta_on_device=False,
                                               spin=0.0 if self._overlap else 2e-4)
        ex = WindowExchanger(grid=grid, micro_batch_size=global_batch, cost=self._cost, balancer=self._balancer,
                             window_size=self._window_size, collectives=collectives,
                             device=self._device if grid.dp > 1 else None,
                             early_copy=not self._overlap and grid.dp > 1)
        self._source.source = itertools.chain([first], self._source.source)
        self._inner = _Buffer(self._source, ex, overlap=self._overlap)

    def shutdown(self) -> None:
        """Stop the overlap worker (if any) and wait briefly for it to exit."""
        inner = getattr(self, "_inner", None)
        if inner is None or inner._thread is None:
            return
        inner.close(timeout=1.0)

    def __del__(self):
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown or a half-built object
            pass
