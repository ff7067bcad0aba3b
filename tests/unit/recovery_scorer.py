"""A small scorer with the trainer surface the recovery strategies use, and version histories.

:class:`HFScorerForTests` stands in for ``MegatronTrainer`` in unit tests only: it
runs a real tiny transformers Qwen3 model and implements exactly the "scorer"
surface of the trainer (``logprobs``, ``get_params``, ``set_params``,
``use_params``, ``version``). ``fake_step`` plays the role of an optimizer step:
it moves every parameter deterministically and bumps ``version``.
"""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from megarl.types import TrainBatch, Trajectory

REPO = Path(__file__).resolve().parents[2]
TINY_YAML = REPO / "configs" / "models" / "tiny_qwen3.yaml"


def tiny_checkpoint(path: str | Path, seed: int = 0) -> Path:
    """The tiny Qwen3 checkpoint at ``path`` (written once)."""
    from megarl.models.tiny import write_tiny_checkpoint

    path = Path(path)
    if not (path / "config.json").is_file():
        write_tiny_checkpoint(TINY_YAML, path, seed=seed)
    return path


class HFScorerForTests:
    """Stands in for MegatronTrainer in unit tests only (transformers model, fp32, CPU)."""

    def __init__(self, checkpoint_dir: str | Path, version: int = 0, temperature: float = 1.0) -> None:
        import transformers

        torch.set_num_threads(1)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            str(checkpoint_dir), dtype=torch.float32).eval()
        self.version = version
        #: log-probs are of softmax(logits / temperature), as the trainer's
        self.temperature = temperature
        self.dtype = "float32"
        self.last_skip_reason: str | None = None
        #: traj_ids of the rows of every forward, and how many times params were swapped in
        self.forward_rows: list[list[str]] = []
        self.n_swaps = 0

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L-1]: log-prob of tokens[:, t+1] given tokens[:, :t+1] under the current params."""
        self.forward_rows.append(list(batch.traj_ids))
        tokens = batch.tokens
        L = tokens.shape[1]
        attn = (torch.arange(L)[None, :] < batch.seq_lens[:, None]).long()
        logits = self.model(input_ids=tokens, attention_mask=attn).logits.float() / self.temperature
        logp = torch.log_softmax(logits[:, :-1], dim=-1)
        return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)

    def get_params(self, device: str | torch.device | None = "cpu") -> dict[str, torch.Tensor]:
        self.n_copies = getattr(self, "n_copies", 0) + 1  # copies of the parameters taken (PCIe on a GPU)
        return {n: p.detach().to(p.device if device is None else device, torch.float32, copy=True)
                for n, p in self.model.named_parameters()}

    def keep_params(self, params: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        self.n_kept = getattr(self, "n_kept", 0) + 1
        return self.get_params() if params is None else {k: t.clone() for k, t in params.items()}

    def release_params(self, params: dict[str, torch.Tensor]) -> None:
        self.n_released = getattr(self, "n_released", 0) + 1

    def params_ready(self) -> None:
        pass  # get_params copies synchronously

    @torch.no_grad()
    def set_params(self, params: dict[str, torch.Tensor]) -> None:
        for n, p in self.model.named_parameters():
            p.copy_(params[n])

    @contextmanager
    def use_params(self, params: dict[str, torch.Tensor], saved: dict[str, torch.Tensor] | None = None):
        from megarl.trainer.param_copies import pointed_at, resident_match

        self.n_swaps += 1
        named = list(self.model.named_parameters())
        if resident_match(named, params):  # as the trainer's (megarl/trainer/param_copies.py)
            with pointed_at(named, params):
                yield
            return
        saved = self.get_params() if saved is None else saved
        self.set_params(params)
        try:
            yield
        finally:
            self.set_params(saved)

    @contextmanager
    def use_params_from(self, make, *, resident=False):
        from megarl.trainer.param_copies import pointed_at_made

        self.n_swaps += 1
        if resident:  # as the trainer's (megarl/trainer/param_copies.py)
            with pointed_at_made(list(self.model.named_parameters()), make):
                yield
            return
        saved = {}
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                saved[n] = p.detach().to("cpu", copy=True)
                p.copy_(make(n, p.detach()))
        try:
            yield
        finally:
            self.set_params(saved)

    def save_hf_checkpoint(self, out_dir: str) -> Path:
        self.model.save_pretrained(out_dir, safe_serialization=True)
        return Path(out_dir)

    @torch.no_grad()
    def load_hf_checkpoint(self, ckpt_dir: str) -> None:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(Path(ckpt_dir).glob("*.safetensors")):
            state.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise RuntimeError(f"{ckpt_dir}: missing {missing}, unexpected {unexpected}")

    @torch.no_grad()
    def fake_step(self, scale: float = 0.05) -> None:
        """A deterministic stand-in for an optimizer step: every parameter moves; version += 1."""
        g = torch.Generator().manual_seed(1000 + self.version)
        for p in self.model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
        self.version += 1


def make_hf_scorer(checkpoint_dir: str, temperature: float = 1.0) -> HFScorerForTests:
    """Factory for the dedicated strategy's child process (``scorer_factory`` option)."""
    return HFScorerForTests(checkpoint_dir, temperature=temperature)


