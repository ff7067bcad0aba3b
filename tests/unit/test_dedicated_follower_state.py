"""A follower trainer rank's dedicated strategy ignores a scorer state: a resume with more trainer ranks hands every
new rank rank 0's strategy state (megarl/trainer/param_state.py), and only rank 0 runs the scoring process."""
from types import SimpleNamespace

from recovery.dedicated import Dedicated, DedicatedConfig


def test_a_follower_does_not_start_a_scorer_from_rank_0s_state(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(Dedicated, "_start", lambda self: started.append(self))
    ctx = SimpleNamespace(is_driver=False, run_dir=str(tmp_path), trainer=None)
    follower = Dedicated(DedicatedConfig(), ctx)
    state = {"version": 3, "weights": {}, "files": {"config.json": "{}"}, "results": {}, "sent": [], "lost": {}}
    follower.load_state_dict(state)
    assert started == [] and not (tmp_path / "dedicated").exists()
    driver = Dedicated(DedicatedConfig(), SimpleNamespace(is_driver=True, run_dir=str(tmp_path), trainer=None))
    try:
        driver.load_state_dict(state)
    except Exception:  # noqa: BLE001 - the rest of the driver's restore is not what this test is about
        pass
    assert started == [driver], "rank 0 restores its scorer"
