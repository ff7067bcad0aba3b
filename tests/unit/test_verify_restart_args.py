"""`megarl verify-recovery --restart-at`: what it refuses before any run, and what the resumed verifier carries."""
import pytest

from megarl.errors import ConfigError
from megarl.verify.exactness import verify_recovery
from megarl.verify.exactness_restart import STOP_WINDOW, partial_answers


@pytest.mark.parametrize("kwargs,message", [
    ({"negative_control": "restart_wrong_version"}, "give --restart-at"),
    ({"restart_at": 3, "steps": 3 + STOP_WINDOW}, f"needs --steps >= {3 + STOP_WINDOW + 1}"),
    ({"restart_at": -1}, "--restart-at -1"),
])
def test_bad_restart_arguments_fail_before_anything_runs(tmp_path, kwargs, message):
    args = {"steps": 8, **kwargs}
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        verify_recovery("configs/verify_cpu.yaml", ["snapshot"], args.pop("steps"), str(tmp_path / "r.json"), [],
                        **args)
    assert not (tmp_path / "r.json").exists()


def t(tid, ids, fin, parts=()):
    return {"traj_id": tid, "response_ids": ids, "finished": fin, "parts": list(parts)}


def test_partial_answers_are_the_running_groups_unfinished_trajectories_with_tokens():
    part = t("g1-0.p1", [5], False)
    state = {"running_groups": [{"trajectories": [t("g1-0", [1, 2], False, [part]), t("g1-1", [3], True),
                                                  t("g1-2", [], False)]}]}
    assert partial_answers(state) == {"g1-0": [state["running_groups"][0]["trajectories"][0], part]}
    assert partial_answers({}) == {}


def test_the_resumed_verifier_keeps_the_earlier_record_and_counts(monkeypatch):
    from recovery.base import RecoveryStrategy
    from recovery.verifier import VerifyingStrategy

    class Inner(RecoveryStrategy):
        name, exact, conventions, uses_live_trajectories = "inner", True, (), False

        def __init__(self):
            self.cfg, self.ctx = None, None

        def anchor(self, batch, trajs):
            raise AssertionError("not called")

    earlier, later = VerifyingStrategy(Inner()), VerifyingStrategy(Inner())
    earlier.params_by_version[1] = {"w": 1}
    earlier.stats["n_tokens"], earlier.stats["max_abs_err"] = 40, 2e-7
    later.continue_from(earlier, {"g1-0": 9})
    assert later.params_by_version == {1: {"w": 1}} and later.kept_before_restart == {"g1-0": 9}
    assert later.stats["n_tokens"] == 40 and later.stats["max_abs_err"] == 2e-7
    later.stats["n_tokens"] += 1
    assert earlier.stats["n_tokens"] == 40, "the resumed verifier counts on its own copy"
