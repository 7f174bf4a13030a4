"""ReorderConfig: upstream field names and defaults, validation messages, builders, layout checks."""

import argparse
import dataclasses
import types

import expecttest
import pytest
from hypothesis import given, settings, strategies as st

from reorder.plan.balancers import BALANCERS
from reorder.integrations.config import ReorderConfig, add_reorder_args, check_model_layout

UPSTREAM = {
    "megatron_mimo_scalable_dp": False,
    "megatron_mimo_intra_microbatch_reorder": False,
    "megatron_mimo_reorder_encoder_cost_weight": 1.0,
    "megatron_mimo_reorder_language_cost_weight": 0.0,
    "megatron_mimo_reorder_overlap": True,
    "megatron_mimo_reorder_window_size": 1,
}
ON = {"megatron_mimo_scalable_dp": True, "megatron_mimo_intra_microbatch_reorder": True}


def parse(argv):
    parser = argparse.ArgumentParser()
    add_reorder_args(parser)
    return parser.parse_args(argv)


def test_defaults():
    c = ReorderConfig()
    assert {k: getattr(c, k) for k in UPSTREAM} == UPSTREAM
    assert (c.balancer, c.image_token_id, c.vision_start_token_id, c.spatial_merge_size) == (
        "balanced", 248056, 248053, 2)
    assert (c.enabled, c.encoder_weight, c.language_weight, c.overlap, c.window_size) == (
        False, 1.0, 0.0, True, 1)
    assert not c.needs_attention_mask
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.megatron_mimo_reorder_balancer = "identity"


def test_properties_and_weight_normalisation():
    c = ReorderConfig(**ON, megatron_mimo_reorder_encoder_cost_weight=2,
                      megatron_mimo_reorder_language_cost_weight=0.5, megatron_mimo_reorder_overlap=False,
                      megatron_mimo_reorder_window_size=4)
    assert (c.enabled, c.encoder_weight, c.language_weight, c.overlap, c.window_size) == (
        True, 2.0, 0.5, False, 4)
    assert isinstance(c.encoder_weight, float) and c.needs_attention_mask


def test_from_object_and_mapping():
    obj = types.SimpleNamespace(megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=True,
                                megatron_mimo_reorder_window_size=2, seq_length=4096,
                                megatron_mimo_reorder_overlap=None)  # None -> default
    c = ReorderConfig.from_object(obj)
    assert c == ReorderConfig(**ON, megatron_mimo_reorder_window_size=2)
    assert ReorderConfig.from_object(object()) == ReorderConfig()
    assert ReorderConfig.from_object({"megatron_mimo_reorder_language_cost_weight": 0.25}).language_weight == 0.25
    assert ReorderConfig.from_object(obj, megatron_mimo_reorder_balancer="identity").balancer == "identity"
    with pytest.raises(ValueError, match="megatron_mimo_reorder_window_size=0"):
        ReorderConfig.from_object(types.SimpleNamespace(megatron_mimo_reorder_window_size=0))


def test_argparse_defaults_and_round_trip():
    assert ReorderConfig.from_args(parse([])) == ReorderConfig()
    ns = parse(["--intra-microbatch-reorder", "--reorder-encoder-cost-weight", "2",
                "--reorder-language-cost-weight", "0.5", "--no-overlap-intra-microbatch-reorder",
                "--reorder-window-size", "3", "--reorder-balancer", "identity"])
    assert ns.megatron_mimo_scalable_dp  # --intra-microbatch-reorder implies --scalable-dp
    assert ReorderConfig.from_args(ns) == ReorderConfig(
        **ON, megatron_mimo_reorder_encoder_cost_weight=2.0, megatron_mimo_reorder_language_cost_weight=0.5,
        megatron_mimo_reorder_overlap=False, megatron_mimo_reorder_window_size=3,
        megatron_mimo_reorder_balancer="identity")
    assert ReorderConfig.from_args(parse(["--scalable-dp"])) == ReorderConfig(megatron_mimo_scalable_dp=True)


@settings(max_examples=50, deadline=None)
@given(on=st.booleans(), scalable=st.booleans(), ew=st.floats(0, 10), lw=st.floats(0, 10),
       overlap=st.booleans(), window=st.integers(1, 8), balancer=st.sampled_from(sorted(BALANCERS)))
