"""Reorder configuration: the upstream `megatron_mimo_*` fields, their rules, and a layout check.

`ReorderConfig` carries the six field names and defaults of upstream Megatron-Bridge plus this
library's own knobs, prefixed the same way (`megatron_mimo_reorder_balancer`, token ids, merge size,
cost terms, gate, ...) so that they cannot collide with other fields of a Megatron-Bridge dataset
config; their flags and read-only properties keep short names (`--reorder-balancer`, `cfg.balancer`).
It validates itself on construction; every error is a ValueError naming the field and its value.
Build it directly, from any object or mapping carrying those attributes (`from_object`, e.g. a
Megatron-Bridge dataset config), from training-script flags (`add_reorder_args` + `from_args`), or
take the token ids from the model's transformers config (`from_hf_config`).

Flag `--intra-microbatch-reorder` also sets `megatron_mimo_scalable_dp` (reordering balances the
fixed 1/dp shares that scalable reads give each rank, so it is meaningless without them). A config
built any other way must set both: `from_object` never turns scalable reads on by itself, because they
change which samples each rank loads.
"""

from __future__ import annotations

import argparse
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, fields


_BOOLS = ("megatron_mimo_scalable_dp", "megatron_mimo_intra_microbatch_reorder", "megatron_mimo_reorder_overlap",
          "megatron_mimo_reorder_shadow", "megatron_mimo_reorder_cross_slot")
# CostModel parameter -> the field that sets it
_COST_FIELDS = {
    "encoder_weight": "megatron_mimo_reorder_encoder_cost_weight",
    "language_weight": "megatron_mimo_reorder_language_cost_weight",
    "encoder_quadratic_weight": "megatron_mimo_reorder_encoder_quadratic_weight",
    "language_quadratic_weight": "megatron_mimo_reorder_language_quadratic_weight",
    "encoder_image_weight": "megatron_mimo_reorder_encoder_image_weight",
    "image_token_id": "megatron_mimo_reorder_image_token_id",
    "vision_start_token_id": "megatron_mimo_reorder_vision_start_token_id",
    "spatial_merge_size": "megatron_mimo_reorder_spatial_merge_size",
}
# integer fields -> their minimum
_INTEGERS = {"megatron_mimo_reorder_window_size": 1, "megatron_mimo_reorder_spatial_merge_size": 1,
             "megatron_mimo_reorder_overlap_ahead": 1, "megatron_mimo_reorder_image_token_id": 0,
             "megatron_mimo_reorder_vision_start_token_id": 0, "megatron_mimo_reorder_gate_backoff": 0,
             "megatron_mimo_reorder_verify": 0, "megatron_mimo_reorder_calibrate_every": 1,
             "megatron_mimo_reorder_calibrate_history": 1}
_CALIBRATE_MODES = ("off", "shadow", "on")
# calibration thresholds -> (lowest, highest or None, highest included)
_CALIBRATE_RANGES = {"megatron_mimo_reorder_calibrate_min_r2": (0.0, 1.0, True),
                     "megatron_mimo_reorder_calibrate_min_gain": (0.0, 1.0, False),
                     "megatron_mimo_reorder_calibrate_drift": (0.0, None, False)}

_WEIGHTS = tuple(name for name in _COST_FIELDS.values() if name not in _INTEGERS)  # the cost weights


