"""The recovery registry and the strategies' config sections."""
import dataclasses

import pytest

from megarl.builder import load_run_config
from megarl.config.loader import field_docs
from megarl.errors import ConfigError
from recovery import registry
from recovery.base import RecoveryStrategy
from recovery.registry import register

ALL = ["behav", "dedicated", "ewma", "interrupt_sync", "linear", "loglinear", "recompute", "snapshot"]


def test_every_strategy_is_registered_with_its_kind():
    assert registry.names() == ALL
    exact = {n for n in ALL if registry.get(n).exact}
    assert exact == {"snapshot", "dedicated", "interrupt_sync"}


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown recovery strategy 'snapshots'; valid: behav, dedicated, ewma"):
        registry.get("snapshots")


def test_duplicate_registration_refused():
    class Other(RecoveryStrategy):
        name = "snapshot"

        def anchor(self, batch, trajs):
            raise NotImplementedError

    with pytest.raises(ValueError, match="'snapshot' is registered twice"):
        register(Other)
    assert registry.get("snapshot").__module__ == "recovery.snapshot"


def test_config_sections():
    cfg = load_run_config(None, ["recovery.name=ewma", "recovery.ewma.tau=0.3", "recovery.snapshot.storage=disk",
                                 "recovery.ewma.window=5"])
    assert cfg.recovery.options["ewma"].tau == 0.3 and cfg.recovery.options["ewma"].window == 5
    assert cfg.recovery.options["snapshot"].storage == "disk"
    with pytest.raises(ConfigError,
                       match=r"unknown config key recovery\.ewma\.taux; did you mean recovery\.ewma\.tau\?"):
        load_run_config(None, ["recovery.ewma.taux=0.3"])
    with pytest.raises(ConfigError, match=r"recovery\.snapshot\.storage='ram' is not allowed"):
        load_run_config(None, ["recovery.snapshot.storage=ram"])


def test_build_passes_own_options():
    cfg = load_run_config(None, ["recovery.name=ewma", "recovery.ewma.beta=0.25", "recovery.ewma.tau=0"])
    strat = registry.build(cfg.recovery, ctx=type("Ctx", (), {"loss_cfg": None, "trainer": None})())
    assert strat.name == "ewma" and strat.beta == 0.25


def test_every_config_field_has_a_docstring():
    for name, cls in registry.config_classes().items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"recovery.{name}.{f.name} has no docstring"
