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

Tests (launch with torchrun; every rank runs the same test):
  parity     colocated dp 2: reorder off vs on, iteration-1 loss difference, per-micro-batch image
             token sums over ranks, then --iters iterations: loss curves within --tolerance
  resume     colocated dp 2, reorder on: checkpoint after k iterations (model, optimizer, and the
             state of the buffer wrap returns: what training consumed), resume in fresh objects with
             the data source rebuilt from it, next iterations must equal the continuous run bit for bit
  soak       colocated dp 2: --iters iterations per combo of --windows x --overlaps x --weights;
             sample accounting exact (every sample of every global micro-batch seen once, on the rank
             the reference plan says), no hang, no error
  noncoloc   encoder grid on rank 0, language grid on rank 1 (dp 1 each: grid 1, local permutation),
             the real MultiModulePipelineCommunicator / BridgeCommunicator 1F1B schedule: both ranks see
             the same sample order, every sample's image embeddings arrive at that sample's placeholders
             (per-sample checksums, encoder output vs language input), reorder off vs on give the same
             losses; a control run where only the language rank reorders must show mismatches
  --device cpu runs every test on Gloo with small CPU shims (debugging only: megatron hard-codes CUDA and
  NCCL in a few places, which the shims redirect).
Every rank prints one `RESULT {json}` line at the end (rank 0's is the summary).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
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
    for name in ("new_group", "new_subgroups_by_enumeration"):  # megatron asks for NCCL in places
        orig = getattr(dist, name)
        setattr(dist, name, lambda *a, _orig=orig, **k: _orig(*a, **{**k, "backend": "gloo"}))


def make_comm_grid(offset, size, backend):
    from megatron.core.hyper_comm_grid import HyperCommGrid

    comm_grid = HyperCommGrid([1, 1, 1, size, 1, 1], ["tp", "cp", "pp", "dp", "ep", "expt_dp"], rank_offset=offset,
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
    """pos_embd / embd groups per grid (pp 1: the grid's own ranks); world-wide, same order everywhere."""
    out = {}
    for comm_grid in grids:
        if comm_grid.rank_offset in out:
            continue
        ranks = list(range(comm_grid.rank_offset, comm_grid.rank_offset + comm_grid.size))
        own = [dist.new_group(ranks=[r]) for r in ranks]  # pp 1: every rank is first and last stage
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
                  bias_dropout_fusion=False, tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    h = args.hidden
    lm_cfg = TransformerConfig(num_layers=args.lm_layers, hidden_size=h, num_attention_heads=4, ffn_hidden_size=2 * h,
                               mrope_section=[h // 16, h // 32, h // 32], **common)
    vis_cfg = TransformerConfig(num_layers=1, hidden_size=args.vision_hidden, num_attention_heads=2,
                                ffn_hidden_size=2 * args.vision_hidden, **common)
    proj_cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1, ffn_hidden_size=h,
                                 activation_func=torch.nn.functional.gelu, **common)

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
        max_sequence_length=args.seq_len, pre_process=True, post_process=True, position_embedding_type="mrope",
        pg_collection=lang_pg))
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


# ---- one training run ------------------------------------------------------------------------------

class Run:
    """One colocated training run: model reset to the initial weights, fresh Adam, fresh data pipeline."""

    def __init__(self, args, env, cfg: ReorderConfig, *, iters, state=None):
        self.args, self.env, self.cfg = args, env, cfg
        model = env["model"]
        model.load_state_dict(env["init_state"])
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.opt = torch.optim.Adam(self.params, lr=args.lr)
        dp, rank = env["dp"], env["dp_rank"]
        fields = rm.fields_to_load([ENC, LANG], 0, cfg)

        def source(consumed_samples):  # this rank's micro-batches from `consumed_samples` on
            sampler = CanonicalBatchSampler(len(env["ds"]), args.global_batch, data_parallel_size=dp,
                                            data_parallel_rank=rank, grid_size=dp, dataloader_type="cyclic",
                                            seed=args.seed, consumed_samples=consumed_samples)
            return rank_source(env["ds"], sampler, fields, env["device"])

        self.it = rm.wrap(source, config=cfg, module=LANG, grids=env["grids"], micro_batch_size=args.global_batch,
                          fixed_width_padding=True, device=env["device"], timeout=datetime.timedelta(seconds=120))
        if state is not None:
            model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["optimizer"])
            self.it.load_state_dict(state["data"])  # the source is built from its consumed_samples
        self.iters = iters
        self.losses, self.ids, self.img_tokens = [], [], []

    def step(self):
        args, env, model = self.args, self.env, self.env["model"]
        for p in self.params:
            p.grad.zero_()
        total = 0.0
        for _ in range(args.micro_batches):
            mb = next(self.it)
            self.ids.append(mb["sample_id"].tolist())
            self.img_tokens.append(int((mb["input_ids"] == syn.IMAGE_TOKEN).sum()))
            kw = model_inputs(mb)
            out, loss_mask = model(**kw)
            local = (out.float() * loss_mask).sum()
            count = loss_mask.sum().detach()
            dist.all_reduce(count, group=env["dp_group"])
            (local / count / args.micro_batches).backward()
            s = local.detach().clone()
            dist.all_reduce(s, group=env["dp_group"])
            total += float(s / count) / args.micro_batches
        flat = torch._utils._flatten_dense_tensors([p.grad for p in self.params])
        dist.all_reduce(flat, group=env["dp_group"])
        for p, g in zip(self.params, torch._utils._unflatten_dense_tensors(flat, [p.grad for p in self.params])):
            p.grad.copy_(g)
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