@dataclass(frozen=True, slots=True, kw_only=True)
class ReorderConfig:
    """Validated reorder settings (frozen). Field names of the first six follow upstream."""

    megatron_mimo_scalable_dp: bool = False
    megatron_mimo_intra_microbatch_reorder: bool = False
    megatron_mimo_reorder_encoder_cost_weight: float = 1.0
    megatron_mimo_reorder_language_cost_weight: float = 0.0
    megatron_mimo_reorder_overlap: bool = True
    megatron_mimo_reorder_window_size: int = 1
    # this library's own fields (short names: the read-only properties below)
    megatron_mimo_reorder_balancer: str = "balanced"
    megatron_mimo_reorder_image_token_id: int = 248056  # Qwen3.5's; see from_hf_config
    megatron_mimo_reorder_vision_start_token_id: int = 248053
    megatron_mimo_reorder_spatial_merge_size: int = 2
    megatron_mimo_reorder_shadow: bool = False  # plan and report per window, move nothing
    # balance over the whole window (valid only with window-level loss normalization)
    megatron_mimo_reorder_cross_slot: bool = False
    megatron_mimo_reorder_encoder_quadratic_weight: float = 0.0  # cost per (patches of one image)**2 (full attention)
    megatron_mimo_reorder_language_quadratic_weight: float = 0.0  # cost per real_tokens**2
    megatron_mimo_reorder_encoder_image_weight: float = 0.0  # cost per image (fixed per-image encoder work)
    megatron_mimo_reorder_min_gain: float | None = None  # gate: relative gain a micro-batch must exceed to move
    megatron_mimo_reorder_min_saving: float | None = None  # gate: saving (cost units) a micro-batch must exceed to move
    megatron_mimo_reorder_overlap_ahead: int = 1  # with overlap: windows queued or in flight ahead of the one consumed
    megatron_mimo_reorder_gate_backoff: int = 0  # after gated windows in a row, skip up to this many unplanned (0: off)
    megatron_mimo_reorder_verify: int = 0  # runtime self-check: 0 off, 1 every window, N every N-th window
    megatron_mimo_reorder_calibrate: str = "off"  # online cost calibration: off, shadow (fit, never switch), on
    megatron_mimo_reorder_calibrate_every: int = 4  # windows of measurements per fit
    megatron_mimo_reorder_calibrate_min_r2: float = 0.8  # a fit switches only with R^2 >= this
    megatron_mimo_reorder_calibrate_min_gain: float = 0.05  # ... and a predicted relative spread gain >= this
    megatron_mimo_reorder_calibrate_drift: float = 0.25  # re-fit when the residual on new steps grows by this fraction
    megatron_mimo_reorder_calibrate_history: int = 8  # fits whose rows the calibration pool keeps (per regime)

    def __post_init__(self):
        self._parse_fields()
        if self.megatron_mimo_intra_microbatch_reorder and not self.megatron_mimo_scalable_dp:
            raise ValueError("megatron_mimo_intra_microbatch_reorder=True requires "
                             "megatron_mimo_scalable_dp=True: reordering balances the 1/dp shares of "
                             "scalable reads; set both (flag --intra-microbatch-reorder does)")
        if self.image_token_id == self.vision_start_token_id:
            raise ValueError(f"megatron_mimo_reorder_image_token_id={self.image_token_id} equals "
                             f"megatron_mimo_reorder_vision_start_token_id={self.vision_start_token_id}: they must be "
                             "different tokens")
        self._check_objects()

    def _parse_fields(self) -> None:
        """Every field's type and range, named as the field; numbers normalised to float / int."""
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: must be a bool")
        for name in _WEIGHTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r}: must be a finite number >= 0")
            object.__setattr__(self, name, float(v))
        for name, minimum in _INTEGERS.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < minimum:
                raise ValueError(f"{name}={v!r}: must be an integer >= {minimum}")
            object.__setattr__(self, name, int(v))
        for name, top in (("megatron_mimo_reorder_min_gain", 1.0), ("megatron_mimo_reorder_min_saving", math.inf)):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or not 0 <= v < top:
                raise ValueError(f"{name}={v!r}: must be a finite number >= 0" + (" and < 1" if top == 1 else "")
                                 + " (or unset)")
            object.__setattr__(self, name, float(v))
        if self.megatron_mimo_reorder_calibrate not in _CALIBRATE_MODES:
            raise ValueError(f"megatron_mimo_reorder_calibrate={self.megatron_mimo_reorder_calibrate!r}: must be one "
                             f"of {', '.join(_CALIBRATE_MODES)}")
        for name, (lo, hi, closed) in _CALIBRATE_RANGES.items():
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < lo or (
                    hi is not None and (v > hi if closed else v >= hi)):
                top = "" if hi is None else f" and {'<=' if closed else '<'} {hi:g}"
                raise ValueError(f"{name}={v!r}: must be a finite number >= {lo:g}{top}")
            object.__setattr__(self, name, float(v))
        if not isinstance(self.balancer, str):
            raise ValueError(f"megatron_mimo_reorder_balancer={self.balancer!r}: must be a balancer name (str)")

    def _check_objects(self) -> None:
        """The rules of the objects this config builds, decided by them (`CostModel`, `PlanSettings`)
        and worded with the config's field names."""
        try:
            self.cost_model()
        except ValueError as e:  # every field is parsed: the rule left is that some weight is > 0
            raise ValueError("megatron_mimo_reorder_encoder_cost_weight=0.0 and "
                             "megatron_mimo_reorder_language_cost_weight=0.0 (and no quadratic or per-image "
                             "weight): at least one cost weight must be > 0, otherwise every sample costs 0 "
                             "and there is nothing to balance") from e
        try:
            settings = self.plan_settings()
        except ValueError as e:  # the balancer: "balancer='x' is unknown; choose one of [...]"
            raise ValueError(f"megatron_mimo_reorder_{e}") from None
        if self.gate_backoff and not settings.gated:
            raise ValueError(f"megatron_mimo_reorder_gate_backoff={self.gate_backoff}: the backoff skips windows after "
                             "the cost-benefit gate kept them natural; set megatron_mimo_reorder_min_gain or "
                             "megatron_mimo_reorder_min_saving too")

    # -- convenience ---------------------------------------------------------------------------
    @property
    def enabled(self) -> bool:
        return self.megatron_mimo_intra_microbatch_reorder

    @property
    def encoder_weight(self) -> float:
        return self.megatron_mimo_reorder_encoder_cost_weight

    @property
    def language_weight(self) -> float:
        return self.megatron_mimo_reorder_language_cost_weight

    @property
    def overlap(self) -> bool:
        return self.megatron_mimo_reorder_overlap

    @property
    def window_size(self) -> int:
        return self.megatron_mimo_reorder_window_size

    @property
    def balancer(self) -> str:
        return self.megatron_mimo_reorder_balancer

    @property
    def image_token_id(self) -> int:
        return self.megatron_mimo_reorder_image_token_id

    @property
    def vision_start_token_id(self) -> int:
        return self.megatron_mimo_reorder_vision_start_token_id

    @property
    def spatial_merge_size(self) -> int:
        return self.megatron_mimo_reorder_spatial_merge_size

    @property
    def shadow(self) -> bool:
        return self.megatron_mimo_reorder_shadow

    @property
    def cross_slot(self) -> bool:
        return self.megatron_mimo_reorder_cross_slot

    @property
    def encoder_quadratic_weight(self) -> float:
        return self.megatron_mimo_reorder_encoder_quadratic_weight

    @property
    def language_quadratic_weight(self) -> float:
        return self.megatron_mimo_reorder_language_quadratic_weight

    @property
    def encoder_image_weight(self) -> float:
        return self.megatron_mimo_reorder_encoder_image_weight

    @property
    def min_gain(self) -> float | None:
        return self.megatron_mimo_reorder_min_gain

    @property
    def min_saving(self) -> float | None:
        return self.megatron_mimo_reorder_min_saving

    @property
    def overlap_ahead(self) -> int:
        return self.megatron_mimo_reorder_overlap_ahead

    @property
    def gate_backoff(self) -> int:
        return self.megatron_mimo_reorder_gate_backoff

    @property
    def verify(self) -> int:
        return self.megatron_mimo_reorder_verify

    @property
    def calibrate(self) -> str:
        return self.megatron_mimo_reorder_calibrate

    def calibration_settings(self) -> dict:
        """The `reorder.runtime.calibration.Calibration` keyword arguments this config sets."""
        return dict(mode=self.calibrate, window_size=self.window_size,
                    every=self.megatron_mimo_reorder_calibrate_every,
                    min_r2=self.megatron_mimo_reorder_calibrate_min_r2,
                    min_gain=self.megatron_mimo_reorder_calibrate_min_gain,
                    drift=self.megatron_mimo_reorder_calibrate_drift,
                    history=self.megatron_mimo_reorder_calibrate_history)

    @property
    def needs_attention_mask(self) -> bool:
        """The language cost counts real tokens, so every rank must load attention_mask."""
        return self.language_weight > 0 or self.language_quadratic_weight > 0

    # -- the library objects it configures ---------------------------------------------------
    def cost_model(self):
        """The `CostModel` these weights, token ids and merge size describe."""
        from reorder.plan.cost import CostModel

        return CostModel(**{param: getattr(self, name) for param, name in _COST_FIELDS.items()})

    def plan_settings(self):
        """The `PlanSettings` (balancer, gate, shadow, cross-slot) of every window."""
        from reorder.plan.window import PlanSettings

        return PlanSettings(balancer=self.balancer, min_gain=self.min_gain, min_saving=self.min_saving,
                            cross_slot=self.cross_slot, shadow=self.shadow)

    def exchanger_settings(self) -> dict:
        """The `WindowExchanger` keyword arguments this config sets: the cost model, the planning
        settings (`plan_settings`), the window (size, gate backoff) and the self-check."""
        return dict(cost=self.cost_model(), balancer=self.balancer, window_size=self.window_size, shadow=self.shadow,
                    cross_slot=self.cross_slot, min_gain=self.min_gain, min_saving=self.min_saving,
                    gate_backoff=self.gate_backoff, verify=self.verify)

    # -- builders ------------------------------------------------------------------------------
    @classmethod
    def from_object(cls, obj, **overrides) -> "ReorderConfig":
        """Read every field from attributes (or keys, for a mapping) of `obj`; missing or None values
        take the default. Keyword `overrides` win over `obj`."""
        kwargs = {}
        for f in fields(cls):
            v = obj.get(f.name) if isinstance(obj, Mapping) else getattr(obj, f.name, None)
            if v is not None:
                kwargs[f.name] = v
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_args(cls, namespace: argparse.Namespace) -> "ReorderConfig":
        """Build from a namespace parsed with `add_reorder_args` (its dests are the field names)."""
        return cls.from_object(namespace)

    @classmethod
    def from_hf_config(cls, hf_config, source=None, **overrides) -> "ReorderConfig":
        """The model's token ids and merge size from a transformers config (Qwen2-VL, Qwen2.5-VL,
        Qwen3-VL, Qwen3.5: `image_token_id`, `vision_start_token_id`, `vision_config.spatial_merge_size`),
        every other field from `source` (read as `from_object` does: a dataset config, parsed flags, a
        mapping) or its default. They win over `source`; keyword `overrides` win over both."""
        def get(obj, name):
            return obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)

        kind = type(hf_config).__name__
        vision = get(hf_config, "vision_config")
        found = {"image_token_id": get(hf_config, "image_token_id"),
                 "vision_start_token_id": get(hf_config, "vision_start_token_id"),
                 "spatial_merge_size": None if vision is None else get(vision, "spatial_merge_size")}
        missing = [k for k, v in found.items() if v is None]
        if missing:
            where = ", ".join(("vision_config." if k == "spatial_merge_size" else "") + k for k in missing)
            fields_ = ", ".join("megatron_mimo_reorder_" + k for k in missing)
            raise ValueError(f"{kind} has no {where}: not a Qwen-VL-style config; set {fields_} yourself")
        found = {f"megatron_mimo_reorder_{k}": v for k, v in found.items()}
        return cls.from_object({} if source is None else source, **{**found, **overrides})


