"""megarl/models/safetensors_stream.py writes files the installed safetensors reads as the tensors given (this
fails when upstream changes the format), and stops between pieces leaving nothing behind."""
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from megarl.models import safetensors_stream
from megarl.models.safetensors_stream import WriteStopped, save_file_stoppable


def tensors():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(5, 3, generator=g), "b16": torch.randn(7, generator=g).bfloat16(),
            "h": torch.randn(2, 2, generator=g).half(), "ids": torch.arange(9, dtype=torch.int64),
            "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4), "scalar": torch.tensor(1.5),
            "view": torch.arange(12.0).reshape(3, 4).t()}  # not contiguous


def test_safetensors_reads_what_it_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_stream, "PIECE_BYTES", 5)  # tensors split across pieces
    given = tensors()
    save_file_stoppable(given, tmp_path / "m.safetensors", metadata={"format": "pt"})
    got = load_file(str(tmp_path / "m.safetensors"))
    assert sorted(got) == sorted(given)
    for k, t in given.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_stopped_write_raises_and_leaves_no_file(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_stream, "PIECE_BYTES", 8)
    asked = []

    def stop_at_the_fourth_piece():
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(WriteStopped, match="stopped before tensor"):
        save_file_stoppable(tensors(), tmp_path / "m.safetensors", should_stop=stop_at_the_fourth_piece)
    assert len(asked) == 4 and not (tmp_path / "m.safetensors").exists()


def test_a_dtype_without_a_name_is_refused(tmp_path):
    with pytest.raises(TypeError, match="complex64"):
        save_file_stoppable({"z": torch.zeros(2, dtype=torch.complex64)}, tmp_path / "m.safetensors")