def reorder_cfg(on, *, window=1, overlap=True, weight=0.0, balancer=None):
    extra = {} if balancer is None else {"megatron_mimo_reorder_balancer": balancer}
    return ReorderConfig(megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=on,
                         megatron_mimo_reorder_window_size=window, megatron_mimo_reorder_overlap=overlap,
                         megatron_mimo_reorder_language_cost_weight=weight, **extra)


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def image_tokens_per_mb(run):
    """[micro-batch][rank] image placeholder tokens (gathered over the world)."""
    every = gather(run.img_tokens)
    return [[every[r][k] for r in range(len(every))] for k in range(len(run.img_tokens))]


def expected_share(env, cfg, window_ids):
    """Reference (spec) canonical order of one global micro-batch, as dataset indices."""
    ds = env["ds"]
    costs = [ref.sample_cost(ds.tokens(i), ds.mask(i), image_token_id=syn.IMAGE_TOKEN, spatial_merge_size=2,
                             encoder_weight=cfg.encoder_weight, language_weight=cfg.language_weight)
             for i in window_ids]
    if cfg.balancer == "lpt":
        order = ref.lpt_order(costs, env["dp"])
    else:  # no slow reference for the other balancers: the library's own plan on the spec's costs
        from reorder.plan.balancers import get_balancer
        order = get_balancer(cfg.balancer)(np.array(costs, dtype=np.float64), env["dp"]).tolist()
    return [window_ids[i] for i in order]


def check_accounting(env, run, cfg, first_window=0):
    """Every sample of every global micro-batch seen exactly once, on the rank the reference plan says."""
    every = gather(run.ids)
    if dist.get_rank():
        return {}
    dp, B = env["dp"], run.args.global_batch
    ref_sampler = CanonicalBatchSampler(len(env["ds"]), B, data_parallel_size=1, data_parallel_rank=0, grid_size=dp,
                                        dataloader_type="cyclic", seed=run.args.seed)
    n = len(run.ids)
    for k in range(n):
        want = ref_sampler.global_micro_batch(first_window + k)
        got = [i for r in range(dp) for i in every[r][k]]
        if sorted(got) != sorted(want) or len(set(got)) != B:
            raise AssertionError(f"micro-batch {k}: samples {got} != global micro-batch {want}")
        if cfg.enabled and got != expected_share(env, cfg, want):
            raise AssertionError(f"micro-batch {k}: ranks hold {got}, reference plan {expected_share(env, cfg, want)}")
    return {"micro_batches": n, "samples": n * B}


