"""`megarl export-hf`: a run checkpoint's policy as an HF model directory.

Checked with what shares nothing with megarl's export: the tensors against the checkpoint's raw Megatron
tensors converted by tests/e2e/adam_oracle.py's own HF naming (not megarl's bridge), the logits of the
exported model run by HF transformers against megarl's trainer loaded from the same checkpoint (within
1e-5), and the tokenizer loaded by AutoTokenizer. Negative control: the base checkpoint's weights differ
from the exported ones (the run trained), so an export of the wrong weights fails.
"""
import json
from pathlib import Path

import torch
from adam_oracle import equal, hf_tensors, params, to_hf, trainer_state
from conftest import run_megarl
from test_resume import SMALL


def test_export_hf_of_a_run_checkpoint(ckpt, tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    r = run_megarl("train", "--config", "configs/tiny_cpu.yaml", "--output-dir", str(run),
                   f"model.checkpoint={ckpt}", "rollout.backend=hf", "trainer.total_steps=2",
                   *[a for a in SMALL if not a.startswith("logging.save_every")], "logging.save_every=2")
    assert r.returncode == 0, r.stderr[-3000:]
    step = run / "checkpoints" / "step_2"
    r = run_megarl("export-hf", str(step), str(out))
    assert r.returncode == 0 and f"wrote {out} (step 2)" in r.stdout, r.stderr[-3000:]

    hf = json.loads((out / "config.json").read_text())
    exported = hf_tensors(out)
    assert equal(exported, to_hf(params(trainer_state(step)), hf))
    assert not equal(exported, hf_tensors(ckpt)), "the negative control: the base weights are not the export"

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template and (out / "generation_config.json").is_file()
    assert _max_logprob_gap(step, out, int(hf["vocab_size"])) <= 1e-5

    bad = run_megarl("export-hf", str(run), str(tmp_path / "x"))
    assert bad.returncode == 2 and "is not a run checkpoint" in bad.stderr


def _max_logprob_gap(step, out, vocab: int) -> float:
    """max |log p| gap between HF transformers on the export and megarl's trainer loaded from ``step``."""
    import transformers

    from megarl.builder import build_trainer, load_run_config
    from megarl.types import TrainBatch

    cfg = load_run_config(step.parent.parent / "config.yaml")
    trainer = build_trainer(cfg, Path(cfg.model.checkpoint))
    trainer.load_state(str(step / "trainer"))
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([12, 7, 12])
    tokens = torch.randint(1, vocab, (3, 12), generator=g)
    for b, n in enumerate(lens.tolist()):
        tokens[b, n:] = 0
    z = torch.zeros(3, 11)
    batch = TrainBatch(tokens=tokens, seq_lens=lens, loss_mask=(z + 1), logp_behav=z, versions=z.long(),
                       advantages=z, traj_ids=["a", "b", "c"])
    mine = trainer.logprobs(batch)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    gap = 0.0
    with torch.no_grad():
        for b, n in enumerate(lens.tolist()):
            ids = tokens[b: b + 1, :n]
            ref = torch.log_softmax(model(ids).logits.float()[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
            gap = max(gap, float((ref - mine[b, : n - 1]).abs().max()))
    return gap