class _EnableReorder(argparse.Action):
    """--intra-microbatch-reorder: turn reordering on, and scalable reads with it."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        namespace.megatron_mimo_scalable_dp = True


def add_reorder_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the reorder flags to `parser` in their own help group (dests = ReorderConfig field names)
    and return `parser`, so it can serve as Megatron's `extra_args_provider`
    (`pretrain(..., extra_args_provider=add_reorder_args)`, which runs `parser = provider(parser)`)."""
    from reorder.plan.balancers import BALANCERS

    d = ReorderConfig()
    g = parser.add_argument_group("intra-micro-batch reorder")
    g.add_argument("--scalable-dp", dest="megatron_mimo_scalable_dp", action="store_true",
                   help="each DP rank reads a fixed contiguous 1/dp share of every global micro-batch")
    g.add_argument("--intra-microbatch-reorder", dest="megatron_mimo_intra_microbatch_reorder",
                   action=_EnableReorder, help="rebalance each micro-batch across the module's DP "
                   "group (implies --scalable-dp)")
    g.add_argument("--reorder-encoder-cost-weight", dest="megatron_mimo_reorder_encoder_cost_weight",
                   type=float, default=d.encoder_weight, help="cost per image-placeholder token")
    g.add_argument("--reorder-language-cost-weight", dest="megatron_mimo_reorder_language_cost_weight",
                   type=float, default=d.language_weight, help="cost per real (attended) token")
    g.add_argument("--no-overlap-intra-microbatch-reorder", dest="megatron_mimo_reorder_overlap",
                   action="store_false", help="run each window's exchange synchronously")
    g.add_argument("--reorder-window-size", dest="megatron_mimo_reorder_window_size", type=int,
                   default=d.window_size, help="micro-batches balanced by one exchange")
    g.add_argument("--reorder-overlap-ahead", dest="megatron_mimo_reorder_overlap_ahead", type=int,
                   default=d.overlap_ahead,
                   help="with overlap: windows reordered ahead of the one being consumed (1: at most one "
                        "more window on the device; 2 absorbs jitter, one more window resident)")
    g.add_argument("--reorder-balancer", dest="megatron_mimo_reorder_balancer", default=d.balancer,
                   help=f"assignment algorithm, one of {sorted(BALANCERS)}")
    g.add_argument("--reorder-encoder-quadratic-weight", dest="megatron_mimo_reorder_encoder_quadratic_weight",
                   type=float, default=d.encoder_quadratic_weight, help="cost per (patches of one image)^2")
    g.add_argument("--reorder-language-quadratic-weight", dest="megatron_mimo_reorder_language_quadratic_weight",
                   type=float, default=d.language_quadratic_weight, help="cost per (real tokens)^2")
    g.add_argument("--reorder-encoder-image-weight", dest="megatron_mimo_reorder_encoder_image_weight", type=float,
                   default=d.encoder_image_weight, help="cost per image (fixed per-image encoder work)")
    g.add_argument("--reorder-cross-slot", dest="megatron_mimo_reorder_cross_slot", action="store_true",
                   help="balance over the W micro-batches of a window (samples may change micro-batch; only "
                        "with one optimizer step per window and loss normalized over the global batch)")
    g.add_argument("--reorder-min-gain", dest="megatron_mimo_reorder_min_gain", type=float, default=None,
                   help="cost-benefit gate: keep a micro-batch's natural assignment unless its relative "
                        "gain in max group load exceeds this (0..1)")
    g.add_argument("--reorder-min-saving", dest="megatron_mimo_reorder_min_saving", type=float, default=None,
                   help="cost-benefit gate: keep a micro-batch's natural assignment unless it saves more "
                        "than this in max group load (cost units; ms with calibrated weights)")
    g.add_argument("--reorder-gate-backoff", dest="megatron_mimo_reorder_gate_backoff", type=int,
                   default=d.gate_backoff,
                   help="after k planned windows in a row kept natural by the gate, skip the next "
                        "min(2^(k-1), N) windows without planning or communicating (0: off)")
    g.add_argument("--reorder-verify", dest="megatron_mimo_reorder_verify", type=int, default=d.verify,
                   help="runtime self-check: per-sample checksums of what each rank read and of what it assembled "
                        "travel with the next window and every rank compares them; a mismatch stops every rank of "
                        "the group with the window, sample, field and source rank (0: off, 1: every window, N: "
                        "every N-th)")
    g.add_argument("--reorder-calibrate", dest="megatron_mimo_reorder_calibrate", default=d.calibrate,
                   choices=_CALIBRATE_MODES,
                   help="online cost calibration from measured step times (buf.timed_step()): off, shadow "
                        "(fit and report, never switch) or on (switch to the fitted weights)")
    g.add_argument("--reorder-calibrate-every", dest="megatron_mimo_reorder_calibrate_every", type=int,
                   default=d.megatron_mimo_reorder_calibrate_every, help="windows of measurements per fit")
    g.add_argument("--reorder-calibrate-min-r2", dest="megatron_mimo_reorder_calibrate_min_r2", type=float,
                   default=d.megatron_mimo_reorder_calibrate_min_r2, help="switch only when the fit's R^2 >= this")
    g.add_argument("--reorder-calibrate-min-gain", dest="megatron_mimo_reorder_calibrate_min_gain", type=float,
                   default=d.megatron_mimo_reorder_calibrate_min_gain,
                   help="switch only when the predicted relative gain in step-time spread >= this (0..1)")
    g.add_argument("--reorder-calibrate-drift", dest="megatron_mimo_reorder_calibrate_drift", type=float,
                   default=d.megatron_mimo_reorder_calibrate_drift,
                   help="re-fit when the last fit's RMS residual on two consecutive blocks of new measurements "
                        "exceeds (1 + this) x the residual it expects (the step time drifted)")
    g.add_argument("--reorder-calibrate-history", dest="megatron_mimo_reorder_calibrate_history", type=int,
                   default=d.megatron_mimo_reorder_calibrate_history,
                   help="fits whose measurements the calibration keeps and fits together (a drift restarts them)")
    g.add_argument("--reorder-shadow", dest="megatron_mimo_reorder_shadow", action="store_true",
                   help="plan and log what reordering would do, move nothing")
    g.add_argument("--reorder-image-token-id", dest="megatron_mimo_reorder_image_token_id", type=int,
                   default=d.image_token_id,
                   help="the image placeholder token (the HF config's image_token_id; default Qwen3.5's)")
    g.add_argument("--reorder-vision-start-token-id", dest="megatron_mimo_reorder_vision_start_token_id", type=int,
                   default=d.vision_start_token_id,
                   help="the token that opens each image (vision_start_token_id; default Qwen3.5's)")
    g.add_argument("--reorder-spatial-merge-size", dest="megatron_mimo_reorder_spatial_merge_size", type=int,
                   default=d.spatial_merge_size,
                   help="patches merged per placeholder along each side (vision_config.spatial_merge_size)")
    return parser


