"""Real-model functional suite: a tiny Qwen-like Megatron-Core MIMO model (random weights) trained
with and without reorder.

Model (megatron-core >= 0.17, no Transformer Engine, no apex, fp32, dropout 0): a patch encoder
(linear patch embedding + one local-spec TransformerBlock with per-image block-diagonal attention +
2x2 spatial merge) -> MultimodalProjector (MLP) -> GPTModel (local spec, MRoPE, position_ids
[3, B, S]) inside MimoModel with a module_to_grid_map. Data: reorder.cli.synthetic Qwen-VL samples (0-4
images of variable size, fixed-width padding), read through reorder's CanonicalBatchSampler
(cyclic, scalable reads: rank r reads its contiguous 1/dp share) and wrapped with
`reorder.integrations.megatron.wrap`. The encoder is per-image (sample-local), so reordering changes which rank
runs a sample, never its activations.

Layouts: colocated (default: both modules on every rank, dp = world; --language-tp T: both modules on
one grid tp T x dp world/T) or non-colocated with --encoder-dp E --language-dp L (L a multiple of E),
optionally --encoder-tp, --language-tp, --language-pp: the encoder on the first ranks (tp x dp E), the
language model after them (tp x pp x dp L), reorder's canonical grid G = lcm(E, L) = L, and the real
MultiModulePipelineCommunicator 1F1B schedule: BridgeCommunicator from the encoder to the first language
stage (fan-out by position: encoder replica v's micro-batch feeds language replicas v*k..v*k+k-1, k = L /
E, split per sample; each side broadcasts over its TP group), P2P between language stages. Reorder runs
per DP group (one per tp/pp coordinate); every TP peer and every stage loads input_ids and plans alike.
The TP/PP layouts of ci/gpu_mimo.sh (MIMO_SET=tp_pp): colocated tp 2 x dp 2 (4 ranks); encoder dp 2 +
language tp 2 x dp 2 (6); encoder dp 2 + language pp 2 x dp 2 (6); encoder tp 2 x dp 2 + language dp 4
(8); encoder tp 2 x dp 1 + language pp 3 x dp 2 (8: encoder TP, fan-out, a middle stage). What megatron-
core's MIMO (0.19.2) cannot run (CP > 1, encoder PP > 1, a colocated language PP > 1, colocated modules
with different TP/DP, modules sharing only some ranks) is refused by `wrap` (`check_layout`).

Tests (launch with torchrun; every rank runs the same test):
  parity     colocated: reorder off vs on, iteration-1 loss difference, per-micro-batch image
             token sums over ranks, then --iters iterations: loss curves within --tolerance
  resume     either layout, reorder on: checkpoint after k iterations (model, optimizer, and the
             state of the buffer wrap returns: what training consumed), resume in fresh objects with
             the data source rebuilt from it, next iterations must equal the continuous run bit for bit
  soak       either layout: --iters iterations per combo of --windows x --overlaps x --weights;
             sample accounting exact (every sample of every global micro-batch seen once, on the rank
             the reference plan says, in every DP group of every module), no hang, no error; with
             CUDA_DEVICE_MAX_CONNECTIONS=1 on CUDA, overlap must be refused first
  noncoloc   non-colocated, E = L = 1 unless given (grid 1: a local permutation); hetero: the same test,
  hetero     E = 2, L = 4 unless given. Reorder off vs on: every sample's image embeddings arrive at that
             sample's placeholders (per-sample checksums, encoder output vs language input), both modules
             hold the reference plan's order, the losses agree; a control run where only the language
             ranks reorder must show mismatches; then `resume` with reorder on
  --device cpu runs every test on Gloo with small CPU shims (debugging only: megatron hard-codes CUDA and
  NCCL in a few places, which the shims redirect).
Every test's accounting (`check_accounting`) also checks, micro-batch by micro-batch, that the ranks of
each TP group held byte-identical micro-batches (a digest of every field) and that the stages of each
PP group held the same sample order (and token fields).
Every rank prints one `RESULT {json}` line at the end (rank 0's is the summary).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import faulthandler
import functools
import hashlib
import json
import math
import os
import signal
import sys
import tempfile
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import init_torchrun  # noqa: E402
from reorder.integrations import megatron as rm  # noqa: E402
from reorder.cli import synthetic as syn  # noqa: E402
from reorder.integrations.config import ReorderConfig  # noqa: E402
from reorder.integrations.sampler import CanonicalBatchSampler  # noqa: E402
from spec import reference as ref  # noqa: E402

warnings.filterwarnings("ignore")
ENC, VIT, LANG = "images", "vit", "language"
VOCAB = 1024  # model vocabulary: synthetic text ids are folded into it (image placeholders keep their id)


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


# ---- data ------------------------------------------------------------------------------------------

class Dataset:
    """Map-style dataset of synthetic Qwen-VL samples; sample i is a pure function of (seed, i)."""

    def __init__(self, n, seq_len, features, mix, scale, seed):
        self.n, self.seq_len, self.features, self.mix, self.scale, self.seed = n, seq_len, features, mix, scale, seed
        self._cache = {}

    def __len__(self):
        return self.n

    def tokens(self, i):
        return self[i]["input_ids"][0].tolist()

    def mask(self, i):
        return self[i]["attention_mask"][0].tolist()

    def __getitem__(self, i):
        s = self._cache.get(i)
        if s is None:
            rng = np.random.default_rng([self.seed, i])
            s = syn.make_global_batch(rng, 1, self.seq_len, features=self.features, dtype=torch.float32,
                                      mix=self.mix, scale=self.scale, first_id=i)
            self._cache[i] = s
        return s


def collate(samples):
    out = {k: torch.cat([s[k] for s in samples]) for k in
           ("input_ids", "labels", "loss_mask", "attention_mask", "sample_id")}
    out["position_ids"] = torch.cat([s["position_ids"] for s in samples], dim=1)
    vit = [s["modality_inputs"]["images"]["vit"] for s in samples]
    out["modality_inputs"] = {ENC: {VIT: {"hidden_states": torch.cat([v["hidden_states"] for v in vit]),
                                           "grid_thw": torch.cat([v["grid_thw"] for v in vit])}}}
    return out


def rank_source(ds, sampler, fields, device):
    """This rank's micro-batches (its contiguous share of each global micro-batch), epoch after epoch."""
    keep = tuple(fields) + ("sample_id",)
    while True:
        for idx in sampler:
            b = rm.select_fields(collate([ds[i] for i in idx]), keep)
            yield syn.to_device(b, device)


def model_inputs(mb):
    """MimoModel.forward kwargs from a (reordered) micro-batch: fold text ids into VOCAB, labels likewise,
    loss only on real text tokens."""
    ids = mb["input_ids"]
    out = {"input_ids": torch.where(ids == syn.IMAGE_TOKEN, ids, ids % VOCAB)}
    if "position_ids" in mb:
        out["position_ids"] = mb["position_ids"]
    if "labels" in mb:
        lab = mb["labels"]
        valid = lab != -100
        out["labels"] = torch.where(valid, lab % VOCAB, 0)
        out["loss_mask"] = mb["loss_mask"] * valid
    if "modality_inputs" in mb:
        out["modality_inputs"] = mb["modality_inputs"]
    return out


# ---- model -----------------------------------------------------------------------------------------