def rewind(trainer_and_params: tuple, version: int):
    """The trainer of ``(trainer, initial params)`` back at those params, at ``version`` (shared across tests)."""
    trainer, initial = trainer_and_params
    trainer.set_params(initial)
    trainer.version = version
    return trainer


def make_traj(traj_id: str, prompt: list[int], runs: list[tuple[str, int, int]], seed: int = 0,
              vocab: int = 16) -> Trajectory:
    """A trajectory from ``runs`` of (kind, n_tokens, version): kind "policy" or "tool"."""
    g = torch.Generator().manual_seed(seed)
    t = Trajectory(traj_id=traj_id, group_id="g", prompt_ids=list(prompt))
    for kind, n, version in runs:
        ids = torch.randint(4, vocab, (n,), generator=g).tolist()
        if kind == "policy":
            t.append_policy(ids, [-1.0 - 0.1 * i for i in range(n)], [version] * n)
        else:
            t.append_tool(ids)
    t.advantage = 1.0
    return t


class LoopState:
    """The bits of the loop a RecoveryContext reads: live trajectories and the published version."""

    def __init__(self) -> None:
        self.live: list[Trajectory] = []
        self.published: int | None = None

    def live_versions(self) -> set[int]:
        vs = set() if self.published is None else {self.published}
        for t in self.live:
            vs |= t.policy_versions()
        return vs

    def live_trajectories(self) -> list[Trajectory]:
        return list(self.live)

    def context(self, trainer, run_dir: str = "", loss_cfg=None, checkpoint_dir: str = ""):
        from recovery.base import RecoveryContext

        return RecoveryContext(trainer=trainer, loss_cfg=loss_cfg, live_versions=self.live_versions,
                               live_trajectories=self.live_trajectories, run_dir=str(run_dir),
                               checkpoint_dir=str(checkpoint_dir))


def extend(traj: Trajectory, kind: str, n: int, version: int, seed: int) -> Trajectory:
    """Append ``n`` policy (or tool) tokens of ``version`` to ``traj``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 16, (n,), generator=g).tolist()
    if kind == "policy":
        traj.append_policy(ids, [-1.0 - 0.1 * i for i in range(n)], [version] * n)
    else:
        traj.append_tool(ids)
    return traj


def drive_history(strategy, trainer, loop: LoopState, *, extra_step: bool = False, step=None):
    """Run the loop's hook sequence over a hand-built version history; returns (batch, trajs, params_by_version).

    The trainer starts at version 7. t0: tokens 1-4 by v7 (interrupted by the publish of v8),
    5-10 by v8; t1: finished under v7 (3 policy tokens, 2 tool tokens, 3 policy tokens);
    t2: 5 tokens by v8. With ``extra_step`` the trainer takes one more optimizer step
    (version 9, not published) before the batch is anchored, so no token is of the
    current version.
    """
    step = step or (lambda tr: tr.fake_step())
    params = {}
    assert trainer.version == 7
    loop.published = 7
    strategy.on_weights_published(7)
    params[7] = trainer.get_params()
    t0 = extend(Trajectory("t0", "g0", [1, 5, 6], logp_old=[]), "policy", 4, 7, seed=1)
    t1 = extend(Trajectory("t1", "g0", [1, 7], logp_old=[]), "policy", 3, 7, seed=2)
    extend(t1, "tool", 2, -1, seed=3)
    extend(t1, "policy", 3, 7, seed=4)
    loop.live = [t0, t1]
    strategy.on_segment_finished(t1)
    step(trainer)  # an optimizer step on some earlier batch
    strategy.after_optimizer_step(trainer.version, {})
    strategy.on_rollout_interrupted([t0])
    strategy.before_publish(7, 8)
    loop.published = 8
    strategy.on_weights_published(8)
    params[8] = trainer.get_params()
    extend(t0, "policy", 6, 8, seed=5)
    strategy.on_segment_finished(t0)
    t2 = extend(Trajectory("t2", "g1", [1, 9, 9, 9], logp_old=[]), "policy", 5, 8, seed=6)
    loop.live.append(t2)
    strategy.on_segment_finished(t2)
    if extra_step:
        step(trainer)
        strategy.after_optimizer_step(trainer.version, {})
    for t in (t0, t1, t2):
        t.advantage = 1.0
    trajs = [t0, t1, t2]
    return TrainBatch.from_trajectories(trajs, version=trainer.version), trajs, params
