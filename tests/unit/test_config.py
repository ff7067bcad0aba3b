"""Config system: YAML + dotted overrides, clear errors, docstrings on every field."""
import dataclasses
import typing

import pytest

from megarl.builder import describe_config, load_run_config
from megarl.config import schema
from megarl.config.loader import describe, dump_yaml, field_docs, load_config, save_config
from megarl.errors import ConfigError
from megarl.preflight import validate


def test_defaults_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 1e-3\n  batch_size: 16\nrollout:\n  eta: 2\n")
    cfg = load_run_config(f, ["trainer.lr=3e-4", "rollout.temperature=0.7", "loss.eps_clip_high=0.28"])
    assert cfg.trainer.lr == pytest.approx(3e-4)  # override beats file
    assert cfg.trainer.batch_size == 16  # file beats default
    assert cfg.rollout.eta == 2
    assert cfg.rollout.temperature == pytest.approx(0.7)
    assert cfg.loss.eps_clip_high == pytest.approx(0.28)
    assert cfg.trainer.betas == [0.9, 0.99]  # default


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"unknown config key trainer\.lrr; did you mean trainer\.lr\?"):
        load_run_config(None, ["trainer.lrr=1"])
    with pytest.raises(ConfigError, match=r"did you mean trainer\?"):
        load_run_config(None, ["trainr.lr=1"])


def test_wrong_type_names_field_and_type():
    with pytest.raises(ConfigError, match=r"parallel\.tp=1\.5 has the wrong type: expected int"):
        load_run_config(None, ["parallel.tp=1.5"])
    with pytest.raises(ConfigError, match=r"trainer\.lr='abc' has the wrong type: expected float"):
        load_run_config(None, ["trainer.lr=abc"])
    with pytest.raises(ConfigError, match=r"logging\.tensorboard=1 has the wrong type: expected bool"):
        load_run_config(None, ["logging.tensorboard=1"])
    with pytest.raises(ConfigError, match=r"loss\.agg='x' is not allowed; choose one of"):
        load_run_config(None, ["loss.agg=x"])


def test_bad_override_syntax_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_run_config(None, ["trainer.lr"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_run_config(tmp_path / "nope.yaml")


def test_recovery_name_and_options():
    with pytest.raises(ConfigError, match=r"recovery\.name='nope' is not a recovery strategy; valid: .*behav"):
        load_run_config(None, ["recovery.name=nope"])
    with pytest.raises(ConfigError, match=r"unknown config key recovery\.behavx"):
        load_run_config(None, ["recovery.behavx.a=1"])


@dataclasses.dataclass
class ToyStrategyConfig:
    """Options of a strategy the loader is told about."""

    alpha: float = 0.5
    """How much of it."""


def test_recovery_sections_come_from_the_strategy_classes_given():
    toy = {"toy": ToyStrategyConfig}
    cfg = load_config(None, ["recovery.name=toy", "recovery.toy.alpha=2"], strategies=toy)
    assert cfg.recovery.name == "toy" and cfg.recovery.options == {"toy": ToyStrategyConfig(alpha=2.0)}
    assert load_config(None, ["recovery.name=toy"], strategies=toy).recovery.options == {"toy": ToyStrategyConfig()}
    with pytest.raises(ConfigError, match=r"recovery\.toy\.alphx; did you mean recovery\.toy\.alpha\?"):
        load_config(None, ["recovery.name=toy", "recovery.toy.alphx=2"], strategies=toy)
    with pytest.raises(ConfigError, match=r"recovery\.name='behav' is not a recovery strategy; valid: toy"):
        load_config(None, [], strategies=toy)  # the default strategy is not among those given
    assert "recovery.toy.alpha = 0.5  # How much of it." in describe(toy)


def test_round_trip_through_saved_yaml(tmp_path):
    cfg = load_run_config(None, ["trainer.lr=0.01", "rollout.eta=3", "recovery.name=behav"])
    save_config(cfg, tmp_path / "resolved.yaml")
    again = load_run_config(tmp_path / "resolved.yaml")
    assert dump_yaml(again) == dump_yaml(cfg)


def test_include_merges(tmp_path):
    (tmp_path / "base.yaml").write_text("trainer:\n  lr: 0.5\n  batch_size: 4\n")
    (tmp_path / "top.yaml").write_text("include: base.yaml\ntrainer:\n  batch_size: 8\n")
    cfg = load_run_config(tmp_path / "top.yaml")
    assert (cfg.trainer.lr, cfg.trainer.batch_size) == (0.5, 8)


def _dataclasses(cls, seen):
    if cls in seen:
        return
    seen.add(cls)
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            _dataclasses(tp, seen)


def test_every_field_has_a_docstring():
    from recovery.registry import config_classes

    seen: set = set()
    _dataclasses(schema.MegaRLConfig, seen)
    seen.update(config_classes().values())
    for cls in seen:
        docs = field_docs(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name)]
        assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_describe_lists_every_leaf():
    lines = describe_config()
    assert any(line.startswith("trainer.lr = ") for line in lines)
    assert any(line.startswith("recovery.name = ") for line in lines)
    assert all("#" in line for line in lines)


def test_publish_every_beyond_the_staleness_window_is_refused():
    # with publish_every = k the engines' version trails the trainer by up to k - 1 steps, so eta >= k - 1
    hf = {"max_position_embeddings": 512}
    validate(load_run_config(None, ["rollout.eta=2", "trainer.publish_every=3"]), hf)  # k - 1 = 2 = eta: fine
    validate(load_run_config(None, ["rollout.eta=0", "trainer.publish_every=1"]), hf)
    with pytest.raises(ConfigError, match=r"trainer\.publish_every=4 with rollout\.eta=2: .*publish_every <= 3"):
        validate(load_run_config(None, ["rollout.eta=2", "trainer.publish_every=4"]), hf)
    with pytest.raises(ConfigError, match=r"trainer\.publish_every=2 with rollout\.eta=0: .*publish_every <= 1"):
        validate(load_run_config(None, ["rollout.eta=0", "trainer.publish_every=2"]), hf)
    with pytest.raises(ConfigError, match=r"trainer\.publish_every=0 must be >= 1"):
        validate(load_run_config(None, ["trainer.publish_every=0"]), hf)


def test_max_save_failures_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"logging\.max_save_failures=0 must be >= 1"):
        validate(load_run_config(None, ["logging.max_save_failures=0"]), {"max_position_embeddings": 512})


def test_settings_that_can_never_form_a_batch_are_refused_naming_the_key():
    hf = {"max_position_embeddings": 512}
    # one sample per group is always "all equal": filter_groups would filter every group
    with pytest.raises(ConfigError, match=r"rollout\.filter_groups=true with rollout\.group_size=1"):
        validate(load_run_config(None, ["rollout.filter_groups=true", "rollout.group_size=1",
                                        "trainer.batch_size=4"]), hf)
    validate(load_run_config(None, ["rollout.filter_groups=true", "rollout.group_size=2", "trainer.batch_size=4"]), hf)
    with pytest.raises(ConfigError, match=r"rollout\.max_concurrency=0 must be >= 1"):
        validate(load_run_config(None, ["rollout.max_concurrency=0"]), hf)


@pytest.mark.parametrize("override, match", [
    ("rollout.group_size=0", r"rollout\.group_size=0 must be >= 1"),
    ("rollout.group_size=-2", r"rollout\.group_size=-2 must be >= 1"),
    ("rollout.max_new_tokens=0", r"rollout\.max_new_tokens=0 must be >= 1"),
])
def test_sizes_that_leave_nothing_to_train_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        validate(load_run_config(None, [override]), {"max_position_embeddings": 512})
