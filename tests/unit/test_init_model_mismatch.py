"""An existing model.checkpoint that is another model than model.init_model describes is used as it is, with a
warning naming what differs (megarl/preflight.py)."""
import logging
from pathlib import Path

from megarl.models.tiny import write_tiny_checkpoint
from megarl.preflight import check_init_model_matches

ROOT = Path(__file__).resolve().parents[2]


def test_a_checkpoint_of_another_model_is_used_with_a_warning(tmp_path, caplog):
    dense = write_tiny_checkpoint(ROOT / "configs/models/tiny_qwen3_text.yaml", tmp_path / "text", seed=0)
    with caplog.at_level(logging.WARNING, logger="megarl.preflight"):
        check_init_model_matches(dense, str(ROOT / "configs/models/tiny_qwen3_text.yaml"))
        assert caplog.records == []
        check_init_model_matches(dense, str(ROOT / "configs/models/tiny_qwen3_moe.yaml"))
    (rec,) = caplog.records
    assert "model_type qwen3 (the YAML: qwen3_moe)" in rec.getMessage()
    assert "point model.checkpoint at a new directory" in rec.getMessage()
