"""Megatron-Core adapter: DP groups from HyperCommGrids, per-rank field selection, one-call `wrap`.

Nothing here imports megatron at module import time (megatron-core >= 0.17 needs Python >= 3.12 and
imports triton); a real `HyperCommGrid` is only duck-typed (`shape`, `dim_names`, `rank_offset`,
`get_rank_enum`). Everything also accepts plain lists of global ranks, so the adapter is usable and
testable without megatron.

Typical use in a MIMO training script (every rank, after the grids exist, before the first step)::

    from reorder.integrations import megatron as rm
    cfg = ReorderConfig.from_object(dataset_config)            # the megatron_mimo_* fields
    fields = rm.fields_to_load(my_module, my_pp_stage, cfg)     # what this rank's loader must read
    it = rm.wrap(it, config=cfg, module=my_module, grids=module_to_grid_map,
                 micro_batch_size=B, fixed_width_padding=True, device=torch.cuda.current_device())

`wrap` is a world-wide collective (it creates process groups): call it on every rank of every module,
in the same order, also where the rank's own DP size is 1.
"""

from __future__ import annotations

import datetime
import warnings
from collections.abc import Mapping, Sequence

import numpy as np

from reorder.integrations.config import ReorderConfig, check_model_layout

LANGUAGE = "language"  # megatron.core.models.mimo.config.role.MIMO_LANGUAGE_MODULE_KEY

# Field names of a Qwen-VL MIMO micro-batch (docs/design.md, Micro-batches).
INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LABELS = "labels"
LOSS_MASK = "loss_mask"
MODALITY_INPUTS = "modality_inputs"


# ---- grids ---------------------------------------------------------------------------------------

def _is_comm_grid(obj) -> bool:
    return hasattr(obj, "shape") and hasattr(obj, "dim_names") and not isinstance(obj, (list, tuple))


def _rank_enum(shape, dim_names, rank_offset: int, dims) -> list:
    """Megatron's HyperCommGrid rank enumeration for `dims` (same algorithm as its
    `_gen_rank_enum`): ranks laid out over reversed dim_names, `dims` moved last, one group per
    coordinate of the other dims."""
    dims = [dims] if isinstance(dims, str) else list(dims)
    rev = list(dim_names)[::-1]
    size_of = dict(zip(dim_names, shape))
    size = int(np.prod(shape))
    t = np.arange(rank_offset, rank_offset + size).reshape([size_of[d] for d in rev])
    # megatron orders requested dims by their position in the reversed dim_names
    ordered = [rev[i] for i in sorted(rev.index(d) for d in dims)]
    src = [rev.index(d) for d in ordered]
    t = np.moveaxis(t, src, list(range(len(rev) - len(ordered), len(rev))))
    group = int(np.prod([size_of[d] for d in ordered]))
    return t.reshape(-1, group).tolist()


def grid_dim(comm_grid, name: str) -> int:
    """Size of dim `name` of a HyperCommGrid-like object (1 when the grid has no such dim)."""
    names = list(comm_grid.dim_names)
    return int(comm_grid.shape[names.index(name)]) if name in names else 1


def rank_enum(comm_grid, dims) -> list:
    """The grid's own enumeration (`get_rank_enum`, megatron-core >= 0.17) or the same algorithm."""
    names = list(comm_grid.dim_names)
    wanted = [dims] if isinstance(dims, str) else list(dims)
    missing = [d for d in wanted if d not in names]
    if missing:
        raise ValueError(f"grid has no dim {missing[0]!r} (dim_names={names})")
    if hasattr(comm_grid, "get_rank_enum"):
        return [list(map(int, g)) for g in comm_grid.get_rank_enum(wanted if len(wanted) > 1 else wanted[0])]
    return _rank_enum(list(comm_grid.shape), names, int(getattr(comm_grid, "rank_offset", 0)), wanted)


