import pytest

from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig


def test_defaults_are_the_paper_settings():
    cfg = RunConfig()
    assert (cfg.schedule.num_fragments, cfg.schedule.sync_every, cfg.schedule.overlap_steps) == (24, 24, 2)
    assert (cfg.outer.lr, cfg.outer.momentum, cfg.outer.nesterov) == (0.7, 0.9, True)
    assert cfg.merge.method == "rda" and cfg.schedule.apply == "mix"


@pytest.mark.parametrize(
    "build,match",
    [
        (lambda: ScheduleConfig(num_fragments=0), "num_fragments=0"),
        (lambda: ScheduleConfig(num_fragments=30, sync_every=24), "exceeds sync_every"),
        (lambda: ScheduleConfig(overlap_steps=24, sync_every=24), "overlap_steps=24"),
        (lambda: ScheduleConfig(apply="average"), "apply='average'"),
        (lambda: ScheduleConfig(mix_alpha=1.0), "mix_alpha"),
        (lambda: MergeConfig(method="median"), "method='median'"),
        (lambda: MergeConfig(min_quorum=0), "min_quorum=0"),
        (lambda: MergeConfig(grace_gamma=1.0), "grace_gamma"),
        (lambda: MergeConfig(outlier_z=0.5), "outlier_z"),
        (lambda: OuterConfig(lr=float("nan")), "outer lr"),
        (lambda: OuterConfig(momentum=1.0), "outer momentum"),
        (lambda: CodecConfig(uplink="int3"), "uplink codec='int3'"),
        (lambda: CodecConfig(block_size=7), "block_size=7"),
        # a JSON run config's 64.0, or 1e3, passed the old check and failed mid-run in torch.empty
        (lambda: CodecConfig(block_size=64.0), "block_size=64.0"),
        (lambda: CodecConfig(block_size=1e3), "block_size=1000.0"),
        # a huge block passed too: every fragment's tail block padded to it (2**62 values)
        (lambda: CodecConfig(block_size=2**62), f"block_size={2**62}"),
    ],
)
def test_bad_settings_are_refused_naming_the_field_and_value(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_settings_are_keyword_only():
    with pytest.raises(TypeError):
        ScheduleConfig(4)  # type: ignore[misc]


def test_round_trips_through_a_dict():
    cfg = RunConfig(schedule=ScheduleConfig(num_fragments=3, sync_every=9), outer=OuterConfig(lr=1.0, momentum=0.0))
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_unknown_keys_in_a_dict_are_refused():
    data = RunConfig().to_dict()
    data["outer"]["lr_typo"] = 1.0
    with pytest.raises(ValueError, match="lr_typo"):
        RunConfig.from_dict(data)


def test_a_residual_kept_in_the_parameters_needs_feedback_and_is_refused_with_the_mix_apply_rule():
    from lightning_diloco.core.settings import config_with

    assert config_with({"uplink_residual": "parameters", "apply": "rebase"}).codec.uplink_residual == "parameters"
    with pytest.raises(ValueError, match="uplink_residual='parameters' cannot go with apply='mix'"):
        config_with({"uplink_residual": "parameters", "apply": "mix"})
    with pytest.raises(ValueError, match="uplink_residual='parameters' needs uplink_feedback=True"):
        CodecConfig(uplink_residual="parameters", uplink_feedback=False)
