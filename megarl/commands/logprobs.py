"""`megarl logprobs`: teacher-forced log-probs of token sequences through the megatron trainer path.

Each input line ``{"input_ids": [...]}`` gives one output line
``{"logprobs": [...]}`` with ``len(input_ids) - 1`` entries, entry t being
log p(input_ids[t+1] | input_ids[..t]) (the TrainBatch convention), p being
softmax(logits / --temperature). Runs as
one process or under torchrun (``--tp/--pp/--ep``); only rank 0 writes.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from megarl.commands._jsonl_input import read_input_ids
from megarl.types import TrainBatch

#: rows per trainer call: bounds the [rows, longest] padded batch held at once
ROWS_PER_CALL = 256


def register(sub) -> None:
    p = sub.add_parser("logprobs", help="teacher-forced log-probs of token sequences (megatron path)")
    p.add_argument("--checkpoint", required=True, help="HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--input", required=True, help='JSONL file, one {"input_ids": [...]} per line')
    p.add_argument("--output", required=True, help='JSONL file to write, one {"logprobs": [...]} per line')
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (MoE)")
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help="token budget per micro-batch")
    p.add_argument("--allow-local-spec", action="store_true",
                   help="on CUDA without TransformerEngine, use megatron's local layers (model.allow_local_spec)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameter dtype of the model (log-probs are computed in float32 either way)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="log-probs of softmax(logits / T): the sampling temperature of the log-probs to compare with")
    p.set_defaults(func=run)


def _batch(rows: list[list[int]]):
    import torch  # lazy here and below: torch and Megatron load when the command runs, not for `megarl --help`

    B, L = len(rows), max(len(r) for r in rows)
    tokens = torch.zeros(B, L, dtype=torch.long)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    z = torch.zeros(B, L - 1)
    return TrainBatch(tokens=tokens, seq_lens=torch.tensor([len(r) for r in rows]), loss_mask=z,
                      logp_behav=z, versions=z.long(), advantages=z, traj_ids=[str(i) for i in range(B)])


def run(args) -> int:
    from megarl.models.bridge import read_hf_config
    from megarl.trainer.megatron_trainer import MegatronTrainer
    from megarl.trainer.parallel import shutdown

    hf = read_hf_config(args.checkpoint)
    rows = read_input_ids(args.input, int(hf["max_position_embeddings"]), int(hf["vocab_size"]))
    results: list[list[float]] = [[] for _ in rows]  # rows of < 2 tokens have no log-probs
    scored = [i for i, r in enumerate(rows) if len(r) >= 2]
    rank = int(os.environ.get("RANK", "0"))
    if scored:
        trainer = MegatronTrainer(args.checkpoint, tp=args.tp, pp=args.pp, ep=args.ep,
                                  micro_batch_tokens=args.micro_batch_tokens, dtype=args.dtype,
                                  temperature=args.temperature, allow_local_spec=args.allow_local_spec,
                                  forward_only=True)  # scores only: no gradient buffer, no optimizer
        rank = trainer.parallel.rank
        for start in range(0, len(scored), ROWS_PER_CALL):
            chunk = scored[start: start + ROWS_PER_CALL]
            logp = trainer.logprobs(_batch([rows[i] for i in chunk]))
            for b, i in enumerate(chunk):
                results[i] = logp[b, : len(rows[i]) - 1].tolist()
        shutdown()
    if rank == 0:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for lp in results:
                f.write(json.dumps({"logprobs": lp}) + "\n")
        os.replace(tmp, out)
        print(f"wrote {len(results)} lines to {out}")
    return 0