# ---- tests -----------------------------------------------------------------------------------------

def test_parity(args, env):
    off = Run(args, env, reorder_cfg(False), iters=args.iters).train()
    off.close()
    on_cfg = reorder_cfg(True, window=2, overlap=True)
    on = Run(args, env, on_cfg, iters=args.iters).train()
    on.close()
    acc = check_accounting(env, on, on_cfg)
    acc_off = check_accounting(env, off, reorder_cfg(False))
    tok_off, tok_on = image_tokens_per_mb(off), image_tokens_per_mb(on)
    if dist.get_rank():
        return {}
    sums_equal = [sum(a) for a in tok_off] == [sum(b) for b in tok_on]
    spread = lambda t: float(np.mean([max(x) / (sum(x) / len(x)) for x in t if sum(x)]))  # noqa: E731
    d1 = abs(off.losses[0] - on.losses[0])
    rel = [abs(a - b) / abs(a) for a, b in zip(off.losses, on.losses)]
    ok = sums_equal and d1 <= args.first_tolerance * abs(off.losses[0]) and max(rel) <= args.tolerance
    return {"test": "parity", "ok": bool(ok), "iters": args.iters, "micro_batches_per_iter": args.micro_batches,
            "loss1_off": off.losses[0], "loss1_on": on.losses[0], "loss1_abs_diff": d1,
            "loss1_rel_diff": d1 / abs(off.losses[0]), "max_rel_diff": max(rel), "max_abs_diff":
            max(abs(a - b) for a, b in zip(off.losses, on.losses)), "tolerance_rel": args.tolerance,
            "first_tolerance_rel": args.first_tolerance, "image_token_sums_equal": sums_equal,
            "image_token_spread_off": spread(tok_off), "image_token_spread_on": spread(tok_on),
            "image_tokens_first_mb_off": tok_off[0], "image_tokens_first_mb_on": tok_on[0],
            "losses_off": off.losses, "losses_on": on.losses, "accounting_on": acc, "accounting_off": acc_off}


def test_resume(args, env):
    k, n = args.resume_at, args.iters
    cfg = reorder_cfg(True, window=args.windows[0], overlap=args.overlaps[0])
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
    return {"test": "resume", "ok": bool(exact), "window": cfg.window_size, "overlap": cfg.overlap,
            "checkpoint_at": k, "consumed_samples": state["data"]["consumed_samples"],
            "epoch_at_resume": state["data"]["consumed_samples"] // (len(env["ds"]) // args.global_batch
                                                                     * args.global_batch),
            "continuous": cont.losses[k:], "resumed": resumed.losses,
            "max_abs_diff": max(abs(a - b) for a, b in zip(resumed.losses, cont.losses[k:])), "accounting": acc}


def test_soak(args, env):
    results, refused = [], None
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" and args.device == "cuda":
        try:  # overlap must be refused there (docs/design.md, Overlap), on every rank alike
            Run(args, env, reorder_cfg(True, window=2, overlap=True), iters=1).close()
        except ValueError as e:
            refused = str(e)
    for weight in args.weights:
        for window in args.windows:
            for overlap in args.overlaps:
                cfg = reorder_cfg(True, window=window, overlap=overlap, weight=weight)
                t0 = time.time()
                run = Run(args, env, cfg, iters=args.iters)
                done = 0
                while done < args.iters:
                    run.step()
                    done += 1
                    if done % 50 == 0:  # a collective stop decision (same on every rank)
                        late = torch.tensor([time.time() - t0 > args.combo_seconds], dtype=torch.int32)
                        dist.all_reduce(late, group=env["gloo"])
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
                log("SOAK", json.dumps(r))
                results.append(r)
    if dist.get_rank():
        return {}
    ok = all(r["iters"] >= args.iters and r["finite"] and not r["thread_alive_after_close"] for r in results)
    cdmc = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    out = {"test": "soak", "ok": ok, "cdmc": cdmc, "combos": results, "total_iters": sum(r["iters"] for r in results)}
    if cdmc == "1" and args.device == "cuda":
        out["overlap_refused"] = refused
        out["ok"] = ok and refused is not None
    return out


