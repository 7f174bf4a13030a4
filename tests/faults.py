"""Every fault case the tests inject and what every rank sees, one `FaultCase` record each.

The fault tests parametrize over these records (`cases(suite)`: the test named in SUITES runs every
record of its suite) and `ci/fault_table.py` renders them as docs/faults.md, so the table says what
the tests check. To add a case: append a FaultCase to CASES with the suite whose test runs it and
the `params` that test reads (listed in SUITES), then regenerate the table:
    .venv/bin/python ci/fault_table.py
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from reorder import CostModel
from reorder.cli import synthetic as syn

# suite -> (the test that runs its records, the params that test reads)
SUITES = {
    "balancers": ("tests/plan/test_balancers.py::test_every_balancer_and_plan_orders_refuse_bad_costs",
                  "costs, groups: a balancer gets them as given, plan_orders as one slot, costs[None]"),
    "cost": ("tests/plan/test_grid_cost.py::test_cost_model_refuses_bad_fields_on_every_rank",
             "corrupt: callable(share) -> share, applied to rank 1's share of rank_shares(2); seen first by "
             "count_samples(CostModel(), ...) on it, then by both ranks of an emulated dp-2 exchange"),
    "emulated": ("tests/exchange/test_exchanger.py::test_fault_case",
                 "dp (2); shares: zero-argument callable giving every rank's micro-batch (default "
                 "rank_shares(dp)); config: {rank: WindowExchanger kwargs}; source_error: {rank: exception "
                 "its data source raised, that rank passes no micro-batch}"),
    "gloo_config": ("tests/exchange/test_exchange_faults.py::test_config_that_sizes_the_metadata_differs_on_gloo",
                    "config: {rank: WindowExchanger kwargs} on 2 forked Gloo ranks (Grid(size=2, dp=2)), each "
                    "passing one micro-batch of B/2 zero input_ids [B/2, 8]; run synchronously and through the "
                    "overlap buffer"),
    "buffer": ("tests/runtime/test_buffer.py::test_a_run_of_skipped_windows_on_the_consumer_ends_or_raises_and_stops_the_worker",
               "source_error: what the data source raises after 4 micro-batches"),
    "calibration": ("tests/runtime/test_calibration.py::test_calibration_fault_case",
                    "sim: tests/calibration_sim.simulate keyword arguments (4 ranks, mode on, 30 windows unless "
                    "given: bad=(rank, window, ms) hands that rank's first step time of the window over as ms, "
                    "silent=(rank, window) stops a rank timing, silent_all_from=window stops every rank); "
                    "per_rank: one Calibration's settings per rank, whose headers are folded together"),
    "gloo": ("tests/test_functional_gloo.py::test_faults_raise_on_every_rank",
             "argv: gloo_suite arguments (run with --overlap and --no-overlap); world: processes; "
             "dead: global ranks that exit on purpose (no report); served: {who: micro-batches each of "
             "those ranks served before its error}"),
    "torchrun": ("tests/test_functional_gloo.py::test_fault_under_torchrun",
                 "argv: gloo_suite arguments; nproc: processes torchrun starts; sigterm_ok: modules whose ranks "
                 "torchrun may end (SIGTERM) before they report what they saw"),
}
MATCH = ("contains", "starts", "equals")


@dataclass(frozen=True)
class Seen:
    """What the ranks named by `who` see: an exception of type `error` (None: no error, their stream
    runs to its end) whose message contains every string of `text` (match="contains"), starts with
    it ("starts") or equals it ("equals"); `note`: what else they see (exit code, log lines)."""

    who: str
    error: str | None
    text: str | tuple = ()
    match: str = "contains"
    note: str = ""

    def __post_init__(self):
        if self.match not in MATCH:
            raise ValueError(f"match={self.match!r} is invalid: use one of {MATCH}")
        if self.match != "contains" and not isinstance(self.text, str):
            raise ValueError(f"match={self.match!r} needs text to be one string; got {self.text!r}")

    @property
    def texts(self) -> tuple:
        return (self.text,) if isinstance(self.text, str) else tuple(self.text)

    def check(self, got, said: str = "") -> None:
        """Assert that `got` is what this entry says: an exception, "Type: message" (a rank's report)
        or None (no error; `said`: what the ranks logged or reported instead, matched against text)."""
        if isinstance(got, BaseException):
            kind, msg = type(got).__name__, str(got)
        elif got is None:
            kind, msg = None, said
        else:
            kind, _, msg = str(got).partition(": ")
        assert kind == self.error, f"{self.who}: expected {self.error or 'no error'}, got {kind}: {msg}"
        if self.match == "equals":
            assert msg == self.text, f"{self.who}: message {msg!r} is not {self.text!r}"
        elif self.match == "starts":
            assert msg.startswith(self.text), f"{self.who}: message {msg!r} does not start with {self.text!r}"
        else:
            missing = [t for t in self.texts if t not in msg]
            assert not missing, f"{self.who}: message {msg!r} lacks {missing}"


@dataclass(frozen=True)
class FaultCase:
    """One injected fault: `where` it is injected, what the `input` is, and what every rank `sees`
    (one Seen per module or rank set; together they cover every rank). `params`: how the suite's
    test injects it (SUITES says which keys it reads)."""

    name: str
    suite: str
    where: str
    input: str
    sees: tuple
    params: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.suite not in SUITES:
            raise ValueError(f"suite={self.suite!r} of case {self.name!r} is unknown: use one of {sorted(SUITES)}")
        if not self.sees or not all(isinstance(s, Seen) for s in self.sees):
            raise ValueError(f"sees of case {self.name!r} must be a non-empty tuple of Seen")

    def seen(self, who: str) -> Seen:
        return next(s for s in self.sees if s.who == who)


# --- helpers the records use to build their inputs -------------------------------------------------

def rank_shares(dp: int, seed: int = 0) -> list:
    """Every rank's share of one synthetic global micro-batch of 2*dp samples (sequence length 192)."""
    g = syn.make_global_batch(np.random.default_rng(seed), 2 * dp, 192, features=4, mix="small", first_id=0)
    return [syn.rank_share(g, dp, r) for r in range(dp)]


def _replace(shares: list, rank: int, **fields) -> list:
    out = list(shares)
    out[rank] = dict(shares[rank], **fields)
    return out


def _image_sizes_shares():
    """Global micro-batch of 4 on dp 2: rank 0 holds a sample with one 4x4 image (4 placeholders after
    the 2x2 merge) and a text-only one, rank 1 two text-only samples; the encoder dict carries an
    extra per-image field, image_sizes [n_images, 2], so on rank 1 (no image, no patch row) it could
    be per-row as well as per-image."""
    shares = []
    for rank in range(2):
        ids = torch.zeros(2, 16, dtype=torch.int64)
        if rank == 0:
            ids[0, 0], ids[0, 1:5] = syn.VISION_START, syn.IMAGE_TOKEN
            enc = {"hidden_states": torch.arange(48, dtype=torch.float32).reshape(16, 3),
                   "grid_thw": torch.tensor([[1, 4, 4]]), "image_sizes": torch.tensor([[64, 64]])}
        else:
            enc = {"hidden_states": torch.zeros(0, 3), "grid_thw": torch.zeros(0, 3, dtype=torch.int64),
                   "image_sizes": torch.zeros(0, 2, dtype=torch.int64)}
        shares.append({"input_ids": ids, "sample_id": torch.tensor([2 * rank, 2 * rank + 1]),
                       "modality_inputs": {"images": {"vit": enc}}})
    return shares


def _negative_grid_thw():
    """Rank 0's second sample holds one image of grid_thw [1, -4, -4] (t*h*w = 16, as its 4
    placeholders x 4 need, but negative components)."""
    ids = torch.zeros(2, 16, dtype=torch.int64)
    ids[1, 0], ids[1, 1:5] = syn.VISION_START, syn.IMAGE_TOKEN
    bad = {"input_ids": ids, "sample_id": torch.tensor([0, 1]), "modality_inputs": {"images": {"vit": {
        "hidden_states": torch.zeros(16, 3), "grid_thw": torch.tensor([[1, -4, -4]])}}}}
    return [bad, {"input_ids": torch.zeros(2, 16, dtype=torch.int64), "sample_id": torch.tensor([2, 3]),
                  "modality_inputs": {"images": {"vit": {"hidden_states": torch.zeros(0, 3),
                                                         "grid_thw": torch.zeros(0, 3, dtype=torch.int64)}}}}]


def _labels_padded():
    shares = rank_shares(3)
    return _replace(shares, 1, labels=torch.nn.functional.pad(shares[1]["labels"], (0, 3)))


def _grid_thw_reversed_and_doubled():
    """Rank 0 (the first seed from 5 where it holds more than one image): its grid_thw rows reversed
    and their heights doubled, so they no longer match the placeholders in input_ids."""
    shares = next(sh for sh in (rank_shares(2, seed=k) for k in range(5, 50))
                  if len(sh[0]["modality_inputs"]["images"]["vit"]["grid_thw"]) > 1)
    vit = shares[0]["modality_inputs"]["images"]["vit"]
    bad = {"images": {"vit": {"hidden_states": vit["hidden_states"],
                              "grid_thw": vit["grid_thw"].flip(0) * torch.tensor([1, 2, 1])}}}
    return _replace(shares, 0, modality_inputs=bad)


def _field(name, fn):
    """callable(share) -> the share with fn(share[name]) in place of share[name]."""
    return lambda share: dict(share, **{name: fn(share[name])})


NAN = float("nan")
EVERY = "every rank of the DP group"
PEER = "by peer"  # Gloo's words for a peer process that is gone
PEER_NOTE = "Gloo's 'Connection closed by peer', at times 'Read error ...: Connection reset by peer'"
COSTS_RULE = "every sample cost must be finite and >= 0"
GROUPS_RULE = "the canonical grid G must be an integer >= 1"
IDS_RULE = "input_ids has dtype {}: it must hold integer token ids (torch.int64 or torch.int32); load the " \
           "tokens as integers, not cast to a float dtype"
MASK_VALUES = "attention_mask holds {} at sample {}, token {}: expected a 0/1 mask (1 = real token, 0 = padding); " \
              "an additive mask (0 = attend, -inf = masked) converts with (attention_mask == 0)"


def _balancer_case(name, input, costs, groups, balancer_msg, plan_msg):
    return FaultCase(name, "balancers", where="the costs of one call (no collective)", input=input,
                     sees=(Seen("balancer (every name in BALANCERS)", "ValueError", balancer_msg, "equals"),
                           Seen("plan_orders (every balancer)", "ValueError", plan_msg, "equals")),
                     params=dict(costs=costs, groups=groups))


def _cost_case(name, input, message, corrupt):
    return FaultCase(name, "cost", where="rank 1's micro-batch (2 samples of 192 tokens; emulated dp 2)", input=input,
                     sees=(Seen("count_samples on it", "ValueError", message, "equals"),
                           Seen(EVERY, "ReorderError", ("reorder failed on rank 1: ", message))),
                     params=dict(corrupt=corrupt))


def _mismatch(name, field_, ranks_config, message):
    return FaultCase(name, "emulated", where="WindowExchanger config of one rank (emulated dp 2)",
                     input=f"{field_} differs between the ranks",
                     sees=(Seen(EVERY, "ReorderError", message, "equals"),),
                     params=dict(config=ranks_config))


CASES = [
    # --- planning: bad costs or groups, refused by the one shared check (balancers.check_costs) --------
    _balancer_case("costs_nan", "costs [1, nan, 3, 4], groups 2", [1.0, NAN, 3.0, 4.0], 2,
                   f"costs[1] is nan: {COSTS_RULE}", f"costs[0, 1] is nan: {COSTS_RULE}"),
    _balancer_case("costs_negative", "costs [1, -5, 3, 4], groups 2", [1.0, -5.0, 3.0, 4.0], 2,
                   f"costs[1] is -5.0: {COSTS_RULE}", f"costs[0, 1] is -5.0: {COSTS_RULE}"),
    _balancer_case("costs_not_a_multiple_of_groups", "costs arange(6), groups 4", np.arange(6), 4,
                   "costs holds B=6 samples, not a positive multiple of groups=4: every group holds B/G samples, "
                   "so choose B as a multiple of G = lcm(DP sizes)",
                   "costs holds B=6 samples per slot, not a positive multiple of groups=4: every group holds B/G "
                   "samples, so choose B as a multiple of G = lcm(DP sizes)"),
    _balancer_case("costs_not_one_dimensional", "costs of shape (2, 4), groups 2", np.ones((2, 4)), 2,
                   "costs has shape (2, 4): expected one cost per sample, shape [B]",
                   "costs has shape (1, 2, 4): expected [slots, B], one row of per-sample costs per micro-batch"),
    _balancer_case("groups_zero", "costs [1, 1, 1, 1], groups 0", [1.0] * 4, 0,
                   f"groups=0 is invalid: {GROUPS_RULE}", f"groups=0 is invalid: {GROUPS_RULE}"),
    _balancer_case("groups_not_an_integer", "costs [1, 1, 1, 1], groups 2.0", [1.0] * 4, 2.0,
                   f"groups=2.0 is invalid: {GROUPS_RULE}", f"groups=2.0 is invalid: {GROUPS_RULE}"),

    # --- counting: a field of the wrong dtype, shape or values, on one rank ----------------------------
    _cost_case("input_ids_bfloat16", "input_ids cast to bfloat16", IDS_RULE.format("torch.bfloat16"),
               _field("input_ids", lambda t: t.to(torch.bfloat16))),
    _cost_case("input_ids_float32", "input_ids cast to float32", IDS_RULE.format("torch.float32"),
               _field("input_ids", lambda t: t.to(torch.float32))),
    _cost_case("attention_mask_complex", "attention_mask cast to complex64",
               "attention_mask must be a bool, integer or float 0/1 mask; got torch.complex64: give 1 for real "
               "tokens and 0 for padding", _field("attention_mask", lambda t: t.to(torch.complex64))),
    _cost_case("attention_mask_wider", "attention_mask one column wider than input_ids",
               "attention_mask has shape (2, 193) but input_ids has (2, 192): give one mask entry per token, "
               "shape [B, S] like input_ids", _field("attention_mask", lambda t: torch.nn.functional.pad(t, (0, 1)))),
    _cost_case("attention_mask_additive", "an additive float mask: 0 for real tokens, -inf for padding",
               MASK_VALUES.format("-inf", 0, 31), _field("attention_mask", lambda t: torch.where(t != 0, 0.0, -math.inf))),
    _cost_case("attention_mask_doubled", "an int64 mask of 0 and 2", MASK_VALUES.format(2, 0, 0),
               _field("attention_mask", lambda t: t * 2)),

    # --- one rank's bad input or config: every rank of the DP group raises the same ReorderError -------
    FaultCase("labels_wider_on_one_rank", "emulated", where="rank 1's micro-batch (emulated dp 3)",
              input="labels padded by 3 tokens (width 195, the others 192)",
              sees=(Seen(EVERY, "ReorderError", "batch layout differs across ranks: field 'labels' is int64 [192] "
                         "(batch dim 0) on ranks [0, 2], int64 [195] (batch dim 0) on ranks [1]; fields, dtypes and "
                         "per-sample shapes must match (pad to a fixed sequence length)", "equals"),),
              params=dict(dp=3, shares=_labels_padded)),
    FaultCase("grid_thw_disagrees_with_input_ids", "emulated", where="rank 0's micro-batch (emulated dp 2)",
              input="grid_thw rows reversed and heights doubled: patch rows no longer match the placeholders",
              sees=(Seen(EVERY, "ReorderError", "reorder failed on rank 0:", "starts"),),
              params=dict(shares=_grid_thw_reversed_and_doubled)),
    FaultCase("data_source_raises", "emulated", where="rank 1's data source (emulated dp 2)",
              input="OSError('disk gone') instead of a micro-batch",
              sees=(Seen(EVERY, "ReorderError", "reorder failed on rank 1: data source raised OSError: disk gone",
                         "equals"),),
              params=dict(source_error={1: OSError("disk gone")})),
    _mismatch("window_size_mismatch", "window_size (it sizes the window frame)", {1: dict(window_size=1)},
              "config mismatch across the DP group: window_size is 2 on ranks [0], 1 on ranks [1]"),
    _mismatch("micro_batch_size_mismatch", "micro_batch_size (it sizes the window frame)",
              {1: dict(micro_batch_size=8)},
              "config mismatch across the DP group: micro_batch_size is 4 on ranks [0], 8 on ranks [1]"),
    FaultCase("per_image_field_on_a_rank_without_images", "emulated",
              where="the encoder dict of every rank (emulated dp 2)",
              input="an extra per-image field image_sizes [n_images, 2]; rank 1 holds no image and no patch row",
              sees=(Seen(EVERY, None, note="a normal reorder: the field's kind is decided by the DP group, "
                                           "nothing lost"),),
              params=dict(shares=_image_sizes_shares)),
    FaultCase("grid_thw_negative", "emulated", where="rank 0's micro-batch (emulated dp 2)",
              input="grid_thw [1, -4, -4] for an image of 4 placeholders (the product matches the rows)",
              sees=(Seen(EVERY, "ReorderError",
                         "reorder failed on rank 0: micro-batch 0 sample 1 image 0: grid_thw [1, -4, -4] has a "
                         "component < 1: every t, h, w must be an integer >= 1", "starts"),),
              params=dict(shares=_negative_grid_thw)),
    _mismatch("encoder_weight_mismatch", "encoder_weight", {1: dict(cost=CostModel(encoder_weight=2.0))},
              "config mismatch across the DP group: encoder_weight is 1.0 on ranks [0], 2.0 on ranks [1]"),
    _mismatch("min_saving_mismatch", "min_saving", {0: dict(min_saving=0.0), 1: dict(min_saving=100.0)},
              "config mismatch across the DP group: min_saving is 0.0 on ranks [0], 100.0 on ranks [1]"),
    _mismatch("min_gain_mismatch", "min_gain (unset on rank 0)", {1: dict(min_gain=0.1)},
              "config mismatch across the DP group: min_gain is None on ranks [0], 0.1 on ranks [1]"),
    _mismatch("gate_backoff_mismatch", "gate_backoff (min_gain 0.5 on both)",
              {0: dict(min_gain=0.5, gate_backoff=0), 1: dict(min_gain=0.5, gate_backoff=2)},
              "config mismatch across the DP group: gate_backoff is 0 on ranks [0], 2 on ranks [1]"),
    _mismatch("shadow_mismatch", "shadow (on rank 0 only)", {0: dict(shadow=True)},
              "config mismatch across the DP group: shadow is 1 on ranks [0], 0 on ranks [1]"),
    _mismatch("cross_slot_mismatch", "cross_slot (on rank 1 only)", {1: dict(cross_slot=True)},
              "config mismatch across the DP group: cross_slot is 0 on ranks [0], 1 on ranks [1]"),

    # --- config that sizes the metadata, on real Gloo processes: the fixed-size config frame first ---
    FaultCase("window_size_mismatch_on_gloo", "gloo_config", where="WindowExchanger config of rank 0 (2 Gloo ranks)",
              input="window_size 2 on rank 0, 1 on rank 1",
              sees=(Seen(EVERY, "ReorderError", "config mismatch across the DP group: window_size is 2 on ranks "
                                                "[0], 1 on ranks [1]", "equals",
                         note="no process dies; synchronous and with overlap"),),
              params=dict(config={0: dict(window_size=2), 1: dict(window_size=1)})),
    FaultCase("micro_batch_size_mismatch_on_gloo", "gloo_config",
              where="WindowExchanger config of rank 1 (2 Gloo ranks)", input="micro_batch_size 4 on rank 0, 8 on rank 1",
              sees=(Seen(EVERY, "ReorderError", "config mismatch across the DP group: micro_batch_size is 4 on "
                                                "ranks [0], 8 on ranks [1]", "equals",
                         note="no process dies; synchronous and with overlap"),),
              params=dict(config={0: dict(micro_batch_size=4), 1: dict(micro_batch_size=8)})),

    # --- overlap buffer ---------------------------------------------------------------------------------
    FaultCase("source_raises_in_a_skipped_run", "buffer",
              where="the data source of a dp-1 rank with overlap and gate backoff, after 4 micro-batches",
              input="OSError('disk read failed') while the training thread passes a run of skipped windows",
              sees=(Seen("the rank", "ReorderError", "data source raised OSError: disk read failed",
                         note="raised on the training thread at the next micro-batch; the overlap worker stops"),),
              params=dict(source_error=OSError("disk read failed"))),

    # --- real processes (Gloo, forked): vision dp 2 + language dp 2 -------------------------------------
    FaultCase("source_raises", "gloo", where="language rank 1's data source, micro-batch 3",
              input="OSError('disk read failed at micro-batch 3')",
              sees=(Seen("language", "ReorderError", "data source raised OSError: disk read failed at micro-batch 3"),
                    Seen("vision", None, note="serves all 7 micro-batches")),
              params=dict(argv=["--vision-dp", "2", "--language-dp", "2", "--case", "source_raises", "--timeout", "30"],
                          world=4)),
    FaultCase("bad_input", "gloo", where="vision rank 0's micro-batch 3",
              input="input_ids one token short (159 wide, the others 160)",
              sees=(Seen("vision", "ReorderError", "pad to a fixed"),
                    Seen("language", None, note="serves all 7 micro-batches")),
              params=dict(argv=["--vision-dp", "2", "--language-dp", "2", "--case", "bad_input", "--timeout", "30"],
                          world=4)),
    FaultCase("corrupt", "gloo", where="language rank 0's executor, window 1 (micro-batches 2-3), self-check on "
                                       "every window",
              input="one bit flipped in the first buffer it writes",
              sees=(Seen("language", "ReorderError", ("self-check failed: window 1, micro-batch", "differs in field"),
                         note="the same text on both ranks, at window 2, after serving micro-batches 0-3: a window "
                              "is compared when the next one's frames arrive"),
                    Seen("vision", None, note="serves all 7 micro-batches")),
              params=dict(argv=["--vision-dp", "2", "--language-dp", "2", "--case", "corrupt", "--verify", "1",
                                "--timeout", "30"], world=4, served={"language": 4})),
    # --- online calibration: every rank of the fit group decides alike, training goes on ------------
    FaultCase("calibration_time_not_finite", "calibration", where="rank 1's step time, window 5",
              input="ms = nan (the same for inf)",
              sees=(Seen("rank 1", None, "add_row(ms=nan) refused (window 5, slot 0): the step time must be a finite "
                                         "number >= 0", note="a warning; that micro-batch goes unmeasured"),
                    Seen("every rank", None, "switched", note="the fits go on with the other rows: the same "
                                                             "weights on every rank")),
              params=dict(sim=dict(bad=(1, 5, math.nan)))),
    FaultCase("calibration_time_negative", "calibration", where="rank 1's step time, window 5", input="ms = -1.0",
              sees=(Seen("rank 1", None, "add_row(ms=-1.0) refused (window 5, slot 0)",
                         note="a warning; that micro-batch goes unmeasured"),
                    Seen("every rank", None, "switched", note="the fits go on with the other rows: the same "
                                                             "weights on every rank")),
              params=dict(sim=dict(bad=(1, 5, -1.0)))),
    FaultCase("calibration_rank_stops_timing", "calibration", where="rank 1 of 4, from window 9 on",
              input="no step times (timed_step never entered, record_step_ms never called)",
              sees=(Seen("every rank", None, "rank 1 of the fit group sent 0 step times",
                         note="every later fit is held on every rank (a warning on rank 0): the last good weights "
                              "stay active, plans go on; it resumes when the rank reports again"),),
              params=dict(sim=dict(silent=(1, 9)))),
    FaultCase("calibration_no_rank_times", "calibration", where="every rank, from window 0",
              input="no step times at all", sees=(Seen("every rank", None, "no step times in windows 0..2 from any "
                                                                           "rank: time each step with buf.timed_step()",
                                                       note="each fit held; the configured weights stay"),),
              params=dict(sim=dict(silent_all_from=0))),
    FaultCase("calibration_too_few_rows", "calibration", where="the fit group (1 rank, W 1, every 2 windows)",
              input="2 rows per fit",
              sees=(Seen("every rank", None, ("rows=2 for windows 0..1: too few to fit (at least 7: 5 weights, an "
                                              "intercept and one residual); they join the next fit's rows, the "
                                              "active weights hold", "rows=6 for windows 0..5", "min_gain"),
                         note="held fits (one warning on rank 0) until the rows carried along reach 7; the fit of "
                              "windows 0..7 is then judged as any other"),),
              params=dict(sim=dict(ranks=1, window_size=1, every=2))),
    FaultCase("calibration_settings_differ", "calibration", where="rank 2's calibration settings",
              input="every = 3 on rank 2, 4 on ranks 0 and 1",
              sees=(Seen("every rank", "ValueError", "reorder calibration: the calibration settings differ across the "
                                                     "fit group: every = 4 on ranks 0, 1; 3 on rank 2", match="equals",
                         note="raised by every rank at the first fit's header all-gather (fixed size, before the "
                              "rows), so no rank waits for a frame of another size"),),
              params=dict(per_rank=[dict(every=4), dict(every=4), dict(every=3)])),
    FaultCase("early_end", "gloo", where="vision rank 0's data source",
              input="ends after 3 micro-batches (the others yield 7)",
              sees=(Seen("vision", "ReorderError", "micro-batch count of this window differs across the DP group"),
                    Seen("language", None, note="serves all 7 micro-batches")),
              params=dict(argv=["--vision-dp", "2", "--language-dp", "2", "--case", "early_end", "--timeout", "30"],
                          world=4)),
    FaultCase("lost_peer", "gloo", where="language rank 1 (vision dp 1 + language dp 2)",
              input="the process exits (os._exit(0)) before its first exchange",
              sees=(Seen("language rank 0", "CollectiveError", ("reorder metadata all_gather failed on rank 0", PEER),
                         note=f"at once, well within the 10 s timeout; {PEER_NOTE}"),
                    Seen("vision", None, note="dp 1, no collective: serves all 7 micro-batches")),
              params=dict(argv=["--vision-dp", "1", "--language-dp", "2", "--case", "lost_peer", "--timeout", "10"],
                          world=3, dead=[2])),

    # --- a real launcher: torchrun, uncaught errors, the bridge between the modules ----------------------
    FaultCase("bad_input_under_torchrun", "torchrun", where="vision rank 0's micro-batch 3 (vision dp 2 + language dp 2)",
              input="input_ids one token short; errors uncaught (as in training); after each micro-batch vision "
                    "sends to language point-to-point (the bridge)",
              sees=(Seen("vision", "ReorderError", ("reorder failed on rank 0: ", "pad to a fixed"),
                         note="both vision ranks, at window 1 (micro-batches 2-3): traceback, exit 1 (or SIGTERM "
                              "from torchrun while still exiting)"),
                    Seen("language", "RuntimeError", PEER,
                         note=f"{PEER_NOTE}; no ReorderError: blocked in the bridge receive of micro-batch 2 until the first vision "
                              "process exits (about 1 s after its error), then Gloo's error and traceback, then SIGTERM "
                              "from torchrun (exit code -15, or 1 if it exited first); on a loaded machine the SIGTERM "
                              "can come first"),
                    Seen("torchrun", "ChildFailedError", ("Root Cause", "ReorderError"),
                         note="exit code 1; the summary's Root Cause is a vision rank's ReorderError; no process "
                              "of the job is left")),
              params=dict(argv=["--vision-dp", "2", "--language-dp", "2", "--case", "bad_input", "--uncaught",
                                "--bridge", "--timeout", "30"], nproc=4, sigterm_ok=["language"])),
]

_names = [c.name for c in CASES]
if len(set(_names)) != len(_names):
    raise ValueError(f"fault case names must be unique: {sorted(n for n in set(_names) if _names.count(n) > 1)}")


def cases(suite: str) -> list:
    """The records one suite's test runs (pytest ids: `name`)."""
    if suite not in SUITES:
        raise ValueError(f"suite={suite!r} is unknown: use one of {sorted(SUITES)}")
    return [c for c in CASES if c.suite == suite]


def name(case: FaultCase) -> str:
    return case.name
