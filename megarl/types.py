"""Dataclasses that cross megarl's boundaries.

The controller, the trainer, the rollout engines, the reward service and the
recovery strategies exchange only these. Symbols follow docs/design.md: for each
generated token t, ``versions[t]`` is v_t, the policy version that sampled it,
``logp_behav[t]`` the engine's log-prob of the distribution it sampled from,
``logp_old[t]`` the trainer's log-prob under the same version v_t.

Position convention for per-token lists of a :class:`Trajectory`: index i
refers to ``response_ids[i]``. For a :class:`TrainBatch` (tensors over the
whole prompt+response sequence) index t refers to the prediction of
``tokens[t + 1]`` from ``tokens[: t + 1]``, the same convention as
``megarl logprobs`` (one entry less than the sequence length).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from megarl.routes import RouteSegment, append_segment, newest_routes

FinishReason = Literal["stop", "length", "abort"]

#: version tag of tokens no policy generated (tool/environment output).
NO_VERSION = -1


@dataclass
class SamplingParams:
    """Sampling settings of one generation request."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 64
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        return cls(**d)


@dataclass
class GenerateRequest:
    """One request to a rollout engine: continue ``prompt_ids``."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    #: return the MoE routes of every position the engine processed (``GenerateResult.routes``)
    return_routes: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "prompt_ids": list(self.prompt_ids),
                "sampling": self.sampling.to_dict(), "return_routes": self.return_routes}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerateRequest":
        return cls(request_id=d["request_id"], prompt_ids=list(d["prompt_ids"]),
                   sampling=SamplingParams.from_dict(d.get("sampling", {})),
                   return_routes=bool(d.get("return_routes", False)))


@dataclass
class GenerateResult:
    """What an engine produced for one request (partial when aborted)."""

    request_id: str
    output_ids: list[int]
    logp_behav: list[float]
    versions: list[int]
    finish_reason: FinishReason
    #: with ``return_routes``: the route segments of this request (megarl/routes.py) in the coordinates of
    #: prompt_ids + output_ids, one per forward history (several when the engine recomputed the request); None
    #: when the engine could not return them
    routes: list[RouteSegment] | None = None
    #: prompt tokens the engine read from its prefix cache instead of computing them (vLLM; 0 for the hf engine)
    n_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if not (len(self.output_ids) == len(self.logp_behav) == len(self.versions)):
            raise ValueError(
                f"GenerateResult {self.request_id}: output_ids/logp_behav/versions lengths differ "
                f"({len(self.output_ids)}/{len(self.logp_behav)}/{len(self.versions)})")

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in vars(self).items() if k != "routes"}
        return {**d, "routes": None if self.routes is None else [s.to_dict() for s in self.routes]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GenerateResult":
        routes = d.get("routes")
        return cls(**{**d, "routes": None if routes is None else [RouteSegment.from_dict(s) for s in routes]})


@dataclass(frozen=True)
class Segment:
    """A maximal run of response tokens ``[start, end)`` sampled by one version."""

    traj_id: str
    start: int
    end: int
    version: int


@dataclass
class Trajectory:
    """One sample: a prompt and everything appended after it.

    ``response_ids`` holds policy tokens and, for multi-turn workflows, tool or
    environment tokens between policy turns. Tool tokens have ``loss_mask`` 0,
    ``versions`` :data:`NO_VERSION` and ``logp_behav`` 0.0; they are never
    trained on and never need old logits.
    """

    traj_id: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logp_behav: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    #: exact ``logp_old`` per response token, filled by an exact recovery strategy
    #: (NaN where not yet known; None when the strategy keeps none).
    logp_old: list[float] | None = None
    reward: float | None = None
    reward_failed: bool = False
    advantage: float | None = None
    #: why the last policy turn ended; a multi-turn workflow sets it after every turn, so it does not
    #: say whether more tokens will come (``finished`` does)
    finish_reason: FinishReason | None = None
    #: True once the workflow returned: no token is appended any more (set by the controller). Until
    #: then a publish reports the trajectory as partial, also between the turns of a multi-turn workflow
    finished: bool = False
    n_interrupts: int = 0
    #: free-form task data (e.g. the reference answer); must be JSON-serializable.
    meta: dict[str, Any] = field(default_factory=dict)
    #: further trajectories of the same episode, each with a prompt of its own: an agent's turn whose
    #: rendered conversation does not extend what the model saw before (megarl/agents/client.py). They
    #: share this trajectory's reward and advantage; the staleness gate counts the episode once
    parts: list["Trajectory"] = field(default_factory=list)
    #: with routing replay: the route segments of the requests that generated the policy tokens, in order
    #: (megarl/routes.py: each keeps the routes of every position its request fed); empty without replay
    route_segments: list[RouteSegment] = field(default_factory=list)

    # -- appending -------------------------------------------------------------
    def add_route_segment(self, seg: RouteSegment) -> None:
        """Keep the routes of a request that continued this trajectory (positions in :attr:`tokens`'s
        coordinates; ``seg.version`` set): one segment per forward history (megarl/routes.py)."""
        append_segment(self.route_segments, seg)

    def append_policy(self, output_ids: list[int], logp_behav: list[float], versions: list[int]) -> None:
        self.response_ids += list(output_ids)
        self.logp_behav += list(logp_behav)
        self.versions += list(versions)
        self.loss_mask += [1] * len(output_ids)
        if self.logp_old is not None:
            self.logp_old += [math.nan] * len(output_ids)

    def append_tool(self, token_ids: list[int]) -> None:
        self.response_ids += list(token_ids)
        self.logp_behav += [0.0] * len(token_ids)
        self.versions += [NO_VERSION] * len(token_ids)
        self.loss_mask += [0] * len(token_ids)
        if self.logp_old is not None:
            self.logp_old += [0.0] * len(token_ids)

    # -- views -------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def n_policy_tokens(self) -> int:
        return sum(self.loss_mask)

    def segments(self) -> list[Segment]:
        """Maximal runs of policy tokens of one version, in order."""
        segs: list[Segment] = []
        start = None
        for i, (v, m) in enumerate(zip(self.versions, self.loss_mask)):
            if start is not None and (not m or v != self.versions[start]):
                segs.append(Segment(self.traj_id, start, i, self.versions[start]))
                start = None
            if m and start is None:
                start = i
        if start is not None:
            segs.append(Segment(self.traj_id, start, len(self.versions), self.versions[start]))
        return segs

    def policy_versions(self) -> set[int]:
        return {v for v, m in zip(self.versions, self.loss_mask) if m}

    @property
    def is_spliced(self) -> bool:
        return len(self.policy_versions()) >= 2

    def rows(self) -> list["Trajectory"]:
        """The training rows of this episode: itself, then its parts."""
        return [self, *self.parts]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        parts = [cls.from_dict(p) for p in d.get("parts", [])]
        segs = [s if isinstance(s, RouteSegment) else RouteSegment.from_dict(s) for s in d.get("route_segments", [])]
        return cls(**{**d, "parts": parts, "route_segments": segs})


def training_rows(trajs: list[Trajectory]) -> list[Trajectory]:
    """Every training row of ``trajs`` (episodes with parts contribute several), in order."""
    return [r for t in trajs for r in t.rows()]


def append_turn(traj: Trajectory, n_before: int, result: GenerateResult) -> None:
    """Record one policy turn that started when ``traj`` had ``n_before`` response tokens.

    A ``generate`` may already have appended the turn's tokens itself (the
    controller does, chunk by chunk, so recovery hooks see partial segments of
    an interrupted turn); then they are checked, not appended twice.
    """
    n_new = len(traj.response_ids) - n_before
    if n_new == 0:
        traj.append_policy(result.output_ids, result.logp_behav, result.versions)
    elif (traj.response_ids[n_before:] != result.output_ids
          or traj.versions[n_before:] != result.versions):
        raise RuntimeError(f"trajectory {traj.traj_id}: generate appended {n_new} tokens that differ from "
                           f"the {len(result.output_ids)} it returned")


@dataclass
class RewardInput:
    """What a reward function sees of one finished trajectory (megarl/rewards/__init__.py)."""

    #: the decoded response, special tokens (EOS, template markers) skipped
    response: str
    #: the row's ground truth (``data.answer_key``)
    answer: Any = None
    #: the decoded prompt, as the model saw it
    prompt: str = ""
    #: every other field of the data row
    row: dict[str, Any] = field(default_factory=dict)
    #: "stop" (ended on a stop token) or "length" (ran out of tokens)
    finish_reason: str | None = None
    response_ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)

    def info(self) -> dict[str, Any]:
        """The keyword arguments a reward function may take."""
        return {"prompt": self.prompt, "row": self.row, "finish_reason": self.finish_reason,
                "response_ids": list(self.response_ids), "prompt_ids": list(self.prompt_ids)}


@dataclass
class AnchorResult:
    """What a recovery strategy hands the loss for one batch.

    ``logp_anchor`` is a [B, L-1] tensor in TrainBatch convention, or None when
    the anchor depends on the current log-probs (``from_theta`` is then a
    function ``(logp_theta_detached, batch_slice) -> logp_anchor`` that the
    trainer calls per micro-batch, e.g. AReaL's loglinear interpolation).
    ``exact`` is True when the anchor is the true ``logp_old``.
    """

    logp_anchor: Any | None
    exact: bool
    from_theta: Any | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainBatch:
    """A padded batch of trajectories, as tensors over prompt+response.

    Shapes: ``tokens`` [B, L] (right-padded); every other per-token tensor is
    [B, L-1] where entry t refers to the prediction of ``tokens[:, t+1]``.
    ``versions`` holds :data:`NO_VERSION` outside policy tokens; ``logp_old`` is
    NaN where no exact old log-prob is known (None when no strategy fills it).
    """

    tokens: Any
    seq_lens: Any
    loss_mask: Any
    logp_behav: Any
    versions: Any
    advantages: Any
    traj_ids: list[str]
    #: prompt length per row (response token i of row b sits at index prompt_lens[b]-1+i).
    prompt_lens: Any = None
    #: trainer version v_theta when the batch was formed (optimizer steps so far).
    version: int = 0
    logp_old: Any | None = None
    #: the loss anchor chosen by the recovery strategy (set by the loop before the train step)
    logp_anchor: Any | None = None
    #: [B, L-1, layers, k] int16: the MoE routes the policy forward replays at input position t (tokens[:, t]),
    #: the newest segment's (megarl/routes.py), -1 where unknown (routed live); None without routing replay
    routes: Any | None = None
    #: per row, the trajectory's route segments (megarl/routes.py): forwards at a token's own version replay
    #: its segment's routes (megarl.routes.scoring_units); None without routing replay
    route_segments: list[list[RouteSegment]] | None = None

    @property
    def size(self) -> int:
        return len(self.traj_ids)

    @classmethod
    def from_trajectories(cls, trajs: list[Trajectory], version: int, pad_id: int = 0) -> "TrainBatch":
        import torch  # lazy: this module also serves light processes (the HTTP client, the CLI)

        if not trajs:
            raise ValueError("TrainBatch needs at least one trajectory")
        B = len(trajs)
        L = max(len(t.prompt_ids) + len(t.response_ids) for t in trajs)
        tokens = torch.full((B, L), pad_id, dtype=torch.long)
        loss_mask = torch.zeros(B, L - 1)
        logp_behav = torch.zeros(B, L - 1)
        versions = torch.full((B, L - 1), NO_VERSION, dtype=torch.long)
        advantages = torch.zeros(B, L - 1)
        any_old = any(t.logp_old is not None for t in trajs)
        segments = [list(t.route_segments) for t in trajs]
        logp_old = torch.full((B, L - 1), math.nan) if any_old else None
        seq_lens = torch.zeros(B, dtype=torch.long)
        prompt_lens = torch.zeros(B, dtype=torch.long)
        for b, t in enumerate(trajs):
            seq = t.prompt_ids + t.response_ids
            n, p, r = len(seq), len(t.prompt_ids), len(t.response_ids)
            tokens[b, :n] = torch.tensor(seq, dtype=torch.long)
            seq_lens[b] = n
            prompt_lens[b] = p
            # response token i sits at sequence position p+i, predicted at index p+i-1
            sl = slice(p - 1, p - 1 + r)
            loss_mask[b, sl] = torch.tensor(t.loss_mask, dtype=torch.float32)
            logp_behav[b, sl] = torch.tensor(t.logp_behav, dtype=torch.float32)
            versions[b, sl] = torch.tensor(t.versions, dtype=torch.long)
            advantages[b, sl] = float(t.advantage or 0.0) * loss_mask[b, sl]
            if logp_old is not None and t.logp_old is not None:
                logp_old[b, sl] = torch.tensor(t.logp_old, dtype=torch.float32)
        return cls(tokens=tokens, seq_lens=seq_lens, loss_mask=loss_mask, logp_behav=logp_behav,
                   versions=versions, advantages=advantages, traj_ids=[t.traj_id for t in trajs],
                   prompt_lens=prompt_lens, version=version, logp_old=logp_old,
                   routes=newest_routes(segments, L - 1), route_segments=segments if any(segments) else None)

    def select(self, idx: list[int]) -> "TrainBatch":
        """Sub-batch of rows ``idx`` (micro-batching), trimmed to its longest row."""
        import torch  # lazy: this module also serves light processes (the HTTP client, the CLI)

        ix = torch.as_tensor(idx, dtype=torch.long)
        L = int(self.seq_lens[ix].max())

        def cut(x, width):
            return None if x is None else x[ix, :width]

        return TrainBatch(tokens=cut(self.tokens, L), seq_lens=self.seq_lens[ix],
                          loss_mask=cut(self.loss_mask, L - 1), logp_behav=cut(self.logp_behav, L - 1),
                          versions=cut(self.versions, L - 1), advantages=cut(self.advantages, L - 1),
                          traj_ids=[self.traj_ids[i] for i in idx],
                          prompt_lens=None if self.prompt_lens is None else self.prompt_lens[ix],
                          version=self.version,
                          logp_old=cut(self.logp_old, L - 1), logp_anchor=cut(self.logp_anchor, L - 1),
                          routes=cut(self.routes, L - 1),
                          route_segments=None if self.route_segments is None else [self.route_segments[i] for i in idx])