def test_noncoloc(args):
    """Encoder rank 0, language rank 1, real 1F1B schedule through MultiModulePipelineCommunicator."""
    import megatron.core.pipeline_parallel.schedules as schedule
    from megatron.core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    cpu = args.device == "cpu"
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    backend = "gloo" if cpu else "nccl"
    enc_grid, lang_grid = make_comm_grid(0, 1, backend), make_comm_grid(1, 1, backend)
    embd = embedding_groups([enc_grid, lang_grid])
    model = build_model(args, enc_grid, lang_grid, embd, device)
    init = copy.deepcopy(model.state_dict())
    me = dist.get_rank()
    module = ENC if me == 0 else LANG
    grids = {ENC: enc_grid, LANG: lang_grid}
    pgs = {module: pg_collection(enc_grid if me == 0 else lang_grid, embd)}
    pgc = MultiModuleProcessGroupCollection(module_pgs=pgs, language_model_module_name=LANG if me == 1 else None)
    comm = MultiModulePipelineCommunicator(grids, {ENC: [LANG], LANG: []}, model.config,
                                           dim_mapping={"s": 0, "h": 2, "b": 1}, module_output_ndim={ENC: 2})
    ds = Dataset(4096, args.seq_len, args.features, args.mix, args.scale, args.seed)
    B = args.global_batch  # dp 1 per module: each rank reads the whole global micro-batch

    def run(on, iters):
        """on: reorder on both ranks (bool), or (encoder rank, language rank) for the misaligned control."""
        on = on[me] if isinstance(on, tuple) else on
        model.load_state_dict(init)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=args.lr)
        # grid 1: "balanced" keeps the natural order (nothing to balance); lpt permutes, exercising the bridge
        cfg = reorder_cfg(on, window=2, overlap=True, weight=0.0, balancer="lpt")
        sampler = CanonicalBatchSampler(len(ds), B, data_parallel_size=1, data_parallel_rank=0, grid_size=1,
                                        dataloader_type="cyclic", seed=args.seed)
        fields = rm.fields_to_load(module, 0, cfg)
        it = rm.wrap(rank_source(ds, sampler, fields, device), config=cfg, module=module, grids=grids,
                     micro_batch_size=B, fixed_width_padding=True, device=device)
        seen, losses, sums, current = [], [], [], {}

        def step_func(data_iterator, mdl):
            mb = next(data_iterator)
            seen.append(mb["sample_id"].tolist())
            current["ids"], current["input_ids"] = mb["sample_id"].tolist(), mb["input_ids"]
            kw = model_inputs(mb)
            out, loss_mask = mdl(**kw)

            def loss_func(loss_mask, output_tensor):
                if isinstance(output_tensor, dict) or output_tensor is None:
                    return torch.tensor(0.0, device=device, requires_grad=True), {}
                s = (output_tensor.float() * loss_mask).sum()
                c = loss_mask.sum()
                return s / c, {"loss": (s / c).detach().clone()}  # the schedule divides the first in place
            return out, lambda t: loss_func(loss_mask, t)

        # per-sample checksums of the image embeddings: what the encoder produced for sample i (rank 0) and
        # what the language model received at sample i's placeholders after the bridge (rank 1)
        def enc_hook(mod, inp, out):
            counts = (current["input_ids"] == syn.IMAGE_TOKEN).sum(1).tolist()
            per = torch.split(out.detach().double().sum(-1), counts)
            sums.extend(zip(current["ids"], [float(x.sum()) for x in per]))

        def lang_hook(mod, args_, kwargs):
            x = kwargs["decoder_input"].detach().double().transpose(0, 1)  # [B, S, H]
            img = current["input_ids"] == syn.IMAGE_TOKEN
            sums.extend(zip(current["ids"], [float(x[b][img[b]].sum()) for b in range(x.shape[0])]))

        hook = (model.modality_submodules[ENC].input_projections[0].register_forward_hook(enc_hook) if me == 0 else
                model.language_model.register_forward_pre_hook(lang_hook, with_kwargs=True))

        for _ in range(iters):
            opt.zero_grad()
            for p in params:
                p.grad = None
            res = schedule.forward_backward_pipelining_without_interleaving(
                forward_step_func=step_func, data_iterator=it, model=[model], num_microbatches=args.micro_batches,
                seq_length=args.seq_len, micro_batch_size=B, forward_only=False, p2p_communicator=comm,
                pg_collection=pgc)
            opt.step()
            if me == 1:
                losses.append(float(sum(float(r["loss"]) for r in res) / len(res)))
        hook.remove()
        if hasattr(it, "close"):
            it.close()
        return losses, seen, sums

    off_l, off_seen, off_sums = run(False, args.iters)
    on_l, on_seen, on_sums = run(True, args.iters)
    bad_l, _, bad_sums = run((False, True), 1)  # control: only the language rank reorders
    every = gather({"off": off_seen, "on": on_seen, "losses_off": off_l, "losses_on": on_l, "bad": bad_l,
                    "sums": {"off": off_sums, "on": on_sums, "bad": bad_sums}})
    if me:
        return {}

    def mismatches(key):  # samples whose image embeddings on the language rank are not the encoder's for it
        enc, lang = every[0]["sums"][key], every[1]["sums"][key]
        assert len(enc) == len(lang), (key, len(enc), len(lang))
        return sum(e != la for e, la in zip(sorted(enc), sorted(lang))), len(enc)

    paired = {k: mismatches(k) for k in ("off", "on", "bad")}
    control = abs(every[1]["bad"][0] - every[1]["losses_off"][0]) / abs(every[1]["losses_off"][0])
    aligned = every[0]["on"] == every[1]["on"] and every[0]["off"] == every[1]["off"]
    permuted = sum(a != b for a, b in zip(every[0]["on"], every[0]["off"]))
    lo, ln = every[1]["losses_off"], every[1]["losses_on"]
    d1 = abs(lo[0] - ln[0])
    rel = max(abs(a - b) / abs(a) for a, b in zip(lo, ln))
    ok = aligned and permuted > 0 and d1 <= args.first_tolerance * abs(lo[0]) and rel <= args.tolerance \
        and paired["off"][0] == 0 and paired["on"][0] == 0 and paired["bad"][0] > 0
    return {"test": "noncoloc", "ok": bool(ok), "iters": args.iters, "encoder_and_language_order_equal": aligned,
            "image_embedding_mismatches": {k: f"{v[0]}/{v[1]} samples" for k, v in paired.items()},
            "misaligned_control_rel_diff": control,
            "micro_batches_permuted": permuted, "of": len(every[0]["on"]), "loss1_off": lo[0], "loss1_on": ln[0],
            "loss1_abs_diff": d1, "max_rel_diff": rel, "losses_off": lo, "losses_on": ln}


