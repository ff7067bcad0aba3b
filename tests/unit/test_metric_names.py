"""Dashboard namespaces by hand (tests/e2e/test_train.py checks every key of a real run has one)."""
import pytest

from megarl.loop.metric_names import dashboard_name


@pytest.mark.parametrize("key, name", [
    ("pg_loss", "actor/pg_loss"), ("reward_mean", "rollout/reward_mean"), ("step_s", "timing/step_s"),
    ("behav_w/masked_frac", "recovery/behav_w/masked_frac"), ("r_d/abs_logp_mean", "recovery/r_d/abs_logp_mean"),
    ("recovery/forwards", "recovery/forwards"), ("eval/pass@1", "eval/pass@1"),
    ("n_tool_calls", "rollout/n_tool_calls"), ("weight_sync_bytes", "rollout/weight_sync_bytes"),
    ("something_new", "other/something_new"),
])
def test_names(key, name):
    assert dashboard_name(key) == name
