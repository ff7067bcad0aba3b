"""Every YAML under configs/ loads, and every run config x recovery overlay gives a valid plan (no GPU needed)."""
from pathlib import Path

import pytest
import yaml

from megarl.builder import load_run_config
from megarl.config.loader import dump_yaml
from megarl.launch import cluster
from megarl.launch.overlays import overlay_overrides
from megarl.launch.placement import load_hf_config, resolve_plan
from megarl.models.hf_config import validate_parallel
from megarl.models.tiny import load_model_yaml
from megarl.preflight import validate
from recovery import registry

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
ALL_YAML = sorted(CONFIGS.rglob("*.yaml"))
OVERLAYS = sorted((CONFIGS / "recovery").glob("*.yaml"))


def _raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {}


MODEL_YAML = [p for p in ALL_YAML if "architectures" in _raw(p)]
RUN_YAML = [p for p in ALL_YAML if p not in MODEL_YAML and p not in OVERLAYS]


def _id(p: Path) -> str:
    return str(p.relative_to(CONFIGS))


def test_every_yaml_is_classified():
    assert ALL_YAML and MODEL_YAML and RUN_YAML and OVERLAYS
    assert {_id(p) for p in RUN_YAML} >= {"tiny_cpu.yaml", "qwen3_4b_h100.yaml", "qwen3_30b_a3b_h100.yaml"}


@pytest.mark.parametrize("path", MODEL_YAML, ids=_id)
def test_model_yaml(path):
    fields = load_model_yaml(path)
    validate_parallel(fields, 1, 1, 1, 1)  # the fields the trainer reads are all there


def test_every_strategy_has_an_overlay():
    assert {p.stem for p in OVERLAYS} == set(registry.names())
    for p in OVERLAYS:
        assert _raw(p)["recovery"]["name"] == p.stem, p


def _simulated_for(cfg):
    p = cfg.placement
    if p.device == "cpu" and p.engine_nodes == 0 and (p.dedicated_nodes == 0 or cfg.recovery.name != "dedicated"):
        return cluster.local()
    nodes = p.trainer_nodes + p.engine_nodes + (p.dedicated_nodes if cfg.recovery.name == "dedicated" else 0)
    return cluster.simulated(nodes, p.gpus_per_node)


@pytest.mark.parametrize("overlay", [None, *OVERLAYS], ids=lambda p: p.stem if p else "base")
@pytest.mark.parametrize("run", RUN_YAML, ids=_id)
def test_run_config_with_overlay_gives_a_valid_plan(run, overlay):
    overrides = overlay_overrides(overlay) if overlay else []
    cfg = load_run_config(run, overrides)
    if overlay:
        assert cfg.recovery.name == overlay.stem
    hf, _ = load_hf_config(cfg)
    validate(cfg, hf)  # what `megarl train` checks before starting
    plan = resolve_plan(cfg, hf, _simulated_for(cfg), config_path=str(run), overrides=overrides)
    assert plan.trainer.world_size >= 1 and len(plan.engines) == cfg.rollout.n_engines
    assert (plan.dedicated is not None) == (cfg.recovery.name == "dedicated")
    for launcher in ("torchrun", "slurm", "mpirun"):
        assert plan.commands(launcher, python="python")


def test_overlay_as_overrides_equals_include(tmp_path):
    """`--recovery ewma` and a file with `include: [run, overlay]` resolve to the same config."""
    run, overlay = CONFIGS / "qwen3_30b_a3b_h100.yaml", CONFIGS / "recovery" / "ewma.yaml"
    combined = tmp_path / "combined.yaml"
    combined.write_text(yaml.safe_dump({"include": [str(run), str(overlay)]}))
    assert dump_yaml(load_run_config(combined)) == dump_yaml(load_run_config(run, overlay_overrides(overlay)))


def test_gpu_configs_are_gpu_bf16_vllm_broadcast():
    for name in ("qwen3_4b_h100.yaml", "qwen3_30b_a3b_h100.yaml"):
        cfg = load_run_config(CONFIGS / name)
        assert (cfg.placement.device, cfg.model.dtype, cfg.rollout.backend, cfg.rollout.weight_sync) == \
            ("gpu", "bfloat16", "vllm", "broadcast"), name


def test_30b_plan_numbers():
    cfg = load_run_config(CONFIGS / "qwen3_30b_a3b_h100.yaml")
    hf, source = load_hf_config(cfg)
    assert source.endswith("configs/models/qwen3_30b_a3b.yaml")
    assert (hf["num_experts"], hf["num_experts_per_tok"], hf["num_key_value_heads"], hf["num_hidden_layers"]) == \
        (128, 8, 4, 48)
    plan = resolve_plan(cfg, hf, cluster.simulated(4, 8))
    t = plan.trainer
    assert (len(t.hosts), t.world_size, t.tp, t.pp, t.ep, t.dp, t.expert_dp) == (2, 16, 2, 1, 8, 8, 1)
    assert [(e.host, e.tp, len(e.gpu_ids)) for e in plan.engines] == [
        ("node03", 4, 4), ("node03", 4, 4), ("node04", 4, 4), ("node04", 4, 4)]
    assert len(plan.hosts_used) == 4 and plan.weight_sync_world == 1 + 4 * 4
    # with the dedicated scorer: a fifth node, TP like the trainer
    cfg = load_run_config(CONFIGS / "qwen3_30b_a3b_h100.yaml",
                          overlay_overrides(CONFIGS / "recovery" / "dedicated.yaml"))
    plan = resolve_plan(cfg, hf, cluster.simulated(5, 8))
    assert (plan.dedicated.host, plan.dedicated.tp) == ("node05", 1)


def test_4b_plan_numbers():
    cfg = load_run_config(CONFIGS / "qwen3_4b_h100.yaml")
    hf, _ = load_hf_config(cfg)
    plan = resolve_plan(cfg, hf, cluster.simulated(2, 8))
    t = plan.trainer
    assert (t.hosts, t.tp, t.dp) == (("node01",), 2, 4)
    assert [(e.host, e.gpu_ids) for e in plan.engines] == [("node02", (i,)) for i in range(8)]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.stem)
def test_a_strategy_name_selects_no_loss(overlay):
    """`--recovery NAME` (an overlay) and `recovery.name=NAME` train the same loss: overlays hold no loss.*."""
    from megarl.launch.overlays import command_overrides

    run = CONFIGS / "qwen3_30b_a3b_h100.yaml"
    by_overlay = load_run_config(run, command_overrides(overlay.stem, [], []))
    by_name = load_run_config(run, [f"recovery.name={overlay.stem}"])
    assert by_overlay.recovery.name == by_name.recovery.name == overlay.stem
    assert dump_yaml(by_overlay.loss) == dump_yaml(by_name.loss) == dump_yaml(load_run_config(run).loss)


def test_a_recovery_overlay_that_sets_the_loss_is_refused(tmp_path, monkeypatch):
    from megarl.errors import ConfigError
    from megarl.launch import overlays

    (tmp_path / "mine.yaml").write_text("recovery:\n  name: snapshot\nloss:\n  behav_low: 0.5\n")
    monkeypatch.setattr(overlays, "RECOVERY_DIR", tmp_path)
    with pytest.raises(ConfigError, match="may not change the loss"):
        overlays.recovery_overlay("mine")
