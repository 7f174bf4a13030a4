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
views, nothing is copied), through the exchanger's `sample_costs` hook: its float64 costs travel,
bit for bit, in the window frame's cost_bits column. Per-sample image counts (`image_count_of`, or
upstream's one-image-per-sample fallback) go through the `image_counts` hook. Both hooks read only
the micro-batch they are given.

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


# ---- the exchanger's hooks (per-sample costs and image counts given by this module) ----------

def _call(fn, arg, name: str):
    """fn(arg), with any exception it raises re-raised as a ValueError naming `name`.

    Why: the exchanger shares the ValueErrors raised while it counts a micro-batch with the whole DP
    group (every rank then raises the same ReorderError); any other exception type would escape on
    this rank alone and leave its peers waiting in the metadata all-gather."""
    try:
        return fn(arg)
    except Exception as e:  # noqa: BLE001 - re-raised, with its type, as one the DP group shares
        raise ValueError(f"{name} raised {type(e).__name__}: {e}") from e


class _ImageCounts:
    """WindowExchanger's `image_counts` hook: micro-batch -> int64 [B/dp] images per sample.

    With `image_count_of`, its values (a tensor or a sequence of B/dp integers). Without it,
    upstream's fallback: exactly one image per sample where a vision dict travels, none where none
    does. Where vision travels the counts must add up to grid_thw's images. Every check raises a
    ValueError (shared with the DP group): a vision dict outside modality_inputs or a second one, a
    wrong number of counts, counts that do not add up, an image_count_of that raises.
    """

    def __init__(self, image_count_of):
        self.image_count_of = image_count_of

    def __call__(self, batch):
        import numpy as np
        import torch

        b = batch["input_ids"].shape[0]  # the exchanger has checked input_ids before asking
        vision = _vision_of(batch)
        n_images = None if vision is None else vision["grid_thw"].shape[0]
        if self.image_count_of is None:
            if n_images is not None and n_images != b:
                raise ValueError(f"Vision reorder without per-sample image counts expects one image per sample "
                                 f"(n_images={n_images}, n_samples={b}); pass image_count_of for variable counts.")
            return np.full(b, 0 if n_images is None else 1, dtype=np.int64)
        got = _call(self.image_count_of, batch, "image_count_of")
        counts = np.asarray(got.tolist() if isinstance(got, torch.Tensor) else list(got), dtype=np.int64)
        if counts.shape != (b,):
            raise ValueError(f"image_count_of returned {counts.size} counts for a micro-batch of {b} samples")
        if n_images is not None and int(counts.sum()) != n_images:
            raise ValueError(f"Per-sample image counts sum to {int(counts.sum())} but grid_thw has {n_images} "
                             "images; image_count_of is likely mis-sourced (wrong token id / off-by-one).")
        return counts


class _PerSampleCosts:
    """WindowExchanger's `sample_costs` hook for a `cost_of` that does not run vectorized:
    micro-batch -> float64 [B/dp], `cost_of` called once per sample, in order, on upstream's
    per-sample flat dict (`_sample_flats`: views, nothing copied or moved between devices).

    The images of each sample (to hand it its own vision rows) come from `image_counts`, asked again
    here so that this hook reads nothing but the micro-batch it is given. A cost_of that raises, or
    returns something float() refuses, raises a ValueError / TypeError that the DP group shares; the
    exchanger refuses non-finite and negative costs the same way.
    """

    def __init__(self, cost_of, image_counts: _ImageCounts):
        self.cost_of, self.image_counts = cost_of, image_counts

    def __call__(self, batch):
        import numpy as np

        b = batch["input_ids"].shape[0]
        cu = None
        if _vision_of(batch) is not None:
            cu = [0, *np.cumsum(self.image_counts(batch)).tolist()]
        return np.array([float(_call(self.cost_of, flat, "cost_of")) for flat in _sample_flats(batch, b, cu)],
                        dtype=np.float64)


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


