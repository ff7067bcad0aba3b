"""A checkpoint changed after the run wrote it is refused by name, and no checkpoint file can run code
(megarl/isolation/run_key.py, megarl/checkpoint/files.py); a stop marker the run's trainer did not sign is not trusted
(megarl/stop_protocol.py).

The attack is the one code with write access to the run directory can make: replace ``controller.pt`` with a
pickle whose loading runs a command, and recompute the manifest's sha256 and size so that the file checks pass.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from megarl.checkpoint.run_checkpoint import find_latest_checkpoint, load_file, verify_checkpoint, write_checkpoint
from megarl.errors import CheckpointError
from megarl.isolation import secret_env
from megarl.isolation.run_key import checkpoint_key, key_path
from megarl.stop_protocol import read_stop_marker, write_stop_marker


class Payload:
    """Unpickling it runs ``os.system`` (as any pickle may): here, a command that creates a file."""

    def __init__(self, proof: Path) -> None:
        self.proof = proof

    def __reduce__(self):
        return os.system, (f"touch {self.proof}",)


def fill(tmp: Path) -> None:
    torch.save({"step": 1, "rng": {"torch": torch.get_rng_state()}}, tmp / "controller.pt")


def forge(step_dir: Path, proof: Path) -> None:
    """Write the payload as controller.pt and fix the manifest's hash and size of it, as an attacker would."""
    (step_dir / "controller.pt").write_bytes(pickle.dumps({"step": Payload(proof)}))
    manifest = json.loads((step_dir / "manifest.json").read_text())
    data = (step_dir / "controller.pt").read_bytes()
    manifest["files"]["controller.pt"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def test_a_forged_checkpoint_is_refused_by_name_and_the_resume_takes_the_one_before(tmp_path):
    run, proof = tmp_path / "run", tmp_path / "payload_ran"
    write_checkpoint(run / "checkpoints", 1, fill, meta={"version": 1, "accepted_total": 8})
    write_checkpoint(run / "checkpoints", 2, fill, meta={"version": 2, "accepted_total": 16})
    forge(run / "checkpoints" / "step_2", proof)
    with pytest.raises(CheckpointError, match=r"step_2/manifest.json is not signed with this run's key"):
        verify_checkpoint(run / "checkpoints" / "step_2")
    assert find_latest_checkpoint(run) == run / "checkpoints" / "step_1"
    assert not proof.exists()


def test_no_checkpoint_file_runs_code_even_past_the_manifest(tmp_path):
    """``load_file`` refuses the payload itself (weights_only); torch.load as before (the control) runs it."""
    proof = tmp_path / "payload_ran"
    path = tmp_path / "controller.pt"
    torch.save({"step": Payload(proof)}, path)
    with pytest.raises(CheckpointError, match=r"controller.pt holds more than plain data and is refused"):
        load_file(path)
    assert not proof.exists()
    torch.load(path, weights_only=False)  # the control: what the loads were before
    assert proof.exists()


def test_the_key_is_private_and_its_loss_is_named(tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run / "checkpoints", 1, fill, meta={"version": 1, "accepted_total": 8})
    assert oct(key_path(run).stat().st_mode & 0o777) == "0o600"
    assert oct(key_path(run).parent.stat().st_mode & 0o777) == "0o700"
    key_path(run).chmod(0o644)
    with pytest.raises(CheckpointError, match=r"has mode 644 .* must be mode 0600"):
        verify_checkpoint(run / "checkpoints" / "step_1")
    key_path(run).unlink()
    with pytest.raises(CheckpointError, match=r"checkpoint.key is missing: the run's checkpoints are signed"):
        checkpoint_key(run)


@pytest.fixture
def stop_key(monkeypatch):
    monkeypatch.setattr(secret_env, "_taken", {})
    monkeypatch.delenv("MEGARL_STOP_KEY", raising=False)
    yield lambda value: secret_env.give_secret("MEGARL_STOP_KEY", value)


def test_a_stop_marker_not_signed_by_the_trainer_is_ignored(tmp_path, stop_key, monkeypatch):
    marker = tmp_path / "stop.json"
    monkeypatch.setenv("MEGARL_STOP_MARKER", str(marker))
    marker.write_text(json.dumps({"signal": "SIGUSR1", "step": 3, "checkpointed": True}))  # planted
    assert read_stop_marker(marker) is not None  # the control: a launcher holding no key trusts it
    stop_key("the-launch-stop-key")
    assert read_stop_marker(marker) is None  # planted, unsigned
    write_stop_marker("SIGUSR1", 3, True)  # the trainer, holding the key
    assert read_stop_marker(marker)["step"] == 3
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps({**info, "step": 4}))  # changed after signing
    assert read_stop_marker(marker) is None


def test_a_checkpoint_of_an_older_megarl_is_refused_until_trusted(tmp_path):
    """Unsigned (as megarl wrote them before): refused, naming `megarl trust-checkpoint`; the command signs it after
    checking every file, and refuses one whose files do not match its manifest."""
    from megarl.cli import main

    run = tmp_path / "run"
    step = write_checkpoint(run / "checkpoints", 1, fill, meta={"version": 1, "accepted_total": 8})
    manifest = {k: v for k, v in json.loads((step / "manifest.json").read_text()).items() if k != "mac"}
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=rf"megarl trust-checkpoint {step}"):
        verify_checkpoint(step)
    assert main(["trust-checkpoint", str(step)]) == 0
    assert verify_checkpoint(step)["step"] == 1
    (step / "manifest.json").write_text(json.dumps(manifest))
    (step / "controller.pt").write_bytes(b"changed")
    assert main(["trust-checkpoint", str(step)]) == 2  # a CheckpointError, naming the file
    with pytest.raises(CheckpointError, match="is not signed"):
        verify_checkpoint(step)