def cpu_shims():
    """Let megatron's local-spec modules run on CPU (debugging only): a CPU global memory buffer, a no-op
    CUDA RNG tracker, and 'cpu' as the current CUDA device."""
    from megatron.core import parallel_state, tensor_parallel

    class Buf:
        def get_tensor(self, shape, dtype, name, mem_alloc_context=None):
            return torch.empty(shape, dtype=dtype)

    class Tracker:
        def fork(self, *a, **k):
            return contextlib.nullcontext()

    parallel_state.get_global_memory_buffer = lambda: Buf()
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: Tracker()
    torch.cuda.current_device = lambda: "cpu"  # megatron allocates some buffers on the current device
    import megatron.core.fusions.fused_softmax as fused_softmax
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)
    import megatron.core.pipeline_parallel.schedules as schedules

    class CpuTorch:  # the schedule allocates a counter with device="cuda"
        def __getattr__(self, name):
            attr = getattr(torch, name)
            if name in ("zeros", "ones", "tensor", "empty", "full"):
                return lambda *a, **k: attr(*a, **{**k, "device": "cpu"} if k.get("device") == "cuda" else k)
            return attr

    schedules.torch = CpuTorch()
    torch.cuda.synchronize = lambda *a, **k: None  # megatron's P2P (language PP) synchronizes after batched sends
    for name in ("new_group", "new_subgroups_by_enumeration"):  # megatron asks for NCCL in places
        orig = getattr(dist, name)
        setattr(dist, name, lambda *a, _orig=orig, **k: _orig(*a, **{**k, "backend": "gloo"}))