def _vision_of(batch):
    """The micro-batch's one vision dict, or None where it carries none.

    Raises ValueError for one outside modality_inputs (the exchanger would treat its tensors as
    global metadata and not move them with their samples) or for more than one (one vision encoder
    per batch is supported)."""
    visuals = list(_visual_dicts(batch))
    for path, _ in visuals:
        if len(path) < 2 or path[0] != "modality_inputs":
            where = "/".join(path) or "<root>"
            raise ValueError(f"vision dict (hidden_states + grid_thw) at {where!r}: it must sit inside "
                             "modality_inputs, e.g. modality_inputs['images'][encoder]")
    if len(visuals) > 1:
        raise ValueError(f"the micro-batch holds {len(visuals)} vision dicts "
                         f"({', '.join('/'.join(p) for p, _ in visuals)}): one vision encoder per batch is supported")
    return visuals[0][1] if visuals else None


def _flatten(value, path: str, out: dict) -> None:
    """Write the leaves of `value` into `out` under dotted keys that start with `path`."""
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{path}.{k}" if path else str(k), out)
    else:
        out[path] = value


def _sample_flats(batch: dict, b: int, cu_img) -> list:
    """b per-sample flat dicts in upstream's format: dotted keys; tensors keep their batch dim (size 1;
    dim 1 for [3, B, S] position_ids); sample i's vision rows and grid_thw rows (its images are
    cu_img[i]:cu_img[i + 1], needed only where a vision dict travels); lists of length b as
    one-element lists; everything else as is. Views: nothing is copied."""
    import torch

    flats = [{} for _ in range(b)]

    def fill(d, prefix):
        """Add the fields of (nested) dict `d`, keyed `prefix` + key, to every sample's flat dict."""
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
    """True for one reorder `Collectives` object (all_gather + all_to_all), passed instead of groups."""
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

    cost_of: flat per-sample dict -> cost, finite and >= 0 (see `sample_cost`; a partial of it runs
    vectorized). image_count_of: batch -> B/dp per-sample image counts, adding up to grid_thw's images
    where vision travels (None: one image per sample there).
    dp_group_gloo / dp_group_nccl: from `build_module_dp_process_groups` (or one reorder
    `Collectives` object passed as both). balancer (an addition): "lpt" (default, upstream's plan
    bit for bit) or "balanced" / "identity". verify (an addition): the runtime self-check every N-th
    window (0, the default: off; 1: every window); `verified_windows` / `verified_samples` say what it
    found intact.

    A bad micro-batch, a source that raises or ends early on one rank, or a config that differs
    across the DP group raises the same `ReorderError` (a ValueError) on every rank of the group.
    """

    def __init__(self, data_iterator, *, dp_rank: int, dp_size: int, n_groups: int, cost_of, dp_group_gloo,
                 dp_group_nccl, overlap: bool = True, image_count_of=None, window_size: int = 1,
                 balancer: str = "lpt", verify: int = 0):
        from reorder.exchange.round import check_verify

        check_verify(verify)
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"window_size must be >= 1, got {window_size}.")
        if overlap and dp_size > 1 and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            raise ValueError("ReorderingBuffer overlap=True deadlocks under CUDA_DEVICE_MAX_CONNECTIONS=1 (one "
                             "hardware queue: the overlap thread's all-to-all and the DDP all-reduce can wait on "
                             "each other). Pass overlap=False (--no-overlap-intra-microbatch-reorder) or unset "
                             "the variable.")
        import numpy as np

        from reorder import CostModel, Grid, plan_orders

        self._grid = Grid(size=n_groups, dp=dp_size, rank=dp_rank)
        plan_orders(np.zeros((1, n_groups)), n_groups, balancer)  # an unknown balancer raises here
        model = _vectorized_cost(cost_of)
        self._vectorized = model is not None
        image_counts = _ImageCounts(image_count_of)
        # Every rank of a DP group builds the same hooks from the same arguments, so the config frame
        # (given_costs, given_image_counts) agrees. Image counts always come from the hook: upstream's
        # image_count_of, or its one-image-per-sample fallback. With per-sample costs the cost model
        # only counts (the plan reads the given costs), so its defaults are as good as any.
        self._hooks = dict(cost=model if self._vectorized else CostModel(), image_counts=image_counts,
                           sample_costs=None if self._vectorized else _PerSampleCosts(cost_of, image_counts))
        self._data = iter(data_iterator)
        self._groups = (dp_group_gloo, dp_group_nccl)
        self._window_size, self._balancer, self._verify = window_size, balancer, verify
        self._device = _output_device(dp_size)
        self._overlap = bool(overlap) and dp_size > 1 and self._device is not None
        self._inner = None
        self._ended = False
        self._calibration = None

    # ---- online calibration (an addition: reorder.runtime.calibration) -------------------------

    @property
    def calibration(self):
        """The attached `reorder.runtime.calibration.Calibration`, or None."""
        return self._calibration

    def calibrate(self, calibration) -> None:
        """Attach a `Calibration` before the first next() (`reorder.integrations.calibrate.enable_calibration`
        builds one); without collectives of its own it fits on this module's DP group."""
        if self._inner is not None or self._ended:
            raise RuntimeError("calibrate after iteration started: attach the calibration before the first next()")
        if not self._vectorized:
            raise ValueError("calibration fits the weights of sample_cost: give cost_of as a functools.partial of "
                             "sample_cost (a custom cost_of decides the costs itself, so fitted weights would "
                             "change nothing)")
        self._calibration = calibration

    def timed_step(self):
        """`with buf.timed_step():` around forward + backward of the micro-batch just taken (a no-op
        context without a calibration)."""
        import contextlib

        return contextlib.nullcontext() if self._inner is None else self._inner.timed_step()

    def record_step_ms(self, ms) -> bool:
        """The measured step time (ms) of the micro-batch just taken; False when refused or not calibrating."""
        return False if self._inner is None else self._inner.record_step_ms(ms)

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
        """The latest window's WindowReport, None before the first."""
        return None if self._inner is None else self._inner.last_report

    @property
    def verified_windows(self) -> int:
        """Windows the self-check (`verify`) compared on every rank of the group and found intact."""
        return 0 if self._inner is None else self._inner.verified_windows

    @property
    def verified_samples(self) -> int:
        """The samples of those windows, module-wide."""
        return 0 if self._inner is None else self._inner.verified_samples

    def __iter__(self):
        return self

    def __next__(self):
        """The next reordered micro-batch; StopIteration once the source is exhausted."""
        if self._inner is None:
            if self._ended:
                raise StopIteration
            self._start()
            if self._inner is None:
                raise StopIteration
        return next(self._inner)

    def _start(self) -> None:
        """Build the exchanger once the first micro-batch gives B = local size x dp_size (upstream
        takes B from the data too); an empty source ends the buffer instead."""
        import itertools

        from reorder import ReorderingBuffer as _Buffer
        from reorder import WindowExchanger

        try:
            first = next(self._data)
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

                # metadata over Gloo, on the host. spin 0 on the overlap thread: a busy poll there
                # would hold the GIL the training thread needs; a synchronous exchange polls 0.2 ms
                # first for the lowest latency. The overlap thread meets its peers on Gloo before each
                # all_to_all (`reorder.exchange.dist`: a deadlock otherwise)
                collectives = TorchCollectives(gloo, data, meta_on_device=False,
                                               spin=0.0 if self._overlap else 2e-4, launch_rendezvous=self._overlap)
        ex = WindowExchanger(grid=grid, micro_batch_size=global_batch, balancer=self._balancer,
                             window_size=self._window_size, collectives=collectives, verify=self._verify,
                             device=self._device if grid.dp > 1 else None,
                             early_copy=not self._overlap and grid.dp > 1, **self._hooks)
        if self._calibration is not None and self._calibration.collectives is None and collectives is not None:
            self._calibration.collectives = collectives
        self._inner = _Buffer(itertools.chain([first], self._data), ex, overlap=self._overlap,
                              calibration=self._calibration)

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
