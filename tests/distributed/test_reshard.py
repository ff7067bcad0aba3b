"""A trainer checkpoint resumes into another layout: TP2 -> TP1, TP2 -> PP2, DP2 (distributed optimizer) -> DP1
and EP2 -> EP1 (the tiny MoE), with a strategy's copies of the weights re-cut the same way.

tests/distributed/run_reshard.py trains 2 steps at 2 ranks, writes megarl/trainer/dist_state.py's
reshardable checkpoint and a strategy state with two copies of the weights (megarl/trainer/param_state.py)
and goes on for 2 more steps; one plain process loads the checkpoint at 1 rank and takes the same 2
steps (and 2 ranks load the TP2 one at PP2). The resumed weights equal the saved (gathered) ones exactly; the
steps after the load match the uninterrupted run's within LOSS_TOL / WEIGHT_TOL, the rounding a
different split of the same sums gives (measured: 1e-7 and 4e-7). The weights after the resumed step
depend on the carried Adam moments: with a fresh optimizer instead (the negative control) they are
off by ~2e-2, which the same checks catch.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from checked_run import run_checked

from megarl.rollout.client import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "distributed" / "run_reshard.py"
MODES = ("tp2", "dp2", "ep2")
LOSS_TOL = 1e-5
WEIGHT_TOL = 1e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> Path:
    from megarl.models.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("reshard")
    ckpt = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3.yaml", root / "dense", seed=3)
    moe = write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3_moe.yaml", root / "moe", seed=3)
    out = root / "out"
    args = ["--checkpoint", str(ckpt), "--moe-checkpoint", str(moe), "--out", str(out)]

    def torchrun(phase: str) -> None:
        run_checked([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                     f"--master_port={free_port()}", str(SCRIPT), "--phase", phase, *args], timeout=240)

    torchrun("save")
    run_checked([sys.executable, str(SCRIPT), "--phase", "load", *args], timeout=240)
    torchrun("load_pp2")
    return out


def _load(out: Path, mode: str, name: str) -> dict:
    return json.loads((out / mode / f"{name}.json").read_text())


def check_resumed(got: dict, ref: dict) -> None:
    """The 1-rank resume continues the 2-rank run: same weights, same next steps."""
    assert got["format"] == "megarl.reshardable.v1" and got["version"] == 2, got
    assert got["weights_exact"], "the loaded weights differ from the saved ones"
    assert got["copies_exact"], "the strategy's copies of the weights are not the loaded weights"
    assert abs(got["loss3"] - ref["loss3"]) < LOSS_TOL, (got["loss3"], ref["loss3"])
    # the update of step 3 is Adam's: it is the uninterrupted one only with the saved moments
    assert got["w3_diff"] < WEIGHT_TOL, f"weights after the resumed step differ by {got['w3_diff']}"
    assert abs(got["loss4"] - ref["loss4"]) < LOSS_TOL, (got["loss4"], ref["loss4"])


@pytest.mark.parametrize("mode", MODES)
def test_resumes_in_one_rank(out, mode):
    check_resumed(_load(out, mode, "resumed"), _load(out, mode, "ref"))


def test_tp2_resumes_at_pp2(out):
    check_resumed(_load(out, "tp2", "resumed_pp2"), _load(out, "tp2", "ref"))


@pytest.mark.parametrize("mode", MODES)
def test_the_check_fails_without_the_optimizer_state(out, mode):
    dropped = _load(out, mode, "dropped")
    assert dropped["weights_exact"], dropped  # only the optimizer was replaced
    with pytest.raises(AssertionError, match="weights after the resumed step differ"):
        check_resumed(dropped, _load(out, mode, "ref"))


@pytest.mark.parametrize("mode", MODES)
def test_same_layout_resume_is_bitwise(out, mode):
    ref = _load(out, mode, "ref")
    same = ref["same_layout_ckpt"]
    assert same["format"] == "megarl.reshardable.v1" and same["loss3"] == ref["loss3"] and same["w3_diff"] == 0.0


def test_per_rank_format(out):
    """The per-rank format loads through its own loader in its layout, and names the way out in another."""
    same = _load(out, "tp2", "ref")["same_layout_per_rank"]
    assert same["format"] == "per_rank" and same["w3_diff"] == 0.0, same
    err = _load(out, "tp2", "per_rank_error")["error"]
    assert err is not None and "written by 2 ranks" in err and "save_reshardable" in err, err
