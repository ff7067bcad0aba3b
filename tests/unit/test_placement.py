"""Placement plans: good layouts, every misfit named with its numbers, allocations from Slurm/MPI/torchrun."""
from pathlib import Path

import pytest

from megarl.builder import load_run_config
from megarl.errors import ConfigError
from megarl.launch import cluster
from megarl.launch.cluster import Allocation, compress_hosts, expand_nodelist, simulated
from megarl.launch.engine_key_env import ensure_run_keys
from megarl.launch.overlays import flatten
from megarl.launch.placement import load_hf_config, param_counts, resolve_plan
from megarl.launch.role_commands import render
from megarl.launch.roles import current_role
from megarl.trainer.mpi_bootstrap import _from_env_only, bootstrap_env_from_mpi, under_mpi

ROOT = Path(__file__).resolve().parents[2]
CFG_30B = ROOT / "configs" / "qwen3_30b_a3b_h100.yaml"
CFG_4B = ROOT / "configs" / "qwen3_4b_h100.yaml"
CFG_TINY = ROOT / "configs" / "tiny_cpu.yaml"


def plan_for(path, overrides=(), nodes=None, gpus=8, alloc=None):
    cfg = load_run_config(path, list(overrides))
    hf, _ = load_hf_config(cfg)
    if alloc is None:
        alloc = simulated(nodes, gpus) if nodes else cluster.local()
    return resolve_plan(cfg, hf, alloc, config_path=str(path), overrides=list(overrides))


# -- host lists ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, hosts", [
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a1,b[1-2]", ["a1", "b1", "b2"]),
    ("gpu[9-11]", ["gpu9", "gpu10", "gpu11"]),
    ("r[1-2]-n[01-02]", ["r1-n01", "r1-n02", "r2-n01", "r2-n02"]),
    ("x[001-002],y7,z[3]", ["x001", "x002", "y7", "z3"]),
    ("single", ["single"]),
])
def test_expand_nodelist(text, hosts):
    assert expand_nodelist(text) == hosts


@pytest.mark.parametrize("text, match", [("node[01-", "without"), ("node]1", "without"),
                                         ("node[4-2]", "backwards"), ("node[a-b]", "bad range")])
def test_expand_nodelist_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        expand_nodelist(text)


def test_compress_hosts():
    assert compress_hosts(["node01", "node02", "node03", "gpu7"]) == "node[01-03],gpu7"
    assert compress_hosts(["a1", "a3"]) == "a1,a3"