def check_model_layout(*, encoder_pp: int, encoder_dp: int, language_dp: int,
                       fixed_width_padding: bool) -> None:
    """Reject model layouts reorder cannot serve; each ValueError says what to change."""
    for name, v in (("encoder_pp", encoder_pp), ("encoder_dp", encoder_dp), ("language_dp", language_dp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r}: must be an integer >= 1")
    if encoder_pp > 1:
        raise ValueError(f"encoder_pp={encoder_pp}: reorder does not support a pipeline-parallel "
                         f"vision encoder; set the encoder's pipeline-parallel size to 1")
    if encoder_dp > language_dp:
        raise ValueError(f"encoder_dp={encoder_dp} > language_dp={language_dp}: MimoModel's fan-in "
                         f"path asserts on variable image-token counts; give the language module at "
                         f"least the encoder's DP size")
    if language_dp % encoder_dp:
        raise ValueError(f"language_dp={language_dp} is not a multiple of encoder_dp={encoder_dp}: "
                         f"each encoder replica must feed a whole number of language replicas")
    if fixed_width_padding is not True:
        raise ValueError(f"fixed_width_padding={fixed_width_padding!r}: reorder concatenates samples "
                         f"from other ranks, so every sample must be padded to the same fixed sequence "
                         f"length; pad to the configured seq_length instead of the longest in the batch")