def test_argparse_round_trip_property(on, scalable, ew, lw, overlap, window, balancer):
    if ew == 0 == lw:
        ew = 1.0
    argv = (["--intra-microbatch-reorder"] * on + ["--scalable-dp"] * scalable
            + ["--no-overlap-intra-microbatch-reorder"] * (not overlap)
            + ["--reorder-encoder-cost-weight", repr(ew), "--reorder-language-cost-weight", repr(lw),
               "--reorder-window-size", str(window), "--reorder-balancer", balancer])
    c = ReorderConfig.from_args(parse(argv))
    assert (c.enabled, c.megatron_mimo_scalable_dp, c.encoder_weight, c.language_weight, c.overlap,
            c.window_size, c.balancer) == (on, on or scalable, ew, lw, overlap, window, balancer)


class TestMessages(expecttest.TestCase):
    def err(self, fn=ReorderConfig, **kw):
        with self.assertRaises(ValueError) as cm:
            fn(**kw)
        return str(cm.exception)

    def test_config_rules(self):
        self.assertExpectedInline(self.err(megatron_mimo_intra_microbatch_reorder=True), """megatron_mimo_intra_microbatch_reorder=True requires megatron_mimo_scalable_dp=True: reordering balances the 1/dp shares of scalable reads; set both (flag --intra-microbatch-reorder does)""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_encoder_cost_weight=-1.0), """megatron_mimo_reorder_encoder_cost_weight=-1.0: must be a finite number >= 0""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_language_cost_weight=float("nan")), """megatron_mimo_reorder_language_cost_weight=nan: must be a finite number >= 0""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_encoder_cost_weight=float("inf")), """megatron_mimo_reorder_encoder_cost_weight=inf: must be a finite number >= 0""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_encoder_cost_weight="1"), """megatron_mimo_reorder_encoder_cost_weight='1': must be a finite number >= 0""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_encoder_cost_weight=0), """megatron_mimo_reorder_encoder_cost_weight=0.0 and megatron_mimo_reorder_language_cost_weight=0.0 (and no quadratic or per-image weight): at least one cost weight must be > 0, otherwise every sample costs 0 and there is nothing to balance""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_window_size=0), """megatron_mimo_reorder_window_size=0: must be an integer >= 1""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_window_size=1.5), """megatron_mimo_reorder_window_size=1.5: must be an integer >= 1""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_spatial_merge_size=0), """megatron_mimo_reorder_spatial_merge_size=0: must be an integer >= 1""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_overlap="no"), """megatron_mimo_reorder_overlap='no': must be a bool""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_image_token_id=7, megatron_mimo_reorder_vision_start_token_id=7), """megatron_mimo_reorder_image_token_id=7 equals megatron_mimo_reorder_vision_start_token_id=7: they must be different tokens""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_balancer="nope"), """megatron_mimo_reorder_balancer='nope' is unknown; choose one of ['balanced', 'identity', 'lpt']""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_encoder_image_weight=-1), """megatron_mimo_reorder_encoder_image_weight=-1: must be a finite number >= 0""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_min_gain=1.0), """megatron_mimo_reorder_min_gain=1.0: must be a finite number >= 0 and < 1 (or unset)""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_min_saving=-3), """megatron_mimo_reorder_min_saving=-3: must be a finite number >= 0 (or unset)""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_min_saving=float("nan")), """megatron_mimo_reorder_min_saving=nan: must be a finite number >= 0 (or unset)""")
        self.assertExpectedInline(self.err(megatron_mimo_reorder_gate_backoff=2), """megatron_mimo_reorder_gate_backoff=2: the backoff skips windows after the cost-benefit gate kept them natural; set megatron_mimo_reorder_min_gain or megatron_mimo_reorder_min_saving too""")

    def test_argparse_values_are_validated(self):
        self.assertExpectedInline(self.err(lambda: ReorderConfig.from_args(parse(["--reorder-window-size", "0"]))), """megatron_mimo_reorder_window_size=0: must be an integer >= 1""")
        self.assertExpectedInline(self.err(lambda: ReorderConfig.from_args(parse(["--reorder-language-cost-weight", "-2"]))), """megatron_mimo_reorder_language_cost_weight=-2.0: must be a finite number >= 0""")

    def test_layout(self):
        ok = dict(encoder_pp=1, encoder_dp=2, language_dp=4, fixed_width_padding=True)
        check_model_layout(**ok)
        check_model_layout(**{**ok, "encoder_dp": 1, "language_dp": 1})
        self.assertExpectedInline(self.err(check_model_layout, **{**ok, "encoder_pp": 2}), """encoder_pp=2: reorder does not support a pipeline-parallel vision encoder; set the encoder's pipeline-parallel size to 1""")
        self.assertExpectedInline(self.err(check_model_layout, **{**ok, "encoder_dp": 8}), """encoder_dp=8 > language_dp=4: MimoModel's fan-in path asserts on variable image-token counts; give the language module at least the encoder's DP size""")
        self.assertExpectedInline(self.err(check_model_layout, **{**ok, "language_dp": 3}), """language_dp=3 is not a multiple of encoder_dp=2: each encoder replica must feed a whole number of language replicas""")
        self.assertExpectedInline(self.err(check_model_layout, **{**ok, "fixed_width_padding": False}), """fixed_width_padding=False: reorder concatenates samples from other ranks, so every sample must be padded to the same fixed sequence length; pad to the configured seq_length instead of the longest in the batch""")
        self.assertExpectedInline(self.err(check_model_layout, **{**ok, "language_dp": 0}), """language_dp=0: must be an integer >= 1""")