def test_allocation_sources():
    env = {"SLURM_JOB_NODELIST": "gpu[101-103]", "SLURM_NNODES": "3", "SLURM_GPUS_PER_NODE": "h100:8",
           "SLURM_JOB_ID": "77", "SLURM_CPUS_ON_NODE": "96"}
    a = cluster.from_slurm(env)
    assert (a.hosts, a.gpus_per_node, a.job_id, a.cpus_per_node, a.source) == \
        (("gpu101", "gpu102", "gpu103"), 8, "77", 96, "slurm")
    assert cluster.from_slurm({"SLURM_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "4"}).gpus_per_node == 4
    assert cluster.from_slurm({"SLURM_NODELIST": "n1", "SLURM_JOB_GPUS": "0,1"}).gpus_per_node == 2
    assert cluster.from_slurm({}) is None
    m = cluster.from_mpi({"OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"})
    assert (m.n_nodes, m.gpus_per_node, m.hosts[1]) == (2, 8, "rank-node1")
    t = cluster.from_torchrun({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "h0"})
    assert (t.hosts, t.gpus_per_node) == (("h0", "rank-node1"), 4)
    with pytest.raises(ConfigError, match="world size 6 is not a multiple of the ranks per node 4"):
        cluster.from_torchrun({"WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    assert cluster.detect(3, 8).hosts == ("node01", "node02", "node03")
    with pytest.raises(ConfigError, match="both --nodes and --gpus-per-node"):
        cluster.detect(3, None)
    assert cluster.local_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1,2"}) == 3


# -- good plans ------------------------------------------------------------------------------------
def test_30b_plan_on_four_nodes():
    plan = plan_for(CFG_30B, nodes=4)
    t = plan.trainer
    assert (t.hosts, t.world_size, t.ranks_per_node) == (("node01", "node02"), 16, 8)
    assert (t.tp, t.pp, t.ep, t.dp, t.expert_dp, t.sequence_parallel) == (2, 1, 8, 8, 1, True)
    assert [(e.host, e.gpu_ids, e.port, e.tp) for e in plan.engines] == [
        ("node03", (0, 1, 2, 3), 8100, 4), ("node03", (4, 5, 6, 7), 8101, 4),
        ("node04", (0, 1, 2, 3), 8100, 4), ("node04", (4, 5, 6, 7), 8101, 4)]
    assert plan.dedicated is None and plan.weight_sync_world == 17
    assert (plan.master_addr, plan.master_port, plan.weight_sync_port) == ("node01", 29500, 29600)
    text = plan.describe()
    assert "tp=2 pp=1 ep=8 dp=8 (expert dp=1)" in text and "30.53B params (3.35B active)" in text


def test_dedicated_gets_its_node_or_spare_gpus():
    plan = plan_for(CFG_30B, ["recovery.name=dedicated"], nodes=5)
    d = plan.dedicated
    assert (d.host, d.gpu_ids, d.tp, d.spawned) == ("node05", (0,), 1, False)
    assert plan.weight_sync_world == 17  # the scorer reads versions from the run directory, not the group
    assert "node05: 7 of 8 GPUs idle" in plan.notes
    # no dedicated node: it takes a GPU the engines leave free
    plan = plan_for(CFG_4B, ["recovery.name=dedicated", "placement.dedicated_nodes=0", "placement.dedicated_tp=1",
                             "rollout.n_engines=6"], nodes=2)
    assert (plan.dedicated.host, plan.dedicated.gpu_ids, plan.dedicated.spawned) == ("node02", (6,), False)


def _env_of(cmd) -> dict:
    return dict(a.split("=", 1) for a in cmd.argv if a.startswith(("MEGARL_", "CUDA_")) and "=" in a)


def test_dedicated_role_commands(monkeypatch):
    """The scorer on its own node: its port and the trainer's address of it, one shared key, one process."""
    monkeypatch.delenv("MEGARL_DEDICATED_AUTHKEY", raising=False)
    plan = plan_for(CFG_30B, ["recovery.name=dedicated"], nodes=5)
    for launcher in ("torchrun", "slurm", "mpirun"):
        cmds = {c.name: c for c in render(plan, launcher, python="py")}
        trainer = next(c for c in cmds.values() if c.role == "trainer")
        ded = cmds["dedicated"]
        t_env, d_env = _env_of(trainer), _env_of(ded)
        assert t_env["MEGARL_DEDICATED_ADDR"] == "node05:8100" and "MEGARL_SERVER_PORT" not in t_env, launcher
        assert (d_env["MEGARL_ROLE"], d_env["MEGARL_SERVER_PORT"], d_env["MEGARL_SERVER_TP"]) == \
            ("dedicated", "8100", "1"), launcher
        # no key on any command line: `megarl launch` hands a random one to both through the environment
        assert not any("MEGARL_DEDICATED_AUTHKEY=" in a for c in cmds.values() for a in c.argv), launcher
        assert d_env["MEGARL_SERVER_HOST"] == "node05", launcher  # it listens where the trainer reaches it
        assert "torch.distributed.run" not in ded.argv and ded.server, launcher  # one process
        assert ded.argv[-len(plan.overrides) - 4:][:2] == ("-m", "megarl.train"), launcher
        role = current_role(d_env)
        assert (role.role, role.server_port) == ("dedicated", 8100)
        assert current_role(t_env).dedicated_addr == "node05:8100"
        assert all("MEGARL_DEDICATED_AUTHKEY" not in a for c in cmds.values() if c.role == "engine" for a in c.argv)
    mpi = {c.name: c for c in render(plan, "mpirun", python="py")}
    assert "-n 1 " in mpi["dedicated"].shell()
    # the key `megarl launch` makes: random per run, never derived from the plan
    first, second = {}, {}
    ensure_run_keys(plan, "slurm", first)
    ensure_run_keys(plan, "slurm", second)
    key = first["MEGARL_DEDICATED_AUTHKEY"]
    assert len(key) == 32 and key != second["MEGARL_DEDICATED_AUTHKEY"]
    with pytest.raises(ConfigError, match="MEGARL_DEDICATED_AUTHKEY is not set: with torchrun every node"):
        ensure_run_keys(plan, "torchrun", {"MEGARL_ENGINE_KEY": "exported"})
    # a key in the launching environment stays out of the command lines; mpirun forwards it to remote nodes
    monkeypatch.setenv("MEGARL_DEDICATED_AUTHKEY", "s3cret")
    for launcher in ("torchrun", "slurm", "mpirun"):
        cmds = render(plan, launcher, python="py")
        assert not any("s3cret" in a or a.startswith("MEGARL_DEDICATED_AUTHKEY=") for c in cmds for a in c.argv)
    mpi = {c.name: c for c in render(plan, "mpirun", python="py")}
    assert "-x MEGARL_DEDICATED_AUTHKEY" in mpi["dedicated"].shell() and "-x MEGARL_DEDICATED_AUTHKEY" in \
        mpi["trainer"].shell() and "MEGARL_DEDICATED_AUTHKEY" not in mpi["engine0"].shell()
    # spawned beside rank 0 (cpu, no dedicated node): no address, no key
    monkeypatch.delenv("MEGARL_DEDICATED_AUTHKEY")
    (cmd,) = plan_for(CFG_TINY, ["recovery.name=dedicated"]).commands("torchrun", python="py")
    assert not any(a.startswith(("MEGARL_DEDICATED_", "MEGARL_SERVER_")) for a in cmd.argv)
    # cpu with a dedicated node: its own command there
    plan = plan_for(CFG_TINY, ["recovery.name=dedicated", "placement.dedicated_nodes=1"], nodes=2, gpus=0)
    assert (plan.dedicated.host, plan.dedicated.spawned, plan.dedicated.port) == ("node02", False, 8100)
    cmds = {c.name: c for c in plan.commands("torchrun", python="py")}
    assert _env_of(cmds["trainer"])["MEGARL_DEDICATED_ADDR"] == "node02:8100"
    # cpu, no dedicated node, placement.dedicated_command: its own command and port beside the trainer
    plan = plan_for(CFG_TINY, ["recovery.name=dedicated", "placement.dedicated_command=true",
                               "placement.engine_port=8200"])
    host = plan.trainer.hosts[0]
    assert (plan.dedicated.host, plan.dedicated.spawned, plan.dedicated.port) == (host, False, 8200)
    assert all(e.spawned for e in plan.engines)  # the engines stay the controller's children
    cmds = {c.name: c for c in plan.commands("torchrun", python="py")}
    assert _env_of(cmds["trainer"])["MEGARL_DEDICATED_ADDR"] == f"{host}:8200"
    assert _env_of(cmds["dedicated"])["MEGARL_SERVER_PORT"] == "8200"


def test_engines_share_trainer_node():
    plan = plan_for(CFG_4B, ["placement.engine_nodes=0", "placement.trainer_ranks=4", "rollout.n_engines=4"], nodes=1)
    assert plan.trainer.gpu_ids == (0, 1, 2, 3)
    assert [(e.host, e.gpu_ids) for e in plan.engines] == [("node01", (i,)) for i in range(4, 8)]


def test_cpu_plan_spawns_local_servers():
    plan = plan_for(CFG_TINY, ["placement.trainer_ranks=2", "recovery.name=dedicated"])
    assert plan.trainer.world_size == 2 and plan.trainer.gpu_ids == ()
    assert all(s.spawned and s.port == 0 for s in plan.servers)
    (cmd,) = plan.commands("torchrun", python="py")
    assert cmd.argv[:8] == ("env", "MEGARL_ROLE=trainer", "py", "-m", "torch.distributed.run", "--standalone",
                            "--nnodes=1", "--nproc-per-node=2")
    assert cmd.argv[8:10] == ("--shutdown-timeout=120", "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    assert cmd.argv[10:] == ("-m", "megarl.train", "--config", str(CFG_TINY), "placement.trainer_ranks=2",
                            "recovery.name=dedicated")


def test_commands_per_launcher():
    alloc = Allocation(("g1", "g2", "g3", "g4"), 8, "slurm", job_id="42", cpus_per_node=96)
    plan = plan_for(CFG_30B, alloc=alloc)
    slurm = render(plan, "slurm", python="py")
    assert [c.name for c in slurm] == ["trainer", "engines.g3", "engines.g4"]  # one step per engine node
    tr = slurm[0].shell()
    for piece in ("srun --nodes=2 --ntasks=2 --ntasks-per-node=1 --nodelist=g1,g2 --gpus-per-node=8 --cpus-per-task=96",
                  "MEGARL_ENGINE_ADDRS=g3:8100,g3:8101,g4:8100,g4:8101", "--master-addr=g1 --master-port=29500",
                  '--nnodes=2 --node-rank="$r"', "--nproc-per-node=8"):
        assert piece in tr
    assert "--ntasks=2 --ntasks-per-node=2 --nodelist=g3 --gpus-per-node=8 --cpus-per-task=48" in slurm[1].shell()
    assert "MEGARL_WEIGHT_SYNC_RANK=5" in slurm[1].shell() and slurm[2].server
    torchrun = render(plan, "torchrun", python="py")
    assert [(c.name, c.host) for c in torchrun[:2]] == [("trainer.node0", "g1"), ("trainer.node1", "g2")]
    assert "--node-rank=1 --master-addr=g1 --master-port=29500" in torchrun[1].shell()
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in torchrun[3].shell()
    mpi = render(plan, "mpirun", python="py")
    assert "-n 16" in mpi[0].shell() and "--host g1:8,g2:8" in mpi[0].shell()
    assert "MASTER_PORT=29500" in mpi[0].shell()
    check = render(plan, "slurm", python="py", bootstrap_check=True)
    assert len(check) == 1 and check[0].argv[-1].endswith(" -m megarl.launch.rendezvous_check")
    with pytest.raises(ConfigError, match="launcher 'ssh'"):
        render(plan, "ssh", python="py")


def test_slurm_trainer_node_rank_follows_the_plan_not_sorted_host_names():
    """Slurm's node order is not sorted by name (here gpu-b before gpu-a); node rank 0 (the controller, where
    MASTER_ADDR and MEGARL_WEIGHT_SYNC_ADDR point) must be the plan's first trainer host on every node."""
    import os
    import subprocess

    alloc = cluster.from_slurm({"SLURM_JOB_NODELIST": "gpu-b,gpu-a,gpu-c,gpu-d", "SLURM_GPUS_ON_NODE": "8",
                                "SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "96", "SLURM_MEM_PER_NODE": "1024000"})
    plan = plan_for(CFG_30B, alloc=alloc)
    trainer = render(plan, "slurm", python="echo")[0]
    assert plan.master_addr == "gpu-b" and "MEGARL_WEIGHT_SYNC_ADDR=gpu-b:29600" in trainer.argv
    bash = trainer.argv.index("bash")
    assert trainer.argv[bash + 1] == "-c"
    for node, rank in (("gpu-b", 0), ("gpu-a", 1)):
        out = subprocess.run(["bash", "-c", trainer.argv[bash + 2]], capture_output=True, text=True,
                             env={**os.environ, "SLURMD_NODENAME": node})
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[:10] == ["-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={rank}",
                                           "--master-addr=gpu-b", "--master-port=29500", "--nproc-per-node=8",
                                           "--shutdown-timeout=120",
                                           "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1", "-m"]
    out = subprocess.run(["bash", "-c", trainer.argv[bash + 2]], capture_output=True, text=True,
                         env={**os.environ, "SLURMD_NODENAME": "gpu-c"})
    assert out.returncode == 1 and "node gpu-c is not a trainer host (gpu-b,gpu-a)" in out.stderr


def test_slurm_steps_take_a_share_of_the_node_memory():
    """Every srun step asks for its GPUs' share of the job's memory per node, so two engine steps on one node
    do not each ask for all of it (the second would wait for the first to end)."""
    env = {"SLURM_JOB_NODELIST": "g[1-4]", "SLURM_GPUS_ON_NODE": "8", "SLURM_CPUS_ON_NODE": "96"}
    assert cluster.from_slurm({**env, "SLURM_MEM_PER_NODE": "1024000"}).mem_per_node_mb == 1024000
    assert cluster.from_slurm({**env, "SLURM_MEM_PER_CPU": "8000"}).mem_per_node_mb == 96 * 8000
    assert cluster._slurm_mem_mb({}, None, meminfo="/nonexistent") is None
    cmds = render(plan_for(CFG_30B, alloc=cluster.from_slurm({**env, "SLURM_MEM_PER_NODE": "1024000"})), "slurm",
                  python="py")
    assert "--gpus-per-node=8 --cpus-per-task=96 --mem=1024000M --exact" in cmds[0].shell()
    engines = [c for c in cmds if c.role == "engine"]
    # the two engines of a node share one step: each task its GPUs' share of the cores, the step the node's memory
    assert [c.shell().count("--nodelist=g3 --gpus-per-node=8 --cpus-per-task=48 --mem=1024000M --exact")
            for c in engines] == [1, 0]


# -- misfits, with their numbers --------------------------------------------------------------------
@pytest.mark.parametrize("overrides, nodes, message", [
    (["parallel.tp=3"], 4, "trainer: tp=3 does not divide num_attention_heads=32"),
    (["parallel.tp=8"], 4, "tp=8 does not divide num_key_value_heads=4"),
    (["parallel.ep=3"], 4, "ep=3 does not divide num_experts=128"),
    (["parallel.pp=5"], 4, "pp=5 does not divide num_hidden_layers=48"),
    (["parallel.ep=32"], 4, "16 ranks per stage is not divisible by ep\\*tp = 32\\*2 = 64"),
    (["parallel.sequence_parallel=false"], 4,
     "parallel.tp=2 with an MoE model needs parallel.sequence_parallel=true"),
    (["trainer.batch_size=252"], 4, "trainer.batch_size=252 is not divisible by the data-parallel size dp=8"),
    ([], 2, "plan needs 32 GPUs on 4 nodes \\(trainer 16 \\+ engines 16\\), allocation has 16 GPUs on 2 node"),
    (["recovery.name=dedicated"], 4, "plan needs 40 GPUs on 5 nodes \\(trainer 16 \\+ engines 16 \\+ dedicated 8\\)"),
    (["placement.engine_tp=3"], 4, "engines: placement.engine_tp=3 does not divide num_attention_heads=32"),
    (["placement.engine_tp=16"], 4, "placement.engine_tp=16 does not divide placement.gpus_per_node=8"),
    (["rollout.n_engines=5"], 4,
     "rollout.n_engines=5 x placement.engine_tp=4 need 20 GPUs; the 2 engine node\\(s\\) have 16"),
    (["placement.trainer_ranks=12"], 4, "trainer: world size 12 / pp 1 = 12 ranks per stage is not divisible by ep"),
    (["placement.trainer_ranks=32"], 4,
     "32 ranks on 2 node\\(s\\) is 16 per node, more than placement.gpus_per_node=8"),
    (["placement.trainer_ranks=15"], 4, "placement.trainer_ranks=15 is not divisible by placement.trainer_nodes=2"),
    (["placement.engine_tp=0"], 4, "placement.engine_tp=0 must be >= 1"),
])
def test_misfits_name_the_numbers(overrides, nodes, message):
    with pytest.raises(ConfigError, match=message):
        plan_for(CFG_30B, overrides, nodes=nodes)


def test_more_misfits():
    with pytest.raises(ConfigError, match="placement.gpus_per_node=8 but the allocation has 4 GPUs per node"):
        plan_for(CFG_30B, nodes=4, gpus=4)
    with pytest.raises(ConfigError, match="trainer nodes leave only 0 free \\(8 of 8 per node are trainer ranks\\)"):
        plan_for(CFG_4B, ["placement.engine_nodes=0"], nodes=2)
    with pytest.raises(ConfigError,
                       match="dedicated scorer: needs 1 GPU\\(s\\) \\(tp=1\\) but no node of the plan has 1 free"):
        plan_for(CFG_4B, ["recovery.name=dedicated", "placement.dedicated_nodes=0", "placement.dedicated_tp=1"],
                 nodes=3)
    # the scorer is one process: a tensor-parallel one is refused, naming the key to set
    with pytest.raises(ConfigError, match="dedicated scorer: placement.dedicated_tp=2: the scorer runs as a single "
                                          "process \\(tp=1\\); set placement.dedicated_tp=1"):
        plan_for(CFG_4B, ["recovery.name=dedicated", "placement.dedicated_tp=2"], nodes=3)
    # unset (0): one GPU, whatever the trainer's parallel.tp (Qwen3-4B trains with tp=2)
    plan = plan_for(CFG_4B, ["recovery.name=dedicated"], nodes=3)
    assert (plan.dedicated.host, plan.dedicated.tp, plan.dedicated.gpu_ids) == ("node03", 1, (0,))
    with pytest.raises(ConfigError, match="ep=2 needs an MoE model"):
        plan_for(CFG_4B, ["parallel.ep=2"], nodes=2)
    with pytest.raises(ConfigError, match="plan needs 2 nodes \\(trainer 1 \\+ engines 1\\), allocation has 1"):
        plan_for(CFG_TINY, ["placement.engine_nodes=1"])


def test_unused_and_idle_are_reported():
    plan = plan_for(CFG_30B, nodes=6)
    assert any("placement.dedicated_nodes=1 is not used" in n for n in plan.notes)
    assert any("2 node(s) of the allocation stay idle: node[05-06]" in n for n in plan.notes)
    plan = plan_for(CFG_30B, ["rollout.n_engines=3"], nodes=4)
    assert "node04: 4 of 8 GPUs idle" in plan.notes


def test_param_counts_of_the_real_models():
    import yaml

    total, active = param_counts(yaml.safe_load((ROOT / "configs/models/qwen3_4b.yaml").read_text()))
    assert total == active and round(total / 1e9, 2) == 4.02
    total, active = param_counts(yaml.safe_load((ROOT / "configs/models/qwen3_30b_a3b.yaml").read_text()))
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9  # model card: 30.5B, 3.3B activated


# -- roles, overlays, MPI bootstrap -----------------------------------------------------------------
def test_role_env_round_trip():
    plan = plan_for(CFG_30B, ["recovery.name=dedicated"], nodes=5)
    cmds = {c.name: c for c in render(plan, "torchrun", python="py")}
    env = dict(a.split("=", 1) for a in cmds["engine1"].argv if "=" in a and a.startswith(("MEGARL_", "CUDA_")))
    role = current_role(env)
    assert (role.role, role.engine_index, role.server_port, role.server_tp, role.weight_sync_rank) == \
        ("engine", 1, 8101, 4, 5)
    trainer_env = dict(a.split("=", 1) for a in cmds["trainer.node0"].argv if a.startswith("MEGARL_"))
    t = current_role(trainer_env)
    assert t.launched and len(t.engine_addrs) == 4 and t.dedicated_addr == "node05:8100"
    assert not current_role({}).launched
    with pytest.raises(ConfigError, match="MEGARL_ROLE='boss'"):
        current_role({"MEGARL_ROLE": "boss"})


def test_flatten_overlay():
    assert flatten({"recovery": {"name": "ewma", "ewma": {"beta": None, "tau": 0.5}},
                    "trainer": {"betas": [0.9, 0.99], "lr": 1e-6}, "data": {"path": "123"}}) == [
        "recovery.name=ewma", "recovery.ewma.beta=null", "recovery.ewma.tau=0.5",
        "trainer.betas=[0.9, 0.99]", "trainer.lr=1.0e-06", "data.path='123'"]


def test_mpi_bootstrap_env_handling():
    assert bootstrap_env_from_mpi({}) is None  # not under MPI
    env = {"OMPI_COMM_WORLD_SIZE": "2", "RANK": "0", "WORLD_SIZE": "2"}
    assert bootstrap_env_from_mpi(env) is None  # torchrun (or a second call) already set it
    assert under_mpi({"PMI_SIZE": "4"}) and not under_mpi({})
    values = _from_env_only({"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
                             "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                             "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert values == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                      "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}
    with pytest.raises(ConfigError, match="needs mpi4py"):
        _from_env_only({"OMPI_COMM_WORLD_SIZE": "4"})


def test_runner_lets_the_dedicated_scorer_finish_before_the_trainer():
    """The scorer exits 0 once the trainer tells it to stop; an engine that exits early fails the run."""
    import sys

    from megarl.launch.role_commands import RoleCommand
    from megarl.launch.runner import run_commands

    def cmd(name, role, code, server):
        return RoleCommand(name, role, "", (sys.executable, "-c", code), server)

    trainer = cmd("trainer", "trainer", "import time; time.sleep(1.0)", False)
    assert run_commands([cmd("dedicated", "dedicated", "pass", True), trainer], poll_s=0.05) == 0
    assert run_commands([cmd("dedicated", "dedicated", "raise SystemExit(3)", True), trainer], poll_s=0.05) == 3
    assert run_commands([cmd("engine0", "engine", "pass", True), trainer], poll_s=0.05) == 1


def test_runner_passes_sigterm_to_the_trainer_and_returns_its_exit_code(tmp_path):
    """SIGTERM to `megarl launch` reaches the trainer first (it checkpoints and exits with 75); the engine it
    needs until then is stopped after it, and the launch exits with the trainer's 75."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap
    import time

    log = tmp_path / "order.log"

    def on_term(name, code):
        return (f"import signal, sys, time\n"
                f"def bye(*_):\n    open({str(log)!r}, 'a').write('{name}\\n'); sys.exit({code})\n"
                f"signal.signal(signal.SIGTERM, bye)\nsignal.signal(signal.SIGUSR1, bye)\n"
                f"open({str(log)!r} + '.{name}', 'w').close()\n"
                f"time.sleep(60)\n")

    driver = textwrap.dedent(f"""
        import sys
        from megarl.launch.role_commands import RoleCommand
        from megarl.launch.runner import run_commands
        sys.exit(run_commands([RoleCommand("engine0", "engine", "", (sys.executable, "-c", {on_term("engine", 0)!r}),
                                           True),
                               RoleCommand("trainer", "trainer", "", (sys.executable, "-c", {on_term("trainer", 75)!r}),
                                           False)], poll_s=0.05))
    """)
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=ROOT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"order.log.{n}").exists() for n in ("engine", "trainer")):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 75
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert log.read_text().split() == ["trainer", "engine"]


def test_a_launched_engine_serves_on_its_node_address_not_on_every_address(monkeypatch):
    import socket

    import megarl.commands.train as train_cmd

    seen = {}

    async def fake_serve(checkpoint, backend, **kw):
        seen.update(kw)

    table = {"node01": "10.0.0.1", "node03": "10.0.0.3", "node04": "127.0.1.1"}
    monkeypatch.setattr(socket, "gethostbyname", lambda name: table.get(name, "10.0.0.9"))
    monkeypatch.setattr(train_cmd, "serve", fake_serve)
    cfg = load_run_config(CFG_TINY, ["rollout.backend=hf"])
    env = {"MEGARL_ROLE": "engine", "MEGARL_SERVER_PORT": "8000", "MEGARL_SERVER_HOST": "node03",
           "MEGARL_CONTROLLER_HOST": "node01"}
    train_cmd.serve_role(cfg, current_role(env))
    assert (seen["host"], seen["port"]) == ("10.0.0.3", 8000)
    # a node whose name resolves to a loopback address on itself could not be reached from the controller's
    # node: refused, naming the key that gives it an address (never every address)
    seen.clear()
    with pytest.raises(ConfigError, match="placement.server_addresses.node04="):
        train_cmd.serve_role(cfg, current_role({**env, "MEGARL_SERVER_HOST": "node04"}))
    assert seen == {}
    train_cmd.serve_role(cfg, current_role({**env, "MEGARL_SERVER_HOST": "10.0.0.4"}))  # the address it is given
    assert seen["host"] == "10.0.0.4"


def test_engines_with_own_commands_share_the_run_key_through_the_environment(monkeypatch):
    monkeypatch.delenv("MEGARL_ENGINE_KEY", raising=False)
    plan = plan_for(CFG_30B, nodes=4)
    engines = [e for e in plan.engines if not e.spawned]
    assert engines
    for launcher in ("torchrun", "slurm", "mpirun"):
        cmds = {c.name: c for c in render(plan, launcher, python="py")}
        assert not any("MEGARL_ENGINE_KEY=" in a for c in cmds.values() for a in c.argv), launcher
        if launcher == "slurm":  # the engines of a node share a step: their commands are in its script
            assert f"MEGARL_SERVER_HOST={engines[0].host}" in cmds[f"engines.{engines[0].host}"].argv[-1]
            continue
        assert _env_of(cmds["engine0"])["MEGARL_SERVER_HOST"] == engines[0].host, launcher
    mpi = {c.name: c for c in render(plan, "mpirun", python="py")}
    assert "-x MEGARL_ENGINE_KEY" in mpi["trainer"].shell() and "-x MEGARL_ENGINE_KEY" in mpi["engine0"].shell()
    env = {}
    ensure_run_keys(plan, "slurm", env)  # a fresh secret the commands inherit
    assert len(env["MEGARL_ENGINE_KEY"]) == 48
    other = {}
    ensure_run_keys(plan, "slurm", other)
    assert other["MEGARL_ENGINE_KEY"] != env["MEGARL_ENGINE_KEY"]
    mine = {"MEGARL_ENGINE_KEY": "exported"}
    ensure_run_keys(plan, "mpirun", mine)
    assert mine == {"MEGARL_ENGINE_KEY": "exported"}
    with pytest.raises(ConfigError, match="with torchrun every node runs its own `megarl launch`"):
        ensure_run_keys(plan, "torchrun", {})
    spawned = {}
    ensure_run_keys(plan_for(CFG_TINY), "torchrun", spawned)  # the trainer's own engines: a key of their own
    assert spawned == {}