def dp_groups_from_grid(comm_grid) -> list:
    """DP groups (lists of global ranks) of one module: one group per tp/cp/pp (and any other)
    coordinate of the grid, each in DP-rank order, exactly as `comm_grid.create_pg("dp")` builds them.

    Accepts a megatron HyperCommGrid (or any object with `shape`, `dim_names`, `rank_offset`), or
    plain lists: a list of DP groups `[[0, 1], [2, 3]]`, or one DP group `[0, 1]`.
    """
    if _is_comm_grid(comm_grid):
        if "dp" not in list(comm_grid.dim_names):
            raise ValueError(f"grid has no 'dp' dim (dim_names={list(comm_grid.dim_names)}): cannot derive DP groups")
        dp_groups = rank_enum(comm_grid, "dp")
    elif isinstance(comm_grid, Sequence) and not isinstance(comm_grid, (str, bytes)):
        items = list(comm_grid)
        if not items:
            raise ValueError("DP rank lists are empty: give one list of global ranks per DP group")
        if all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in items):
            dp_groups = [[int(r) for r in items]]
        elif all(isinstance(g, Sequence) and not isinstance(g, (str, bytes)) for g in items):
            dp_groups = [[_rank(r) for r in g] for g in items]
        else:
            raise ValueError(f"DP rank lists {comm_grid!r}: expected a list of global ranks or a list of such lists")
    else:
        raise ValueError(f"{comm_grid!r} is neither a HyperCommGrid-like object nor a list of DP rank lists")
    sizes = {len(g) for g in dp_groups}
    if 0 in sizes or len(sizes) != 1:
        raise ValueError(f"DP groups {dp_groups} must be non-empty and all of the same size")
    flat = [r for g in dp_groups for r in g]
    if len(set(flat)) != len(flat):
        raise ValueError(f"DP groups {dp_groups} list a rank more than once")
    return dp_groups


def _rank(r) -> int:
    if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0:
        raise ValueError(f"rank {r!r} is not a global rank (integer >= 0)")
    return int(r)


def module_dp_groups(grids: Mapping) -> dict:
    """{module: DP groups} for a module -> grid (or rank lists) map, in the map's order."""
    if not isinstance(grids, Mapping) or not grids:
        raise ValueError("grids must be a non-empty mapping of module name -> HyperCommGrid or DP rank lists")
    return {name: dp_groups_from_grid(g) for name, g in grids.items()}


def pp_stage(comm_grid, rank: int) -> tuple[int, int]:
    """(stage, pp size) of global `rank` in a HyperCommGrid-like grid; (0, 1) for plain lists."""
    if not _is_comm_grid(comm_grid) or "pp" not in list(comm_grid.dim_names):
        return 0, 1
    for g in rank_enum(comm_grid, "pp"):
        if rank in g:
            return g.index(rank), len(g)
    raise ValueError(f"rank {rank} is not in the grid (ranks {comm_grid.rank_offset}.."
                     f"{comm_grid.rank_offset + int(np.prod(comm_grid.shape)) - 1})")


# ---- field selection -----------------------------------------------------------------------------

def fields_to_load(module, pp_stage: int, config, *, pp_size: int = 1, language_module: str = LANGUAGE) -> tuple:
    """Top-level batch fields one rank must load so that the reorder cost is computable there and
    the model gets what it consumes.

    module: this rank's module name (or several names for a colocated rank: the union is returned);
    any name other than `language_module` is an encoder. pp_stage / pp_size: the rank's stage in
    that module's pipeline.

    - input_ids: every module, every stage (the cost counts image placeholders in it);
    - attention_mask: every module and stage when the language cost weight is > 0 (real tokens);
    - modality_inputs: encoder ranks only (stage 0: encoder PP > 1 is rejected by `wrap`);
    - position_ids: language, every stage (MRoPE ids are consumed on every stage);
    - labels, loss_mask: language first and last stage (MimoModel shards/returns them on the first
      stage, the last computes the loss); middle stages skip them.
    """
    cfg = config if isinstance(config, ReorderConfig) else ReorderConfig.from_object(config)
    names = [module] if isinstance(module, str) else list(module)
    if not names:
        raise ValueError("module is empty: give this rank's module name(s)")
    if isinstance(pp_size, bool) or not isinstance(pp_size, int) or pp_size < 1:
        raise ValueError(f"pp_size={pp_size!r}: must be an integer >= 1")
    if isinstance(pp_stage, bool) or not isinstance(pp_stage, int) or not 0 <= pp_stage < pp_size:
        raise ValueError(f"pp_stage={pp_stage!r}: must be an integer in [0, pp_size={pp_size})")
    out = [INPUT_IDS]
    if cfg.needs_attention_mask:
        out.append(ATTENTION_MASK)
    for name in names:
        if name == language_module:
            out.append(POSITION_IDS)
            if pp_stage == 0 or pp_stage == pp_size - 1:
                out += [LABELS, LOSS_MASK]
        else:
            if pp_size > 1:
                raise ValueError(f"module {name!r} is an encoder with pp_size={pp_size}: reorder does not "
                                 f"support a pipeline-parallel vision encoder; set its PP size to 1")
            out.append(MODALITY_INPUTS)
    return tuple(dict.fromkeys(out))