# ---- main ------------------------------------------------------------------------------------------

def setup(args):
    cpu = args.device == "cpu"
    if cpu:
        cpu_shims()
        device = torch.device("cpu")
    else:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        device = torch.device("cuda", torch.cuda.current_device())  # init_torchrun's rank_device
        parallel_state._set_global_memory_buffer()
        model_parallel_cuda_manual_seed(args.seed, tp_rank=0, ep_rank=0, etp_rank=0)
    world = dist.get_world_size()
    backend = "gloo" if cpu else "nccl"
    enc_grid = make_comm_grid(0, world, backend)
    lang_grid = make_comm_grid(0, world, backend)
    embd = embedding_groups([enc_grid])
    model = build_model(args, enc_grid, lang_grid, embd, device)
    env = {"model": model, "init_state": copy.deepcopy(model.state_dict()), "device": device, "dp": world,
           "dp_rank": dist.get_rank(), "grids": {ENC: enc_grid, LANG: lang_grid},
           "dp_group": lang_grid.get_pg("dp"), "gloo": dist.new_group(backend="gloo"),
           "ds": Dataset(args.dataset, args.seq_len, args.features, args.mix, args.scale, args.seed),
           "tmp": tempfile.mkdtemp(prefix="mimo_suite_")}
    check = torch.tensor([sum(float(p.double().sum()) for p in model.parameters())], dtype=torch.float64)
    every = [torch.zeros_like(check) for _ in range(world)]
    dist.all_gather(every, check, group=env["gloo"])
    assert all(torch.equal(e, check) for e in every), "DP replicas start from different weights"
    log(f"model: {sum(p.numel() for p in model.parameters())} parameters on {device}, world {world}")
    return env


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("test", choices=["parity", "resume", "soak", "noncoloc"])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
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
    p.add_argument("--lm-layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tolerance", type=float, default=1e-3, help="max relative loss difference over --iters")
    p.add_argument("--first-tolerance", type=float, default=1e-5, help="max relative iteration-1 difference")
    p.add_argument("--resume-at", type=int, default=5)
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--overlaps", type=lambda s: s == "on", nargs="+", default=[True, False])
    p.add_argument("--weights", type=float, nargs="+", default=[0.0, 0.5])
    p.add_argument("--combo-seconds", type=float, default=1e9, help="soak: stop a combo after this long")
    p.add_argument("--json", default=None, help="rank 0 writes its result here")
    return p.parse_args(argv)