def test_shadow_flag_round_trip():
    import argparse

    from reorder.integrations.config import ReorderConfig, add_reorder_args
    p = argparse.ArgumentParser()
    add_reorder_args(p)
    assert ReorderConfig.from_args(p.parse_args(["--intra-microbatch-reorder", "--reorder-shadow"])).shadow is True
    assert ReorderConfig().shadow is False
    assert ReorderConfig.from_args(p.parse_args(["--reorder-cross-slot"])).cross_slot is True
    c = ReorderConfig.from_args(p.parse_args(["--reorder-min-gain", "0.05", "--reorder-min-saving", "2.5"]))
    assert (c.min_gain, c.min_saving) == (0.05, 2.5)
    assert ReorderConfig.from_args(p.parse_args(["--reorder-encoder-image-weight", "40"])).encoder_image_weight == 40.0
    # a per-image (or quadratic) weight alone is a valid cost model
    assert ReorderConfig(megatron_mimo_reorder_encoder_cost_weight=0.0,
                         megatron_mimo_reorder_encoder_image_weight=1.0).encoder_image_weight == 1.0
    assert (ReorderConfig().min_gain, ReorderConfig().min_saving) == (None, None)
    assert ReorderConfig().cross_slot is False
    assert ReorderConfig.from_args(p.parse_args(["--reorder-overlap-ahead", "2"])).overlap_ahead == 2
    assert ReorderConfig().overlap_ahead == 1
    with pytest.raises(ValueError, match="megatron_mimo_reorder_overlap_ahead=0: must be an integer >= 1"):
        ReorderConfig(megatron_mimo_reorder_overlap_ahead=0)
    with pytest.raises(ValueError, match="megatron_mimo_reorder_shadow='yes': must be a bool"):
        ReorderConfig(megatron_mimo_reorder_shadow="yes")


def test_add_reorder_args_is_an_extra_args_provider():
    """Megatron's parse_args runs `parser = extra_args_provider(parser)` and parses with the result."""
    def megatron_parse_args(extra_args_provider, argv):
        parser = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
        parser.add_argument("--micro-batch-size", type=int)  # one of Megatron's own flags
        parser = extra_args_provider(parser)
        return parser.parse_args(argv)

    ns = megatron_parse_args(add_reorder_args, ["--micro-batch-size", "2", "--intra-microbatch-reorder"])
    assert ns.micro_batch_size == 2 and ReorderConfig.from_args(ns).enabled
    parser = argparse.ArgumentParser()
    assert add_reorder_args(parser) is parser
    assert "intra-micro-batch reorder" in [g.title for g in parser._action_groups]  # the flags' own help section


def test_token_id_flags():
    c = ReorderConfig.from_args(parse(["--reorder-image-token-id", "151655", "--reorder-vision-start-token-id",
                                       "151652", "--reorder-spatial-merge-size", "4"]))
    assert (c.image_token_id, c.vision_start_token_id, c.spatial_merge_size) == (151655, 151652, 4)
    with pytest.raises(ValueError, match="megatron_mimo_reorder_spatial_merge_size=0: must be an integer >= 1"):
        ReorderConfig.from_args(parse(["--reorder-spatial-merge-size", "0"]))