def select_fields(batch: Mapping, fields) -> dict:
    """The entries of `batch` named in `fields` (a loader that cannot skip fields can use this)."""
    return {k: v for k, v in batch.items() if k in fields}


# ---- one-call wrap -------------------------------------------------------------------------------

def check_layout(grids: Mapping, *, pp_sizes: Mapping | None = None, fixed_width_padding,
                 language_module: str = LANGUAGE) -> dict:
    """Validate a module layout for reorder (identical on every rank, so every rank raises together);
    returns {module: DP groups}. Encoder PP comes from each encoder grid's 'pp' dim, or `pp_sizes`.

    Besides reorder's own limits (`check_model_layout`), refuses what megatron-core's MIMO (0.19.2)
    cannot run, before any process group exists: context parallelism (its bridges assert CP 1),
    modules that share some ranks but not all (MimoModel is either colocated or non-colocated),
    colocated modules with different DP groups (ColocatedBridgeCommunicator splits image rows by
    equal counts) and a colocated pipeline-parallel language model (colocated MIMO runs PP 1)."""
    dp_groups = module_dp_groups(grids)
    if language_module not in dp_groups:
        raise ValueError(f"grids has no {language_module!r} module (modules: {list(dp_groups)}): reorder plans "
                         f"against the language model's DP size")
    for name, comm_grid in grids.items():
        cp = grid_dim(comm_grid, "cp") if _is_comm_grid(comm_grid) else 1
        if cp > 1:
            raise ValueError(f"module {name!r} has context-parallel size {cp}: megatron-core's MIMO bridges "
                             f"(BridgeCommunicator between modules, ColocatedBridgeCommunicator within ranks) "
                             f"require CP 1, so the model cannot run; set the {name!r} grid's 'cp' dim to 1 "
                             f"(use TP or PP for the language model instead)")
    _check_colocation(grids, dp_groups, pp_sizes or {}, language_module)
    dl = len(dp_groups[language_module][0])
    pp_sizes = dict(pp_sizes or {})
    encoders = [m for m in dp_groups if m != language_module]
    if not encoders:
        check_model_layout(encoder_pp=1, encoder_dp=dl, language_dp=dl, fixed_width_padding=fixed_width_padding)
    for name in encoders:
        comm_grid = grids[name]
        pp = pp_sizes.get(name, grid_dim(comm_grid, "pp") if _is_comm_grid(comm_grid) else 1)
        check_model_layout(encoder_pp=pp, encoder_dp=len(dp_groups[name][0]), language_dp=dl,
                           fixed_width_padding=fixed_width_padding)
    return dp_groups


def _module_ranks(dp_groups: list) -> list:
    return sorted(r for g in dp_groups for r in g)