def summarize(folder) -> int:
    """Print the suite summary from the jobs' JSON results (ci/gpu_mimo.sh); returns the exit status."""
    import glob

    def load(name):
        path = os.path.join(folder, name + ".json")
        return json.load(open(path)) if os.path.exists(path) else None

    lines, bad = [], []
    for f in ("versions.txt", "rc.txt"):
        path = os.path.join(folder, f)
        if os.path.exists(path):
            lines += [f"# {f}"] + ["  " + x.rstrip() for x in open(path) if x.strip()]
    fmt = lambda xs: "[" + ", ".join(f"{x:.6f}" for x in xs) + "]"  # noqa: E731
    r = load("parity")
    if r is None:
        bad.append("parity: no result")
    else:
        lines += [f"{'PASS' if r['ok'] else 'FAIL'} parity (colocated dp 2, {r['iters']} iterations x "
                  f"{r['micro_batches_per_iter']} micro-batches, reorder off vs on W 2 overlap)",
                  f"  iteration-1 loss off {r['loss1_off']:.9f} on {r['loss1_on']:.9f}: |diff| {r['loss1_abs_diff']:.3e} "
                  f"(relative {r['loss1_rel_diff']:.3e}, limit {r['first_tolerance_rel']:.0e})",
                  f"  loss curves: max |diff| {r['max_abs_diff']:.3e}, max relative {r['max_rel_diff']:.3e} "
                  f"(limit {r['tolerance_rel']:.0e})",
                  f"  per-micro-batch image-token sums over ranks identical: {r['image_token_sums_equal']}; first "
                  f"micro-batch per rank off {r['image_tokens_first_mb_off']} on {r['image_tokens_first_mb_on']}; "
                  f"mean max/mean spread {r['image_token_spread_off']:.3f} -> {r['image_token_spread_on']:.3f}",
                  f"  accounting: on {r['accounting_on']}, off {r['accounting_off']}",
                  f"  losses off {fmt(r['losses_off'])}", f"  losses on  {fmt(r['losses_on'])}"]
        bad += [] if r["ok"] else ["parity"]
    r = load("resume")
    if r is None:
        bad.append("resume: no result")
    else:
        lines += [f"{'PASS' if r['ok'] else 'FAIL'} resume (reorder on W {r['window']} overlap {r['overlap']}): checkpoint "
                  f"at iteration {r['checkpoint_at']} (consumed_samples {r['consumed_samples']}, epoch "
                  f"{r['epoch_at_resume']}), next {len(r['resumed'])} losses bit-identical: {r['ok']} "
                  f"(max |diff| {r['max_abs_diff']:.1e})",
                  f"  continuous {fmt(r['continuous'])}", f"  resumed    {fmt(r['resumed'])}",
                  f"  accounting {r['accounting']}"]
        bad += [] if r["ok"] else ["resume"]
    r = load("noncoloc")
    if r is None:
        lines.append("FAIL noncoloc: no result (see its log)")
        bad.append("noncoloc")
    else:
        lines += [f"{'PASS' if r['ok'] else 'FAIL'} noncoloc (encoder rank 0 + language rank 1, grid 1, 1F1B schedule "
                  f"through BridgeCommunicator, {r['iters']} iterations)",
                  f"  encoder and language ranks saw the same sample order: {r['encoder_and_language_order_equal']}; "
                  f"{r['micro_batches_permuted']}/{r['of']} micro-batches permuted",
                  f"  iteration-1 loss off {r['loss1_off']:.9f} on {r['loss1_on']:.9f}: |diff| {r['loss1_abs_diff']:.3e}; "
                  f"max relative over {r['iters']} iterations {r['max_rel_diff']:.3e}",
                  f"  per-sample image-embedding checksums, encoder output vs language input after the bridge: "
                  f"mismatches {r['image_embedding_mismatches']} (off/on must be 0)",
                  f"  control (only the language rank reorders, 1 iteration): mismatches "
                  f"{r['image_embedding_mismatches']['bad']}, iteration-1 loss off by {r['misaligned_control_rel_diff']:.3e} "
                  f"relative"]
        bad += [] if r["ok"] else ["noncoloc"]
    total = 0
    for path in sorted(glob.glob(os.path.join(folder, "soak_*.json"))):
        name = os.path.basename(path)[:-5]
        r = json.load(open(path))
        head = f"{'PASS' if r['ok'] else 'FAIL'} {name} (CUDA_DEVICE_MAX_CONNECTIONS={r['cdmc']})"
        if "overlap_refused" in r:
            head += f"; overlap refused: {bool(r['overlap_refused'])}"
        lines.append(head)
        for c in r["combos"]:
            total += c["iters"]
            lines.append(f"  W {c['window']} overlap {c['overlap']!s:5} weight {c['language_weight']}: {c['iters']} iterations "
                         f"({c['ms_per_iter']} ms/iter), {c.get('samples', '?')} samples accounted exactly, moved "
                         f"{c.get('moved_frac', '-')}, spread {c.get('spread_before', '-')} -> {c.get('spread_after', '-')}, "
                         f"last loss {c['last_loss']:.4f}")
        bad += [] if r["ok"] else [name]
    lines.append(f"soak total: {total} iterations")
    lines.append("RESULT " + ("all passed" if not bad else "failed: " + ", ".join(bad)))
    print("\n".join(lines))
    return 1 if bad else 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summarize"]:
        sys.exit(summarize(argv[1]))
    args = parse(argv)
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    init_torchrun(cuda=args.device == "cuda")
    t0 = time.time()
    try:
        if args.test == "noncoloc":
            if args.device == "cpu":
                cpu_shims()
            else:
                from megatron.core import parallel_state
                from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

                parallel_state._set_global_memory_buffer()
                model_parallel_cuda_manual_seed(args.seed, tp_rank=0, ep_rank=0, etp_rank=0)
            result = test_noncoloc(args)
        else:
            env = setup(args)
            result = {"parity": test_parity, "resume": test_resume, "soak": test_soak}[args.test](args, env)
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