@pytest.mark.parametrize("name,expected", [
    ("Qwen2VLConfig", (151655, 151652, 2)),
    ("Qwen2_5_VLConfig", (151655, 151652, 2)),
    ("Qwen3VLConfig", (151655, 151652, 2)),
    ("Qwen3_5Config", (248056, 248053, 2)),
])
def test_from_hf_config_reads_the_real_transformers_configs(monkeypatch, name, expected):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the config classes are built locally, never downloaded
    import transformers  # a test-only dependency (the `test` extra)

    cls = getattr(transformers, name)
    c = ReorderConfig.from_hf_config(cls())
    assert (c.image_token_id, c.vision_start_token_id, c.spatial_merge_size) == expected
    custom = cls(image_token_id=7, vision_start_token_id=5, vision_config={"spatial_merge_size": 4})
    source = argparse.Namespace(**vars(parse(["--intra-microbatch-reorder", "--reorder-window-size", "2"])))
    c = ReorderConfig.from_hf_config(custom, source, megatron_mimo_reorder_balancer="lpt")
    assert (c.image_token_id, c.vision_start_token_id, c.spatial_merge_size) == (7, 5, 4)  # over the flag defaults
    assert (c.enabled, c.window_size, c.balancer) == (True, 2, "lpt")
    assert ReorderConfig.from_hf_config(custom, megatron_mimo_reorder_image_token_id=9).image_token_id == 9


def test_from_hf_config_refuses_a_config_without_the_ids():
    import transformers
    with pytest.raises(ValueError, match=r"Qwen2Config has no image_token_id, vision_start_token_id, "
                                         r"vision_config.spatial_merge_size: not a Qwen-VL-style config; set "
                                         r"megatron_mimo_reorder_image_token_id, "):
        ReorderConfig.from_hf_config(transformers.Qwen2Config())
    assert ReorderConfig.from_hf_config({"image_token_id": 3, "vision_start_token_id": 4,
                                         "vision_config": {"spatial_merge_size": 1}}).spatial_merge_size == 1


def test_every_field_is_prefixed_so_a_bridge_dataset_config_cannot_collide():
    """A Megatron-Bridge dataset config has fields of its own; only `megatron_mimo_*` ones are read, so
    generic names there (an unrelated `balancer`, `shadow`, `min_gain`, `image_token_id`) change nothing."""
    assert all(f.name.startswith(("megatron_mimo_reorder_", "megatron_mimo_scalable_dp",
                                  "megatron_mimo_intra_microbatch_reorder")) for f in dataclasses.fields(ReorderConfig))
    dataset_config = types.SimpleNamespace(
        balancer="round_robin", shadow=True, cross_slot=True, min_gain=5.0, min_saving=-1.0, gate_backoff=3,
        overlap_ahead=0, image_token_id=1, vision_start_token_id=1, spatial_merge_size=0,
        encoder_quadratic_weight=-1.0, language_quadratic_weight=-1.0, encoder_image_weight=-1.0,
        megatron_mimo_scalable_dp=True, megatron_mimo_intra_microbatch_reorder=True,
        megatron_mimo_reorder_balancer="lpt", megatron_mimo_reorder_min_gain=0.1)
    c = ReorderConfig.from_object(dataset_config)
    assert c == ReorderConfig(**ON, megatron_mimo_reorder_balancer="lpt", megatron_mimo_reorder_min_gain=0.1)
    assert (c.balancer, c.min_gain, c.shadow, c.image_token_id) == ("lpt", 0.1, False, 248056)
    # the flags keep their short names and fill the prefixed fields
    ns = parse(["--reorder-balancer", "identity", "--reorder-shadow", "--reorder-min-saving", "2"])
    assert (ns.megatron_mimo_reorder_balancer, ns.megatron_mimo_reorder_shadow, ns.megatron_mimo_reorder_min_saving) \
        == ("identity", True, 2.0)


def test_the_self_check_flag_and_field():
    import argparse

    from reorder.integrations.config import ReorderConfig, add_reorder_args

    args = add_reorder_args(argparse.ArgumentParser()).parse_args(["--reorder-verify", "100"])
    cfg = ReorderConfig.from_object(args)
    assert cfg.verify == 100 and cfg.exchanger_settings()["verify"] == 100
    assert ReorderConfig().verify == 0
    with pytest.raises(ValueError) as e:
        ReorderConfig(megatron_mimo_reorder_verify=-1)
    assert str(e.value) == "megatron_mimo_reorder_verify=-1: must be an integer >= 0"