def _check_colocation(grids: Mapping, dp_groups: dict, pp_sizes: Mapping, language_module: str) -> None:
    """Modules either share all their ranks (colocated: then the same DP groups, language PP 1) or none."""
    names = list(dp_groups)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            ra, rb = _module_ranks(dp_groups[a]), _module_ranks(dp_groups[b])
            shared = sorted(set(ra) & set(rb))
            if not shared:
                continue
            if ra != rb:
                raise ValueError(f"modules {a!r} (ranks {_span(ra)}) and {b!r} (ranks {_span(rb)}) share ranks "
                                 f"{_span(shared)} but not all of them: megatron-core's MimoModel runs either "
                                 f"colocated (every module on the same ranks) or non-colocated (disjoint ranks); "
                                 f"give both modules the same ranks or disjoint ones")
            if sorted(map(sorted, dp_groups[a])) != sorted(map(sorted, dp_groups[b])):
                raise ValueError(f"colocated modules {a!r} and {b!r} have different DP groups ({a!r}: "
                                 f"{dp_groups[a]}, {b!r}: {dp_groups[b]}): megatron-core's "
                                 f"ColocatedBridgeCommunicator splits the encoder's image-token rows into equal "
                                 f"shares per DP rank (it assumes one token count per sample), so variable image "
                                 f"sizes would reach other samples' placeholders, and each rank would need one "
                                 f"micro-batch stream per module; give the encoder the language model's TP and DP "
                                 f"sizes, or place it on its own ranks")
            for name in (a, b):
                comm_grid = grids[name]
                pp = pp_sizes.get(name, grid_dim(comm_grid, "pp") if _is_comm_grid(comm_grid) else 1)
                if name == language_module and pp > 1:
                    raise ValueError(f"module {name!r} has pipeline-parallel size {pp} colocated with "
                                     f"{(set((a, b)) - {name}).pop()!r}: megatron-core's colocated MimoModel runs "
                                     f"every module on every rank with PP 1 (ColocatedBridgeCommunicator requires "
                                     f"PP 1); place the encoder on its own ranks (non-colocated) to pipeline the "
                                     f"language model")


def _span(ranks: list) -> str:
    """'0..3' for consecutive ranks, else the list."""
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}..{ranks[-1]}"
    return str(ranks)


def wrap(data_iterator, *, config, module: str, grids: Mapping, micro_batch_size: int | None = None,
         fixed_width_padding, device=None, pp_sizes: Mapping | None = None, language_module: str = LANGUAGE,
         data_backend: str | None = None, timeout: datetime.timedelta = datetime.timedelta(minutes=5),
         log_every: int = 0, log_all_ranks: bool = False, rank: int | None = None,
         global_batch: int | None = None):
    """Turn this rank's micro-batch iterator into a ReorderingBuffer; with reordering off, into a
    PassThroughBuffer that yields the micro-batches unchanged. Both are iterators and context managers
    (`with wrap(...) as batches:`; `close()` stops the overlap thread). A rank that loads nothing
    passes None and gets None back when reordering is off (Megatron tests `data_iterator is not None`).

    data_iterator: this rank's micro-batch iterator, or, to be able to resume, a factory
      `consumed_samples -> iterable` that builds it from that many consumed global samples on (e.g. a
      DataLoader over a CanonicalBatchSampler built with `consumed_samples=`); it is called at the
      first `next()`. The result's `state_dict()` counts what training consumed (micro-batches served,
      not those the loader or the overlap thread read ahead); `load_state_dict(state)` before the first
      `next()` resumes there (torch.distributed.checkpoint's Stateful protocol).
    config: a ReorderConfig, or any object / mapping carrying the `megatron_mimo_*` fields.
    module: the module whose DP group this iterator feeds (a colocated rank passes either name: its
      modules must then share DP groups). grids: {module: HyperCommGrid or DP rank lists} for every
      module of the model (e.g. MimoModelConfig.module_to_grid_map) - the same on every rank.
    micro_batch_size: B, samples per GLOBAL micro-batch (a multiple of G = lcm of the DP sizes), as
      Megatron-Bridge's canonical MIMO sampler calls it; each rank's iterator yields its contiguous
      B/dp share (scalable reads, CanonicalBatchSampler). `global_batch=` is its deprecated name.
    fixed_width_padding: must be True (samples padded to one sequence length); False is refused.
    device: where the rank's batches live (CUDA -> NCCL payload exchange).
    log_every: every N windows, log a metrics line to the logger "reorder" (INFO) naming the module
      and the DP rank, from DP rank 0 of each module (every rank with log_all_ranks).

    With `megatron_mimo_reorder_calibrate` shadow or on, the buffer calibrates its cost model online
    (`buf.calibration`; time each step with `buf.timed_step()` or `buf.record_step_ms(ms)`): its fit
    group spans every rank of every module (a Gloo group `wrap` creates), so every module switches
    its weights at the same window.

    Rejects (`check_layout`) encoder PP > 1, encoder dp > language dp, language dp not a multiple of
    encoder dp, no fixed-width padding, context parallelism, modules sharing only some ranks, colocated
    modules with different DP groups, and a colocated language model with PP > 1.
    """
    micro_batch_size = _micro_batch_size(micro_batch_size, global_batch)
    cfg = config if isinstance(config, ReorderConfig) else ReorderConfig.from_object(config)
    if not cfg.enabled:
        from reorder.runtime.buffer import PassThroughBuffer

        return None if data_iterator is None else PassThroughBuffer(data_iterator, micro_batch_size=micro_batch_size)
    import torch
    import torch.distributed as dist

    from reorder.exchange.dist import build_groups
    from reorder.exchange.exchanger import WindowExchanger
    from reorder.runtime.buffer import ReorderingBuffer

    dp_groups = check_layout(grids, pp_sizes=pp_sizes, fixed_width_padding=fixed_width_padding,
                             language_module=language_module)
    if module not in dp_groups:
        raise ValueError(f"module={module!r} is not in grids (modules: {list(dp_groups)})")
    me = dist.get_rank() if rank is None else rank
    _check_dp_group(dp_groups, module, me)
    if data_iterator is None:
        raise ValueError(f"data_iterator is None on rank {me} (module {module!r}) but reorder is on: every "
                         f"rank must load at least input_ids (see fields_to_load) to compute the cost")
    dev = None if device is None else torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    rg = build_groups(dp_groups, device=dev, data_backend=data_backend, overlap=cfg.overlap, timeout=timeout)
    ex = WindowExchanger(grid=rg.grid, micro_batch_size=micro_batch_size, device=dev, **cfg.exchanger_settings(),
                         collectives=rg.side if cfg.overlap else rg.main, early_copy=not cfg.overlap)
    cal = None if cfg.calibrate == "off" else _calibration(cfg, dp_groups, module, timeout)
    return ReorderingBuffer(data_iterator, ex, overlap=cfg.overlap, log_every=log_every,
                            ahead=cfg.overlap_ahead, log_module=module, log_all_ranks=log_all_ranks, calibration=cal)