def make_comm_grid(offset, dp, backend, tp=1, pp=1):
    """A module's HyperCommGrid: tp x pp x dp ranks from `offset` (tp varies fastest, then pp, then dp)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    comm_grid = HyperCommGrid([tp, 1, pp, dp, 1, 1], ["tp", "cp", "pp", "dp", "ep", "expt_dp"], rank_offset=offset,
                              backend=backend)
    for dims in (["tp"], ["cp"], ["pp"], ["dp"], ["dp", "cp"], ["ep"], ["expt_dp"], ["tp", "pp"]):
        comm_grid.create_pg(dims)
    return comm_grid


def pg_collection(comm_grid, embd_groups):
    from megatron.core.process_groups_config import ProcessGroupCollection

    pg = ProcessGroupCollection()
    pg.tp, pg.cp, pg.pp = comm_grid.get_pg("tp"), comm_grid.get_pg("cp"), comm_grid.get_pg("pp")
    pg.ep, pg.dp, pg.dp_cp = comm_grid.get_pg("ep"), comm_grid.get_pg("dp"), comm_grid.get_pg(["dp", "cp"])
    pg.expt_dp = comm_grid.get_pg("expt_dp")
    pg.pos_embd, pg.embd = embd_groups.get(comm_grid.rank_offset, (None, None))
    return pg


def embedding_groups(grids):
    """pos_embd / embd groups per grid: one group per rank (the output layer is not tied to the embedding,
    so a pipeline's first and last stage share nothing); world-wide, same order everywhere."""
    out = {}
    for comm_grid in grids:
        if comm_grid.rank_offset in out:
            continue
        ranks = list(range(comm_grid.rank_offset, comm_grid.rank_offset + comm_grid.size))
        own = [dist.new_group(ranks=[r]) for r in ranks]
        me = dist.get_rank()
        mine = own[ranks.index(me)] if me in ranks else None
        out[comm_grid.rank_offset] = (mine, mine)
    return out


def build_model(args, enc_grid, lang_grid, embd, device):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.mimo.config.base_configs import MimoModelConfig
    from megatron.core.models.mimo.model.base import MimoModel
    from megatron.core.models.mimo.submodules.vision import VisionModalitySubmodules
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlock
    from megatron.core.transformer.transformer_config import TransformerConfig

    common = dict(use_cpu_initialization=True, variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
                  pipeline_dtype=torch.float32, bf16=False, params_dtype=torch.float32, attention_dropout=0.0,
                  hidden_dropout=0.0, bias_activation_fusion=False, masked_softmax_fusion=False,
                  persist_layer_norm=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
                  bias_dropout_fusion=False)
    enc_tp = rm.grid_dim(enc_grid, "tp")
    lang_tp, lang_pp = rm.grid_dim(lang_grid, "tp"), rm.grid_dim(lang_grid, "pp")
    me = dist.get_rank()
    in_lang = lang_grid.rank_offset <= me < lang_grid.rank_offset + lang_grid.size
    stage = rm.pp_stage(lang_grid, me)[0] if in_lang else 0  # this rank's language stage (its layers, pre/post)
    h = args.hidden
    lm_cfg = TransformerConfig(num_layers=args.lm_layers, hidden_size=h, num_attention_heads=4, ffn_hidden_size=2 * h,
                               mrope_section=[h // 16, h // 32, h // 32], tensor_model_parallel_size=lang_tp,
                               pipeline_model_parallel_size=lang_pp, **common)
    enc_parallel = dict(tensor_model_parallel_size=enc_tp, pipeline_model_parallel_size=1)
    vis_cfg = TransformerConfig(num_layers=1, hidden_size=args.vision_hidden, num_attention_heads=2,
                                ffn_hidden_size=2 * args.vision_hidden, **enc_parallel, **common)
    proj_cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=enc_tp, ffn_hidden_size=h,
                                 activation_func=torch.nn.functional.gelu, **enc_parallel, **common)

    class PatchEncoder(MegatronModule):
        """Flat patches [sum P, F] + grid_thw -> merged tokens [sum P / 4, 4 * Hv]; attention stays inside
        each image (block-diagonal mask), so every image's output depends on that image alone."""

        def __init__(self, config, in_features, pg_collection):
            super().__init__(config=config)
            self.patch_embed = torch.nn.Linear(in_features, config.hidden_size)
            self.block = TransformerBlock(config=config, spec=get_gpt_layer_local_spec(), pg_collection=pg_collection,
                                          pre_process=True, post_process=True)

        def forward(self, hidden_states, grid_thw):
            x = self.patch_embed(hidden_states)
            n = x.shape[0]
            if n:
                counts = grid_thw.prod(-1).to(x.device)
                seg = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts)
                mask = (seg[:, None] != seg[None, :])[None, None]
                x = self.block(hidden_states=x.unsqueeze(1), attention_mask=mask).squeeze(1)
            return x.reshape(n // 4, 4 * x.shape[-1])

    lang_pg = pg_collection(lang_grid, embd)
    vis_pg = pg_collection(enc_grid, embd)
    lm_spec = ModuleSpec(module=GPTModel, params=dict(
        config=lm_cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
        max_sequence_length=args.seq_len, pre_process=stage == 0, post_process=stage == lang_pp - 1,
        position_embedding_type="mrope", pg_collection=lang_pg))
    enc_spec = ModuleSpec(module=PatchEncoder, params=dict(config=vis_cfg, in_features=args.features,
                                                           pg_collection=vis_pg))
    proj_spec = ModuleSpec(module=MultimodalProjector, params=dict(
        config=proj_cfg, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
        projector_type="mlp", input_size=4 * args.vision_hidden, tp_group=vis_pg.tp))
    vis_spec = ModuleSpec(module=VisionModalitySubmodules, params={"pg_collection": vis_pg},
                          submodules={"encoders": {VIT: enc_spec}, "input_projections": [proj_spec]})
    cfg = MimoModelConfig(language_model_spec=lm_spec, modality_submodules_spec={ENC: vis_spec},
                          special_token_ids={ENC: syn.IMAGE_TOKEN},
                          module_to_grid_map={ENC: enc_grid, LANG: lang_grid})
    torch.manual_seed(args.seed)
    model = MimoModel(cfg).to(device)
    return model


# ---- layouts ---------------------------------------------------------------------------------------

def megatron_init(args):
    """Megatron's process-wide state that the local-spec modules need (the CPU shims, or on CUDA the
    global memory buffer and the model-parallel RNG tracker); returns this rank's device."""
    if args.device == "cpu":
        cpu_shims()
        return torch.device("cpu")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state._set_global_memory_buffer()
    model_parallel_cuda_manual_seed(args.seed, tp_rank=0, ep_rank=0, etp_rank=0)
    return torch.device("cuda", torch.cuda.current_device())  # init_torchrun's rank_device


def describe(tp, pp, dp):
    """'dp 2', 'tp 2 x dp 2', 'tp 2 x pp 2 x dp 2': a module's parallel sizes (TP and PP named when > 1)."""
    return " x ".join([f"tp {tp}"] * (tp > 1) + [f"pp {pp}"] * (pp > 1) + [f"dp {dp}"])


def layout_sizes(args, world):
    """{module: (offset, tp, pp, dp)} of the layout the arguments ask for (module ENC, LANG)."""
    if args.encoder_dp is None:  # colocated: both modules on every rank, one grid shape (check_layout)
        tp = args.language_tp
        if world % tp:
            raise SystemExit(f"--language-tp {tp} does not divide the world ({world} ranks)")
        return {ENC: (0, tp, 1, world // tp), LANG: (0, tp, 1, world // tp)}
    enc = (0, args.encoder_tp, 1, args.encoder_dp)
    lang = (args.encoder_tp * args.encoder_dp, args.language_tp, args.language_pp, args.language_dp)
    need = enc[1] * enc[3] + lang[1] * lang[2] * lang[3]
    if need != world:
        raise SystemExit(f"encoder {describe(*enc[1:])} + language {describe(*lang[1:])} needs {need} ranks, "
                         f"the world has {world}")
    return {ENC: enc, LANG: lang}


def setup(args):
    """Model, grids, data and process groups of the layout the arguments ask for, as the dict `env`
    that every test and `Run` read.

    Colocated (no --encoder-dp): both modules on every rank, on one grid tp T x dp world/T
    (--language-tp T; megatron's colocated MIMO runs PP 1, and reorder needs both modules on the same
    DP groups), G = dp.
    Non-colocated (--encoder-dp E [--encoder-tp], --language-dp L [--language-tp, --language-pp]): the
    encoder on the first ranks (tp x dp E), the language model after them (tp x pp x dp L), G = lcm(E, L)
    = L; training runs megatron's 1F1B schedule, whose MultiModulePipelineCommunicator hands the
    encoder output to the first language stage through BridgeCommunicator (between DP replicas'
    leaders, fan-out by position: encoder replica v feeds language replicas v*k..v*k+k-1, k = L / E,
    split per sample; each side broadcasts over its TP group) and the language stages to each other
    through P2P.

    env keys: model, init_state, device, ds, tmp; grids {module: HyperCommGrid} (what `wrap` gets);
    module (this rank's module) and loads (the modules whose fields it reads); dp, dp_rank, dp_group
    (this rank's module); pp_stage, pp_size (this rank's language stage; 0, 1 elsewhere); recorder
    (TP rank 0: records the per-sample checksums); loss_rank (a last-stage language rank); groups (G);
    dp_groups, tp_groups, pp_groups {module: global ranks of each group, in group order} (colocated:
    the language module's only); pipeline (None, or the schedule's communicator and process groups);
    gloo (a world-wide Gloo group)."""
    device = megatron_init(args)
    world, me = dist.get_world_size(), dist.get_rank()
    backend = "gloo" if args.device == "cpu" else "nccl"
    colocated = args.encoder_dp is None
    sizes = layout_sizes(args, world)
    grids = {m: make_comm_grid(off, dp, backend, tp=tp, pp=pp) for m, (off, tp, pp, dp) in sizes.items()}
    enc_grid, lang_grid = grids[ENC], grids[LANG]
    embd = embedding_groups([enc_grid, lang_grid])
    model = build_model(args, enc_grid, lang_grid, embd, device)
    module = LANG if colocated or me >= sizes[LANG][0] else ENC
    mine = grids[module]
    listed = [LANG] if colocated else [ENC, LANG]
    dp_groups = {m: rm.dp_groups_from_grid(grids[m]) for m in listed}
    tp_groups = {m: rm.rank_enum(grids[m], "tp") for m in listed}
    pp_groups = {m: rm.rank_enum(grids[m], "pp") for m in listed}
    my_dp = next(g for g in dp_groups[module] if me in g)
    my_tp = next(g for g in tp_groups[module] if me in g)
    stage, pp_size = rm.pp_stage(mine, me)
    (_, etp, _, e), (_, ltp, lpp, l) = sizes[ENC], sizes[LANG]
    env = {"model": model, "init_state": copy.deepcopy(model.state_dict()), "device": device, "grids": grids,
           "module": module, "loads": [ENC, LANG] if colocated else [module],
           "dp": len(my_dp), "dp_rank": sorted(my_dp).index(me), "dp_group": mine.get_pg("dp"),
           "pp_stage": stage, "pp_size": pp_size, "recorder": my_tp.index(me) == 0,
           "loss_rank": pp_groups[LANG][0][-1], "groups": math.lcm(e, l),
           "dp_groups": dp_groups, "tp_groups": tp_groups, "pp_groups": pp_groups,
           "layout": (f"colocated {describe(ltp, 1, l)}" if colocated else
                      f"encoder {describe(etp, 1, e)} + language {describe(ltp, lpp, l)}"),
           "pipeline": None, "gloo": dist.new_group(backend="gloo"),
           "ds": Dataset(args.dataset, args.seq_len, args.features, args.mix, args.scale, args.seed),
           "tmp": tempfile.mkdtemp(prefix="mimo_suite_")}
    if not colocated:
        from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
        from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

        pgc = MultiModuleProcessGroupCollection(module_pgs={module: pg_collection(mine, embd)},
                                                language_model_module_name=LANG if module == LANG else None)
        comm = MultiModulePipelineCommunicator(grids, {ENC: [LANG], LANG: []}, model.config,
                                               dim_mapping={"s": 0, "h": 2, "b": 1}, module_output_ndim={ENC: 2})
        env["pipeline"] = {"communicator": comm, "pg_collection": pgc}
    # the DP replicas of each module (the same TP shard and stage) must start from the same weights
    # (megatron builds only this rank's modules and stage)
    every = gather((module, tuple(my_dp), sum(float(p.double().sum()) for p in model.parameters())))
    for m, groups in dp_groups.items():
        for g in groups:
            sums = {every[r][2] for r in g}
            assert len(sums) == 1, f"{m} DP group {g} starts from different weights: {[every[r] for r in g]}"
    log(f"model: {env['layout']}, rank 0 holds {sum(p.numel() for p in model.parameters())} parameters on {device}")
    return env


# ---- one training run ------------------------------------------------------------------------------

class Run:
    """One training run on env's layout: model reset to the initial weights, fresh Adam, fresh data
    pipeline (this rank's share of every global micro-batch, through `wrap`).

    step() trains one iteration of --micro-batches micro-batches: colocated, forward and backward one
    micro-batch after the other; non-colocated, megatron's 1F1B schedule across the bridge. The loss
    of a micro-batch is its token-loss sum over the language DP group divided by its token count over
    the group, so any split of the same samples over ranks gives the same loss up to summation order;
    gradients are summed over each module's DP group. `losses` is the same list on every rank.

    checksums=True records per-sample image-embedding sums, (sample id, sum) pairs: the encoder's
    projected output per sample (`sums["encoder"]`, encoder ranks) and what the language model
    received at that sample's placeholders (`sums["language"]`, language ranks).
    tolerate_misrouting=True (the misaligned control) lets a language rank whose placeholder count
    differs from the rows the bridge delivered go on (rows cut or zero-padded to the count, the micro-
    batch counted in `misrouted`): megatron would raise there and leave the other ranks hanging."""

    def __init__(self, args, env, cfg: ReorderConfig, *, iters, state=None, checksums=False,
                 tolerate_misrouting=False):
        self.args, self.env, self.cfg = args, env, cfg
        model = env["model"]
        model.load_state_dict(env["init_state"])
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.opt = torch.optim.Adam(self.params, lr=args.lr)
        fields = rm.fields_to_load(env["loads"], env["pp_stage"], cfg, pp_size=env["pp_size"])

        def source(consumed_samples):  # this rank's micro-batches from `consumed_samples` on
            sampler = CanonicalBatchSampler(len(env["ds"]), args.global_batch, data_parallel_size=env["dp"],
                                            data_parallel_rank=env["dp_rank"], grid_size=env["groups"],
                                            dataloader_type="cyclic", seed=args.seed,
                                            consumed_samples=consumed_samples)
            return rank_source(env["ds"], sampler, fields, env["device"])

        self.it = rm.wrap(source, config=cfg, module=env["module"], grids=env["grids"],
                          micro_batch_size=args.global_batch, fixed_width_padding=True, device=env["device"],
                          timeout=datetime.timedelta(seconds=120))
        if state is not None:
            model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.it.load_state_dict(state["data"])  # the source is built from its consumed_samples
        self.iters = iters
        self.losses, self.ids, self.img_tokens, self.digests = [], [], [], []
        self.sums, self.misrouted, self.current, self._undo = {"encoder": [], "language": []}, 0, None, []
        if checksums:
            self._record_checksums()
        if tolerate_misrouting:
            self._tolerate_misrouting()

    def step(self):
        for p in self.params:
            p.grad.zero_()
        total = self._pipeline_iteration() if self.env["pipeline"] else self._colocated_iteration()
        if self.env["dp"] > 1:
            grads = [p.grad for p in self.params]
            flat = torch._utils._flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.env["dp_group"])
            for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
                g.copy_(r)
        self.opt.step()
        self.losses.append(total)
        return total

    def train(self):
        for _ in range(self.iters):
            self.step()
        return self

    def checkpoint(self):
        return {"model": copy.deepcopy(self.env["model"].state_dict()),
                "optimizer": copy.deepcopy(self.opt.state_dict()),
                "data": self.it.state_dict()}  # what training consumed, not what the loader read ahead

    def close(self):
        self.it.close()
        for undo in self._undo:
            undo()

    # -- one iteration ---------------------------------------------------------------------------
    def _forward_step(self, data_iterator, model):
        """Megatron's forward_step_func: the next micro-batch through the model; (output, loss_func)."""
        mb = next(data_iterator)
        host = on_host(mb)  # one copy: every host sync waits for this rank's turn on a shared GPU
        self.ids.append(host["sample_id"].tolist())
        self.digests.append(field_digests(host))
        self.img_tokens.append(int((host["input_ids"] == syn.IMAGE_TOKEN).sum()))
        self.current = mb  # the checksum hooks pair the outputs with its sample ids
        out, loss_mask = model(**model_inputs(mb))
        return out, functools.partial(self._loss, loss_mask)

    def _loss(self, loss_mask, output_tensor):
        """(this rank's token-loss sum / the micro-batch's token count over the language DP group,
        {"loss": the micro-batch's mean token loss over the group}); the report is a fresh tensor since
        the schedule divides the first in place."""
        local = (output_tensor.float() * loss_mask).sum()
        both = torch.stack([loss_mask.sum().detach().to(local.dtype), local.detach()])  # one all-reduce, not two
        dist.all_reduce(both, group=self.env["dp_group"])
        count, s = both[0], both[1]
        return local / count, {"loss": s / count}

    def _colocated_iteration(self):
        n, total = self.args.micro_batches, 0.0
        for _ in range(n):
            out, loss_func = self._forward_step(self.it, self.env["model"])
            loss, report = loss_func(out)
            (loss / n).backward()
            total += float(report["loss"]) / n
        return total

    def _pipeline_iteration(self):
        import megatron.core.pipeline_parallel.schedules as schedules

        args, env = self.args, self.env
        res = schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=self._forward_step, data_iterator=self.it, model=[env["model"]],
            num_microbatches=args.micro_batches, seq_length=args.seq_len, micro_batch_size=args.global_batch,
            forward_only=False, p2p_communicator=env["pipeline"]["communicator"],
            pg_collection=env["pipeline"]["pg_collection"])
        # the reports exist on the last language stage: every rank gets the first such rank's loss
        total = torch.tensor([sum(float(r["loss"]) for r in res) / len(res) if res else 0.0], dtype=torch.float64)
        dist.broadcast(total, src=env["loss_rank"], group=env["gloo"])
        return float(total)

    # -- instrumentation -------------------------------------------------------------------------
    def _record_checksums(self):
        model, sums = self.env["model"], self.sums
        if not self.env["recorder"]:  # a TP peer of a recorder holds the same values
            return

        def encoder_out(mod, inp, out):  # [image tokens of the micro-batch, H], samples in order
            counts = (self.current["input_ids"] == syn.IMAGE_TOKEN).sum(1).tolist()
            per = torch.split(out.detach().double().sum(-1), counts)
            sums["encoder"].extend(zip(self.current["sample_id"].tolist(), [float(x.sum()) for x in per]))

        def language_in(mod, args_, kwargs):  # decoder_input [S, B, H]: text and image embeddings merged
            if kwargs.get("decoder_input") is None:  # a later pipeline stage: hidden states, no embeddings
                return
            x = kwargs["decoder_input"].detach().double().transpose(0, 1)
            img = self.current["input_ids"] == syn.IMAGE_TOKEN
            sums["language"].extend(zip(self.current["sample_id"].tolist(),
                                        [float(x[b][img[b]].sum()) for b in range(x.shape[0])]))

        if ENC in model.modality_submodules:
            self._undo.append(model.modality_submodules[ENC].input_projections[0]
                              .register_forward_hook(encoder_out).remove)
        if getattr(model, "language_model", None) is not None:
            self._undo.append(model.language_model.register_forward_pre_hook(language_in, with_kwargs=True).remove)

    def _tolerate_misrouting(self):
        model = self.env["model"]
        if getattr(model, "language_model", None) is None:
            return
        align = model.align_embeddings_by_token_positions

        def tolerant(modality_embeddings, input_ids, special_token_ids):
            rows, need = modality_embeddings.get(ENC), int((input_ids == special_token_ids[ENC]).sum())
            if rows is not None and rows.shape[0] != need:
                self.misrouted += self.env["recorder"]
                pad = rows.new_zeros(max(need - rows.shape[0], 0), rows.shape[1])
                modality_embeddings = {**modality_embeddings, ENC: torch.cat([rows[:need], pad])}
            return align(modality_embeddings, input_ids, special_token_ids)

        model.align_embeddings_by_token_positions = tolerant  # an instance attribute shadows the method
        self._undo.append(lambda: delattr(model, "align_embeddings_by_token_positions"))


def reorder_cfg(on, *, window=1, overlap=True, weight=0.0, balancer=None, verify=0):
    """verify: the runtime self-check (`megatron_mimo_reorder_verify`: 0 off, N every N-th window) when
    reorder is on."""
    extra = {} if balancer is None else {"megatron_mimo_reorder_balancer": balancer}
    return ReorderConfig(megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=on,
                         megatron_mimo_reorder_window_size=window, megatron_mimo_reorder_overlap=overlap,
                         megatron_mimo_reorder_language_cost_weight=weight,
                         megatron_mimo_reorder_verify=verify if on else 0, **extra)


def verified(args, run) -> tuple:
    """(windows the self-check found intact, per rank; every rank has some, or the check is off)."""
    every = gather(run.it.verified_windows)
    return every, not args.verify or min(every) > 0


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def image_tokens_per_mb(run):
    """[micro-batch][rank] image placeholder tokens (gathered over the world)."""
    every = gather(run.img_tokens)
    return [[every[r][k] for r in range(len(every))] for k in range(len(run.img_tokens))]



def expected_share(env, cfg, window_ids):
    """Reference (spec) canonical order of one global micro-batch over the G groups, as dataset indices."""
    ds = env["ds"]
    costs = [ref.sample_cost(ds.tokens(i), ds.mask(i), image_token_id=syn.IMAGE_TOKEN, spatial_merge_size=2,
                             encoder_weight=cfg.encoder_weight, language_weight=cfg.language_weight)
             for i in window_ids]
    if cfg.balancer == "lpt":
        order = ref.lpt_order(costs, env["groups"])
    else:  # no slow reference for the other balancers: the library's own plan on the spec's costs
        from reorder.plan.balancers import get_balancer
        order = get_balancer(cfg.balancer)(np.array(costs, dtype=np.float64), env["groups"]).tolist()
    return [window_ids[i] for i in order]


def flat_fields(mb, name=""):
    """[(name, tensor)] of a micro-batch's tensors in a fixed order (nested fields as a.b.c)."""
    if isinstance(mb, dict):
        return [x for k in sorted(mb) for x in flat_fields(mb[k], f"{name}.{k}" if name else k)]
    return [(name, mb)] if torch.is_tensor(mb) else []


def on_host(mb) -> dict:
    """{field name: host copy} of a micro-batch's tensors, copied with one device-to-host copy per
    device (the bytes of every field concatenated there) instead of one per field."""
    out, by_device = {}, {}
    for name, t in flat_fields(mb):
        by_device.setdefault(t.device, []).append((name, t.detach().contiguous()))
    for dev, items in by_device.items():
        flat = [t.reshape(-1).view(torch.uint8) for _, t in items]
        host = torch.cat(flat).cpu() if dev.type != "cpu" else None
        at = 0
        for (name, t), f in zip(items, flat):
            if host is None:
                out[name] = t
                continue
            out[name] = host[at:at + f.numel()].view(t.dtype).reshape(t.shape)
            at += f.numel()
    return out


def field_digests(fields: dict) -> dict:
    """{field: digest of its dtype, shape and bytes} of one micro-batch's host fields (`on_host`)."""
    out = {}
    for name, t in fields.items():
        h = hashlib.sha1(f"{t.dtype} {tuple(t.shape)}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        out[name] = h.hexdigest()[:16]
    return out


STAGE_FIELDS = ("sample_id", "input_ids", "position_ids")  # fields every language stage loads


def dp_orders(env, every_ids):
    """{label: [micro-batch][position] sample ids}: each micro-batch's samples over one DP group's ranks
    in DP order, for every DP group of every module (every_ids: each rank's `Run.ids`, gathered). The
    label is the module's name, or with several DP groups (TP, PP), the module and the group's ranks."""
    out = {}
    for m, groups in env["dp_groups"].items():
        for g in groups:
            label = m if len(groups) == 1 else f"{m} {g}"
            out[label] = [[i for r in g for i in every_ids[r][k]] for k in range(len(every_ids[g[0]]))]
    return out


def check_replicas(env, every):
    """Every TP group: its ranks held byte-identical micro-batches (every field's digest, micro-batch by
    micro-batch); every PP group (the stages of one DP replica): the same samples in the same order, and
    the same token fields. every: each rank's {"ids", "digests"}, gathered. Returns the counts checked."""
    tp = pp = 0
    for m in env["dp_groups"]:
        for g in env["tp_groups"][m]:
            for r in g[1:]:
                a, b = every[g[0]]["digests"], every[r]["digests"]
                bad = [k for k in range(max(len(a), len(b))) if k >= min(len(a), len(b)) or a[k] != b[k]]
                if bad:
                    k = bad[0]
                    diff = sorted(f for f in set(a[k]) | set(b[k]) if a[k].get(f) != b[k].get(f)) \
                        if k < min(len(a), len(b)) else "count"
                    raise AssertionError(f"{m} TP group {g}: rank {r} micro-batch {k} differs from rank {g[0]} "
                                         f"({diff}; {len(bad)} micro-batches differ)")
                tp += len(a)
        for g in env["pp_groups"][m]:
            for r in g[1:]:
                if every[r]["ids"] != every[g[0]]["ids"]:
                    k = next(k for k, (x, y) in enumerate(zip(every[r]["ids"], every[g[0]]["ids"])) if x != y) \
                        if len(every[r]["ids"]) == len(every[g[0]]["ids"]) else "count"
                    raise AssertionError(f"{m} PP group {g}: stage {g.index(r)} (rank {r}) holds another sample "
                                         f"order than stage 0 (rank {g[0]}) at micro-batch {k}")
                for k, (x, y) in enumerate(zip(every[r]["digests"], every[g[0]]["digests"])):
                    diff = [f for f in STAGE_FIELDS if f in x and f in y and x[f] != y[f]]
                    if diff:
                        raise AssertionError(f"{m} PP group {g}: rank {r} micro-batch {k} differs from stage 0 "
                                             f"in {diff}")
                pp += len(every[r]["ids"])
    return {"tp_peer_micro_batches_identical": tp, "pp_stage_micro_batches_same_order": pp}


def check_accounting(env, run, cfg, first_window=0):
    """Every sample of every global micro-batch seen exactly once in each DP group of each module, and
    each DP group's ranks holding, in rank order, the reference plan's canonical order (reorder on) or
    the natural order (off): every rank got its share of the plan. Also `check_replicas`: TP peers
    byte-identical, PP stages in one order."""
    every = gather({"ids": run.ids, "digests": run.digests})
    if dist.get_rank():
        return {}
    replicas = check_replicas(env, every)
    B = run.args.global_batch
    ref_sampler = CanonicalBatchSampler(len(env["ds"]), B, data_parallel_size=1, data_parallel_rank=0,
                                        grid_size=env["groups"], dataloader_type="cyclic", seed=run.args.seed)
    orders = dp_orders(env, [e["ids"] for e in every])
    n = len(run.ids)
    for k in range(n):
        want = ref_sampler.global_micro_batch(first_window + k)
        plan = expected_share(env, cfg, want) if cfg.enabled else want
        for label, got in orders.items():
            if sorted(got[k]) != sorted(want) or len(set(got[k])) != B:
                raise AssertionError(f"{label} micro-batch {k}: samples {got[k]} != global micro-batch {want}")
            if got[k] != plan:
                raise AssertionError(f"{label} micro-batch {k}: ranks hold {got[k]}, reference plan {plan}")
    out = {"micro_batches": n, "samples": n * B, "modules": list(env["dp_groups"])}
    if len(orders) > len(env["dp_groups"]):
        out["dp_groups"] = len(orders)
    if any(len(g) > 1 for groups in (env["tp_groups"], env["pp_groups"]) for gs in groups.values() for g in gs):
        out.update(replicas)
    return out


# ---- tests -----------------------------------------------------------------------------------------

def test_parity(args, env):
    off = Run(args, env, reorder_cfg(False), iters=args.iters).train()
    off.close()
    on_cfg = reorder_cfg(True, window=2, overlap=True, verify=args.verify)
    on = Run(args, env, on_cfg, iters=args.iters).train()
    on.close()
    acc = check_accounting(env, on, on_cfg)
    acc_off = check_accounting(env, off, reorder_cfg(False))
    tok_off, tok_on = image_tokens_per_mb(off), image_tokens_per_mb(on)
    checked, checked_ok = verified(args, on)
    if dist.get_rank():
        return {}
    sums_equal = [sum(a) for a in tok_off] == [sum(b) for b in tok_on]
    spread = lambda t: float(np.mean([max(x) / (sum(x) / len(x)) for x in t if sum(x)]))  # noqa: E731
    d1 = abs(off.losses[0] - on.losses[0])
    rel = [abs(a - b) / abs(a) for a, b in zip(off.losses, on.losses)]
    ok = sums_equal and d1 <= args.first_tolerance * abs(off.losses[0]) and max(rel) <= args.tolerance and checked_ok
    return {"test": "parity", "ok": bool(ok), "layout": env["layout"], "iters": args.iters, "micro_batches_per_iter": args.micro_batches,
            "verify": args.verify, "verified_windows_on": checked,
            "loss1_off": off.losses[0], "loss1_on": on.losses[0], "loss1_abs_diff": d1,
            "loss1_rel_diff": d1 / abs(off.losses[0]), "max_rel_diff": max(rel), "max_abs_diff":
            max(abs(a - b) for a, b in zip(off.losses, on.losses)), "tolerance_rel": args.tolerance,
            "first_tolerance_rel": args.first_tolerance, "image_token_sums_equal": sums_equal,
            "image_token_spread_off": spread(tok_off), "image_token_spread_on": spread(tok_on),
            "image_tokens_first_mb_off": tok_off[0], "image_tokens_first_mb_on": tok_on[0],
            "losses_off": off.losses, "losses_on": on.losses, "accounting_on": acc, "accounting_off": acc_off}



def test_resume(args, env, cfg=None):
    """Checkpoint after --resume-at iterations, resume in fresh objects: the next --iters losses must
    equal the continuous run's bit for bit (cfg: reorder on, W and overlap from the first --windows and
    --overlaps, unless given)."""
    k, n = args.resume_at, args.iters
    cfg = cfg or reorder_cfg(True, window=args.windows[0], overlap=args.overlaps[0], verify=args.verify)
    cont = Run(args, env, cfg, iters=k + n).train()
    cont.close()
    first = Run(args, env, cfg, iters=k).train()
    state = first.checkpoint()
    first.close()
    path = os.path.join(env["tmp"], f"ckpt_rank{dist.get_rank()}.pt")
    torch.save(state, path)
    with torch.no_grad():  # scramble the live weights: the resumed run must get everything from the file
        for p in env["model"].parameters():
            p.normal_()
    state = torch.load(path, weights_only=False)
    resumed = Run(args, env, cfg, iters=n, state=state).train()
    resumed.close()
    acc = check_accounting(env, resumed, cfg, first_window=k * args.micro_batches)
    if dist.get_rank():
        return {}
    exact = resumed.losses == cont.losses[k:]
    return {"test": "resume", "ok": bool(exact), "layout": env["layout"], "window": cfg.window_size,
            "overlap": cfg.overlap, "balancer": cfg.balancer, "checkpoint_at": k,
            "consumed_samples": state["data"]["consumed_samples"],
            "epoch_at_resume": state["data"]["consumed_samples"] // (len(env["ds"]) // args.global_batch
                                                                     * args.global_batch),
            "continuous": cont.losses[k:], "resumed": resumed.losses,
            "max_abs_diff": max(abs(a - b) for a, b in zip(resumed.losses, cont.losses[k:])), "accounting": acc}


def test_soak(args, env):
    results, refused = [], None
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" and args.device == "cuda":
        try:  # overlap must be refused there (docs/design.md, Overlap), on every rank alike
            Run(args, env, reorder_cfg(True, window=2, overlap=True, verify=args.verify), iters=1).close()
        except ValueError as e:
            refused = str(e)
    for weight in args.weights:
        for window in args.windows:
            for overlap in args.overlaps:
                cfg = reorder_cfg(True, window=window, overlap=overlap, weight=weight, verify=args.verify)
                t0 = time.time()
                run = Run(args, env, cfg, iters=args.iters)
                done = 0
                while done < args.iters:
                    run.step()
                    done += 1
                    if done % 10 == 0:  # a collective stop decision (same on every rank)
                        late = torch.tensor([time.time() - t0 > args.combo_seconds], dtype=torch.int32)
                        dist.all_reduce(late, group=env["gloo"])
                        if done % 50 == 0:  # a job killed by its launcher still shows how far it got
                            log(f"soak progress: W {window} overlap {overlap} weight {weight}: {done} iterations "
                                f"in {time.time() - t0:.0f} s")
                        if late.item():
                            break
                seconds = time.time() - t0
                run.close()
                buf = run.it
                reps = list(getattr(buf, "reports", []))
                r = {"window": window, "overlap": overlap, "language_weight": weight, "iters": done,
                     "ms_per_iter": round(1000 * seconds / max(done, 1), 2),
                     "thread_alive_after_close": bool(getattr(buf, "worker_alive", False)),
                     "finite": all(math.isfinite(x) for x in run.losses), "last_loss": run.losses[-1]}
                if reps:  # the buffer keeps the last 1000 window reports
                    r["moved_frac"] = round(sum(x.moved_samples for x in reps) / sum(x.total_samples for x in reps), 3)
                    r["spread_before"] = round(float(np.mean([x.spread_before for x in reps])), 3)
                    r["spread_after"] = round(float(np.mean([x.spread_after for x in reps])), 3)
                r.update(check_accounting(env, run, cfg))
                r["verified_windows"], r["verified_ok"] = verified(args, run)
                log("SOAK", json.dumps(r))
                results.append(r)
    if dist.get_rank():
        return {}
    ok = all(r["iters"] >= args.iters and r["finite"] and not r["thread_alive_after_close"] and r["verified_ok"]
             for r in results)
    cdmc = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    out = {"test": "soak", "ok": ok, "layout": env["layout"], "cdmc": cdmc, "combos": results,
           "total_iters": sum(r["iters"] for r in results)}
    if cdmc == "1" and args.device == "cuda":
        out["overlap_refused"] = refused
        out["ok"] = ok and refused is not None
    return out



def test_noncoloc(args, env):
    """Non-colocated layout (`setup`: encoder tp x dp E on the first ranks, language tp x pp x dp L after
    them), the real 1F1B schedule across BridgeCommunicator (and P2P between language stages), reorder
    off vs on (lpt, W 2, overlap; with G = 1 the default balancer keeps the natural order, lpt permutes):
    - per-sample image-embedding checksums, encoder output vs language input (the first language
      stage's decoder input; TP rank 0 of each side records): 0 mismatches off and on;
      a control run where only the language ranks reorder (the encoder ranks plan with the identity
      balancer, so they keep the natural order yet join wrap's world-wide group creation) must show
      mismatches;
    - every DP group of both modules holds every micro-batch in the reference plan's order
      (`check_accounting`), so the encoder's and the language model's orders agree; TP peers hold
      byte-identical micro-batches and the PP stages of a replica one sample order (`check_replicas`);
    - the loss curves of off and on agree within --first-tolerance / --tolerance;
    - a bit-identical resume with reorder on (`test_resume`)."""
    on_cfg = reorder_cfg(True, window=2, overlap=True, balancer="lpt", verify=args.verify)
    off_cfg = reorder_cfg(False)
    ctrl_cfg = on_cfg if env["module"] == LANG else reorder_cfg(True, window=2, overlap=True, balancer="identity", verify=args.verify)
    runs = {}
    for name, cfg, iters in (("off", off_cfg, args.iters), ("on", on_cfg, args.iters), ("bad", ctrl_cfg, 1)):
        runs[name] = Run(args, env, cfg, iters=iters, checksums=True, tolerate_misrouting=name == "bad").train()
        runs[name].close()
    acc = {"on": check_accounting(env, runs["on"], on_cfg), "off": check_accounting(env, runs["off"], off_cfg)}
    resume = test_resume(args, env, on_cfg)
    checked, checked_ok = verified(args, runs["on"])
    every = gather({name: {"ids": r.ids, "sums": r.sums, "misrouted": r.misrouted} for name, r in runs.items()})
    if dist.get_rank():
        return {}

    def mismatches(name):  # samples whose image embeddings on the language side are not the encoder's for them
        enc = sorted(s for e in every for s in e[name]["sums"]["encoder"])  # recorders only: one per sample
        lang = sorted(s for e in every for s in e[name]["sums"]["language"])
        assert len(enc) == len(lang), (name, len(enc), len(lang))
        return sum(e != la for e, la in zip(enc, lang)), len(enc)

    paired = {name: mismatches(name) for name in runs}
    orders = {name: dp_orders(env, [e[name]["ids"] for e in every]) for name in runs}
    aligned = all(o == next(iter(orders[name].values())) for name in ("off", "on") for o in orders[name].values())
    first_on, first_off = next(iter(orders["on"].values())), next(iter(orders["off"].values()))
    permuted = sum(a != b for a, b in zip(first_on, first_off))
    lo, ln, bad = runs["off"].losses, runs["on"].losses, runs["bad"].losses
    d1 = abs(lo[0] - ln[0])
    rel = max(abs(a - b) / abs(a) for a, b in zip(lo, ln))
    ok = aligned and permuted > 0 and d1 <= args.first_tolerance * abs(lo[0]) and rel <= args.tolerance \
        and paired["off"][0] == 0 and paired["on"][0] == 0 and paired["bad"][0] > 0 and resume["ok"] and checked_ok
    return {"test": args.test, "ok": bool(ok), "layout": env["layout"], "encoder_dp": len(env["dp_groups"][ENC][0]),
            "verify": args.verify, "verified_windows_on": checked,
            "language_dp": len(env["dp_groups"][LANG][0]), "groups": env["groups"], "iters": args.iters,
            "encoder_and_language_order_equal": aligned,
            "image_embedding_mismatches": {k: f"{v[0]}/{v[1]} samples" for k, v in paired.items()},
            "misaligned_control_rel_diff": abs(bad[0] - lo[0]) / abs(lo[0]),
            "misaligned_control_misrouted_micro_batches": sum(e["bad"]["misrouted"] for e in every),
            "micro_batches_permuted": permuted, "of": len(first_on), "loss1_off": lo[0], "loss1_on": ln[0],
            "loss1_abs_diff": d1, "max_rel_diff": rel, "losses_off": lo, "losses_on": ln, "accounting": acc,
            "resume": resume}


# ---- main ------------------------------------------------------------------------------------------

LAYOUT_DEFAULTS = {"noncoloc": (1, 1), "hetero": (2, 4)}  # (encoder dp, language dp) when not given


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("test", choices=["parity", "resume", "soak", "noncoloc", "hetero"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--encoder-dp", type=int, default=None,
                   help="non-colocated layout: the encoder on the first E ranks with DP E (noncoloc: 1, hetero: 2)")
    p.add_argument("--language-dp", type=int, default=None,
                   help="non-colocated layout: the language model on the next L ranks with DP L, a multiple of E "
                        "(noncoloc: 1, hetero: 4)")
    p.add_argument("--encoder-tp", type=int, default=None,
                   help="non-colocated: the encoder's tensor-parallel size (its ranks: tp x E; default 1); "
                        "colocated, the encoder always shares the language grid")
    p.add_argument("--language-tp", type=int, default=1,
                   help="the language model's tensor-parallel size (colocated: both modules' grid, tp x world/tp)")
    p.add_argument("--language-pp", type=int, default=1,
                   help="non-colocated: the language model's pipeline-parallel size (its ranks: tp x pp x L)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per iteration")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--features", type=int, default=48)
    p.add_argument("--mix", default="realistic")
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--dataset", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vision-hidden", type=int, default=32)
    p.add_argument("--lm-layers", type=int, default=None, help="language layers (default 2, or --language-pp "
                                                                  "when larger), a multiple of --language-pp")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tolerance", type=float, default=1e-3, help="max relative loss difference over --iters")
    p.add_argument("--first-tolerance", type=float, default=1e-5, help="max relative iteration-1 difference")
    p.add_argument("--resume-at", type=int, default=5)
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--overlaps", type=lambda s: s == "on", nargs="+", default=[True, False])
    p.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.5])
    p.add_argument("--combo-seconds", type=float, default=1e9, help="soak: stop a combo after this long")
    p.add_argument("--verify", type=int, default=0, help="reorder on: the runtime self-check every N-th window "
                                                          "(0 off), as --reorder-verify N")
    p.add_argument("--json", default=None, help="rank 0 writes its result here")
    args = p.parse_args(argv)
    if args.test in LAYOUT_DEFAULTS:
        e, l = LAYOUT_DEFAULTS[args.test]
        args.encoder_dp = e if args.encoder_dp is None else args.encoder_dp
        args.language_dp = l if args.language_dp is None else args.language_dp
    if (args.encoder_dp is None) != (args.language_dp is None):
        p.error("give both --encoder-dp and --language-dp (a non-colocated layout), or neither (colocated)")
    for name in ("encoder_tp", "language_tp", "language_pp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.encoder_dp is None:
        if args.language_pp > 1:
            p.error("--language-pp > 1 needs a non-colocated layout (--encoder-dp, --language-dp): megatron's "
                    "colocated MIMO runs PP 1")
        if args.encoder_tp not in (None, args.language_tp):
            p.error("colocated, the encoder shares the language grid: give --language-tp only")
    args.encoder_tp = args.encoder_tp or 1 if args.encoder_dp is not None else args.language_tp
    args.lm_layers = args.lm_layers or max(2, args.language_pp)
    if args.lm_layers % args.language_pp:
        p.error(f"--lm-layers {args.lm_layers} must be a multiple of --language-pp {args.language_pp}")
    if args.encoder_dp is not None:
        if args.test == "parity":
            p.error("parity is colocated; noncoloc / hetero are the non-colocated layout's parity test")
        if min(args.encoder_dp, args.language_dp) < 1 or args.language_dp % args.encoder_dp:
            p.error(f"--language-dp {args.language_dp} must be a multiple of --encoder-dp {args.encoder_dp} (fan-out)")
        if args.global_batch % args.language_dp:
            p.error(f"--global-batch {args.global_batch} must be a multiple of G = --language-dp {args.language_dp}")
    return args


def summarize(folder) -> int:
    """Print the suite summary from the jobs' JSON results (ci/gpu_mimo.sh); returns the exit status.
    The jobs are those rc.txt lists (name rc=N seconds); a job fails without a JSON result, with a
    result whose ok is false, or with a non-zero exit status."""
    lines, bad, soak_total = [], [], 0
    for f in ("versions.txt", "rc.txt"):
        path = os.path.join(folder, f)
        if os.path.exists(path):
            lines += [f"# {f}"] + ["  " + x.rstrip() for x in open(path) if x.strip()]
    rcs = {}
    if os.path.exists(os.path.join(folder, "rc.txt")):
        for x in open(os.path.join(folder, "rc.txt")):
            if x.strip():
                name, rc = x.split()[:2]
                v = rc.split("=", 1)[1]
                rcs[name] = int(v) if v.lstrip("-").isdigit() else v  # "skipped": not started before DEADLINE
    fmt = lambda xs: "[" + ", ".join(f"{x:.6f}" for x in xs) + "]"  # noqa: E731

    def replicas(acc):  # the TP / PP checks of an accounting dict, when the layout has TP or PP groups
        if "tp_peer_micro_batches_identical" not in acc:
            return ""
        return (f"; TP peers byte-identical on {acc['tp_peer_micro_batches_identical']} micro-batches, PP stages "
                f"in one order on {acc['pp_stage_micro_batches_same_order']}")

    def resume_lines(head, r, indent=""):
        return [f"{indent}{head} ({r['layout']}, reorder on "
                f"{r.get('balancer', 'balanced')} W {r['window']} overlap {r['overlap']}): checkpoint at iteration "
                f"{r['checkpoint_at']} (consumed_samples {r['consumed_samples']}, epoch {r['epoch_at_resume']}), next "
                f"{len(r['resumed'])} losses bit-identical: {r['ok']} (max |diff| {r['max_abs_diff']:.1e})",
                f"{indent}  continuous {fmt(r['continuous'])}", f"{indent}  resumed    {fmt(r['resumed'])}",
                f"{indent}  accounting {r['accounting']}"]

    kinds = ["parity", "resume", "noncoloc", "hetero", "soak"]
    for name in sorted(rcs, key=lambda n: (next((i for i, k in enumerate(kinds) if n.startswith(k)), len(kinds)), n)):
        path = os.path.join(folder, name + ".json")
        if not os.path.exists(path):
            log_path = os.path.join(folder, name + ".log")
            progress = [x.strip() for x in open(log_path) if "soak progress" in x] if os.path.exists(log_path) else []
            lines.append(f"FAIL {name}: no result, exit status {rcs[name]} (see its log)"
                         + (f"; last {progress[-1]}" if progress else ""))
            bad.append(name)
            continue
        r = json.load(open(path))
        ok = r["ok"] and rcs[name] == 0
        bad += [] if ok else [name]
        head = "PASS" if ok else "FAIL"
        if r["test"] == "parity":
            lines += [f"{head} {name} ({r.get('layout', 'colocated dp 2')}, {r['iters']} iterations x "
                      f"{r['micro_batches_per_iter']} "
                      f"micro-batches, reorder off vs on W 2 overlap)",
                      f"  iteration-1 loss off {r['loss1_off']:.9f} on {r['loss1_on']:.9f}: |diff| "
                      f"{r['loss1_abs_diff']:.3e} (relative {r['loss1_rel_diff']:.3e}, limit "
                      f"{r['first_tolerance_rel']:.0e})",
                      f"  loss curves: max |diff| {r['max_abs_diff']:.3e}, max relative {r['max_rel_diff']:.3e} "
                      f"(limit {r['tolerance_rel']:.0e})",
                      f"  per-micro-batch image-token sums over ranks identical: {r['image_token_sums_equal']}; first "
                      f"micro-batch per rank off {r['image_tokens_first_mb_off']} on {r['image_tokens_first_mb_on']}; "
                      f"mean max/mean spread {r['image_token_spread_off']:.3f} -> {r['image_token_spread_on']:.3f}",
                      f"  accounting: on {r['accounting_on']}, off {r['accounting_off']}",
                      f"  losses off {fmt(r['losses_off'])}", f"  losses on  {fmt(r['losses_on'])}"]
            lines += self_check_lines(r)
        elif r["test"] == "resume":
            lines += resume_lines(f"{head} {name}", r)
        elif r["test"] in LAYOUT_DEFAULTS:
            lines += [f"{head} {name} ({r['layout']}, G {r['groups']}, 1F1B schedule through BridgeCommunicator, "
                      f"{r['iters']} iterations)",
                      f"  both modules hold every micro-batch in the reference plan's order (accounting on "
                      f"{r['accounting']['on']}{replicas(r['accounting']['on'])}); encoder and language orders "
                      f"equal (every DP group): "
                      f"{r['encoder_and_language_order_equal']}; {r['micro_batches_permuted']}/{r['of']} micro-batches "
                      f"permuted",
                      f"  iteration-1 loss off {r['loss1_off']:.9f} on {r['loss1_on']:.9f}: |diff| "
                      f"{r['loss1_abs_diff']:.3e}; "
                      f"max relative over {r['iters']} iterations {r['max_rel_diff']:.3e}",
                      f"  per-sample image-embedding checksums, encoder output vs language input after the bridge: "
                      f"mismatches {r['image_embedding_mismatches']} (off/on must be 0)",
                      f"  control (only the language ranks reorder, 1 iteration): mismatches "
                      f"{r['image_embedding_mismatches']['bad']}, {r['misaligned_control_misrouted_micro_batches']} "
                      f"language micro-batches got another row count than their placeholders, iteration-1 loss off by "
                      f"{r['misaligned_control_rel_diff']:.3e} relative"]
            lines += self_check_lines(r)
            lines += resume_lines("PASS resume" if r["resume"]["ok"] else "FAIL resume", r["resume"], "  ")
        elif r["test"] == "soak":
            head = f"{head} {name} ({r['layout']}, CUDA_DEVICE_MAX_CONNECTIONS={r['cdmc']})"
            if "overlap_refused" in r:
                head += f"; overlap refused: {bool(r['overlap_refused'])}"
            lines.append(head)
            for c in r["combos"]:
                soak_total += c["iters"]
                lines.append(f"  W {c['window']} overlap {c['overlap']!s:5} weight {c['language_weight']}: "
                             f"{c['iters']} "
                             f"iterations ({c['ms_per_iter']} ms/iter), {c.get('samples', '?')} samples accounted "
                             f"exactly, moved {c.get('moved_frac', '-')}, spread {c.get('spread_before', '-')} -> "
                             f"{c.get('spread_after', '-')}, last loss {c['last_loss']:.4f}{replicas(c)}")
    lines.append(f"soak total: {soak_total} iterations")
    if not rcs:
        bad.append("no jobs (rc.txt missing or empty)")
    lines.append("RESULT " + ("all passed" if not bad else "failed: " + ", ".join(bad)))
    print("\n".join(lines))
    return 1 if bad else 0


def self_check_lines(r: dict) -> list:
    """The summary's line of a run's self-check (reorder on): every N-th window, what each rank verified."""
    if not r.get("verify"):
        return ["  self-check off"]
    return [f"  self-check every {r['verify']} window(s), reorder on: windows found intact per rank "
            f"{r['verified_windows_on']}"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summarize"]:
        sys.exit(summarize(argv[1]))
    args = parse(argv)
    # a rank stopped by its launcher (another rank failed, or a timeout) prints every thread's stack
    # first: a hang then says where each rank's threads waited
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    init_torchrun(cuda=args.device == "cuda")
    t0 = time.time()
    try:
        env = setup(args)
        test = {"parity": test_parity, "resume": test_resume, "soak": test_soak, "noncoloc": test_noncoloc,
                "hetero": test_noncoloc}[args.test]
        result = test(args, env)
        if dist.get_rank() == 0:
            result["seconds"] = round(time.time() - t0, 1)
            print("RESULT", json.dumps(result), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(result, f, indent=1)
        ok = result.get("ok", True) if dist.get_rank() == 0 else True
    finally:
        dist.barrier()
        dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