def _calibration(cfg: ReorderConfig, dp_groups: dict, module: str, timeout):
    """The config's online calibration (`megatron_mimo_reorder_calibrate*`) on a fit group spanning
    every rank of every module (a Gloo group of its own, created on every rank like the DP groups,
    before the overlap worker starts): every module fits the same rows and switches at the same
    window, so the plans stay identical. `tag` is the module's index in `grids`."""
    import torch.distributed as dist

    from reorder.exchange.dist import TorchCollectives
    from reorder.runtime.calibration import Calibration

    ranks = sorted({r for groups in dp_groups.values() for g in groups for r in g})
    group = dist.new_group(ranks, backend="gloo", timeout=timeout)
    return Calibration(collectives=TorchCollectives(group, group), tag=list(dp_groups).index(module),
                       **cfg.calibration_settings())


def _micro_batch_size(micro_batch_size: int | None, global_batch: int | None) -> int:
    """`wrap`'s B from micro_batch_size= or its deprecated name global_batch= (a warning)."""
    if global_batch is not None:
        warnings.warn("wrap(global_batch=...) is deprecated: use micro_batch_size= (Megatron's name for the "
                      "global micro-batch)", DeprecationWarning, stacklevel=3)
        if micro_batch_size is not None and micro_batch_size != global_batch:
            raise TypeError(f"wrap() got micro_batch_size={micro_batch_size} and global_batch={global_batch}: "
                            "give micro_batch_size only")
        micro_batch_size = global_batch
    if micro_batch_size is None:
        raise TypeError("wrap() missing keyword argument 'micro_batch_size' (B, samples per global micro-batch)")
    return micro_batch_size


def _check_dp_group(dp_groups: dict, module: str, me: int) -> None:
    """Global rank `me` is in a DP group of `module` and, colocated, in the same one in the first
    module listing it (build_groups serves that one)."""
    mine = [g for g in dp_groups[module] if me in g]
    if not mine:
        raise ValueError(f"rank {me} is in no DP group of module {module!r}: {dp_groups[module]}")
    for other, gl in dp_groups.items():
        theirs = [g for g in gl if me in g]
        if theirs and sorted(theirs[0]) != sorted(mine[0]):
            raise ValueError(f"rank {me} is in module {other!r} with DP group {theirs[0]} and in {module!r} with "
                             f"{mine[0]}: a colocated rank whose modules have different DP groups needs one "
                             f"iterator per module, which wrap does not support")
        if theirs:
            break
