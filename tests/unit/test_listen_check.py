"""Listeners other nodes reach: a trainer node whose name resolves to loopback is refused before anything starts,
naming the key that fixes it (megarl/launch/listen_check.py)."""
import socket

import pytest
from test_placement import CFG_TINY, plan_for

from megarl.errors import ConfigError
from megarl.launch import listen_check
from megarl.launch.listen_check import check_world_address, loopback_listener_problem, master_host_problem

THREE = ["placement.trainer_nodes=2", "placement.engine_nodes=1", "placement.trainer_ranks=2",
         "rollout.weight_sync=broadcast"]
ONE_TRAINER_NODE = ["placement.engine_nodes=1", "rollout.weight_sync=broadcast"]


def _resolve_from(monkeypatch, table: dict[str, str]):
    """This node's name resolution as ``table`` says (an unknown name fails as socket's does); the resolver."""
    def resolve(name):
        if name not in table:
            raise socket.gaierror(f"unknown host {name}")
        return table[name]

    monkeypatch.setattr(listen_check.socket, "gethostbyname", resolve)
    return resolve


@pytest.fixture
def trap(monkeypatch):
    """node01's /etc/hosts maps its own name to 127.0.1.1 (the Ubuntu default); the others resolve normally."""
    table = {"node01": "127.0.1.1", "node02": "10.9.0.2", "node03": "10.9.0.3"}
    _resolve_from(monkeypatch, table)
    monkeypatch.setattr(listen_check, "_route_address", lambda peer: "10.9.0.1")
    return table


def test_trainer_nodes_need_master_addr(trap):
    plan = plan_for(CFG_TINY, THREE, nodes=3, gpus=0)
    problem = loopback_listener_problem(plan, hostname="node01")
    assert "'node01' resolves to a loopback address" in problem
    assert "set placement.master_addr=10.9.0.1" in problem
    assert loopback_listener_problem(plan, hostname="node02") is None  # resolved where the name is the node's own
    fixed = plan_for(CFG_TINY, [*THREE, "placement.master_addr=10.9.0.1"], nodes=3, gpus=0)
    assert loopback_listener_problem(fixed, hostname="node01") is None


def test_engines_elsewhere_need_weight_sync_bind(trap):
    plan = plan_for(CFG_TINY, ONE_TRAINER_NODE, nodes=2, gpus=0)
    assert "set placement.weight_sync_bind=10.9.0.1" in loopback_listener_problem(plan, hostname="node01")
    assert loopback_listener_problem(plan, "10.9.0.1", hostname="node01") is None
    disk = plan_for(CFG_TINY, ["placement.engine_nodes=1", "rollout.weight_sync=disk"], nodes=2, gpus=0)
    assert loopback_listener_problem(disk, hostname="node01") is None  # the trainer listens for nobody


def test_one_node_and_a_cluster_address_pass(trap):
    assert loopback_listener_problem(plan_for(CFG_TINY, [], nodes=1, gpus=0), hostname="node01") is None
    trap["node01"] = "10.9.0.1"
    plan = plan_for(CFG_TINY, THREE, nodes=3, gpus=0)
    assert loopback_listener_problem(plan, hostname="node01") is None


def test_route_address_is_never_loopback():
    assert listen_check._route_address("127.0.0.1") == ""
    assert listen_check._route_address("no-such-host.invalid") == ""


def test_world_store_refuses_a_loopback_address_across_nodes():
    with pytest.raises(ConfigError, match="spans 2 nodes.*127.0.1.1.*placement.master_addr"):
        check_world_address("127.0.1.1", "node01", world_size=4, local_world_size=2)
    check_world_address("127.0.0.1", "localhost", world_size=2, local_world_size=2)  # one node: loopback is fine
    check_world_address("10.9.0.1", "node01", world_size=4, local_world_size=2)


def test_world_store_checks_before_its_rendezvous(monkeypatch):
    """Rank 0 of a two-node world whose MASTER_ADDR is loopback here stops at once, not after the store's timeout."""
    from megarl.trainer import world_store

    monkeypatch.setenv("MEGARL_WORLD_KEY", "k")
    monkeypatch.setenv("MASTER_ADDR", "127.0.1.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(ConfigError, match="placement.master_addr"):
        world_store.authenticated_store(0, 2, timeout_s=5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- engines and the dedicated scorer with commands of their own --------------------------------------------------
ENGINE_NODE = ["placement.engine_nodes=1", "rollout.weight_sync=disk"]
SCORER_NODE = ["recovery.name=dedicated", "placement.dedicated_nodes=1", "rollout.weight_sync=disk"]


@pytest.fixture
def server_trap(monkeypatch):
    """node02's /etc/hosts maps its own name to 127.0.1.1; node02's route to the others leaves from 10.9.0.2."""
    table = {"node01": "10.9.0.1", "node02": "127.0.1.1", "node03": "10.9.0.3", "localhost": "127.0.0.1"}
    resolve = _resolve_from(monkeypatch, table)

    def route(peer, port=9):
        return "127.0.0.1" if resolve(peer).startswith("127.") else "10.9.0.2"

    monkeypatch.setattr(listen_check, "route_address", route)
    return table


def test_an_engine_node_named_loopback_needs_server_addresses(server_trap):
    plan = plan_for(CFG_TINY, ENGINE_NODE, nodes=2, gpus=0)
    problem = loopback_listener_problem(plan, hostname="node02")
    assert "'node02' resolves to a loopback address on this node" in problem
    assert "set placement.server_addresses.node02=10.9.0.2 (where the engines" in problem
    assert loopback_listener_problem(plan, hostname="node01") is None  # node01 resolves its own name to itself


def test_server_addresses_is_what_the_engine_binds_and_the_trainer_reaches(server_trap):
    plan = plan_for(CFG_TINY, [*ENGINE_NODE, "placement.server_addresses.node02=10.9.0.2"], nodes=2, gpus=0)
    assert loopback_listener_problem(plan, hostname="node02") is None
    (engine,) = plan.engines
    assert (engine.host, engine.addr) == ("node02", "10.9.0.2:8100")
    trainer, server = plan.commands("torchrun")
    assert "MEGARL_ENGINE_ADDRS=10.9.0.2:8100" in trainer.argv
    assert "MEGARL_SERVER_HOST=10.9.0.2" in server.argv and "MEGARL_CONTROLLER_HOST=node01" in server.argv
    assert server.host == "node02"  # still run on its node
    with pytest.raises(ConfigError, match="names node05, which runs no engine.*those run on node02"):
        plan_for(CFG_TINY, [*ENGINE_NODE, "placement.server_addresses.node05=10.9.0.5"], nodes=2, gpus=0)


def test_a_dedicated_scorer_node_named_loopback_is_refused_too(server_trap):
    plan = plan_for(CFG_TINY, SCORER_NODE, nodes=2, gpus=0)
    assert plan.dedicated.host == "node02" and not plan.dedicated.spawned
    assert "set placement.server_addresses.node02=10.9.0.2" in loopback_listener_problem(plan, hostname="node02")


def test_servers_beside_the_controller_may_listen_on_loopback(server_trap):
    """One node (the trap on the controller's own node): the servers' only peer is on the node, loopback is fine."""
    server_trap["node01"] = "127.0.1.1"
    one = ["recovery.name=dedicated", "placement.dedicated_command=true"]
    plan = plan_for(CFG_TINY, one, nodes=1, gpus=0)
    assert plan.dedicated.host == "node01" and not plan.dedicated.spawned
    assert loopback_listener_problem(plan, hostname="node01") is None
    assert listen_check.server_listen_address("node01", "node01") == "127.0.1.1"


def test_a_role_started_any_other_way_refuses_too(server_trap, caplog):
    from megarl.commands.train import engine_host
    from megarl.launch.roles import current_role

    role = current_role({"MEGARL_ROLE": "engine", "MEGARL_SERVER_HOST": "node02", "MEGARL_CONTROLLER_HOST": "node01"})
    with pytest.raises(ConfigError, match="set placement.server_addresses.node02=10.9.0.2"):
        engine_host(role)
    assert engine_host(current_role({"MEGARL_SERVER_HOST": "10.9.0.2", "MEGARL_CONTROLLER_HOST": "node01"})) == \
        "10.9.0.2"
    assert listen_check.server_listen_address("node03", "node01") == "10.9.0.3"
    assert listen_check.server_listen_address("localhost", "node01") == "127.0.0.1"  # asked for: one node
    with caplog.at_level("WARNING", logger="megarl.listen_check"):  # no controller named: bound, with a warning
        assert listen_check.server_listen_address("node02", "") == "127.0.1.1"
    assert "placement.server_addresses.node02" in caplog.text


def test_gloo_follows_the_engine_where_its_node_name_is_loopback(server_trap, monkeypatch):
    """The weight broadcast's gloo transport listens where the node's name resolves unless GLOO_SOCKET_IFNAME
    says otherwise: on a trap node it is told the interface of the address the engine binds."""
    assert listen_check._interface_of("127.0.0.1") == "lo"  # the real lookup, on this machine
    assert listen_check._interface_of("192.0.2.99") == ""  # TEST-NET-1: no interface holds it
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.setattr(listen_check, "_interface_of", {"10.9.0.2": "eth0"}.get)
    assert listen_check.gloo_interface_env("10.9.0.2", hostname="node02") == {"GLOO_SOCKET_IFNAME": "eth0"}
    assert listen_check.gloo_interface_env("10.9.0.3", hostname="node03") == {}  # its name is its address
    assert listen_check.gloo_interface_env("127.0.1.1", hostname="node02") == {}  # one node: loopback is right
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert listen_check.gloo_interface_env("10.9.0.2", hostname="node02") == {}  # the user's choice stays


# -- trainer rank 0 on the host placement.master_addr names ---------------------------------------------------------
def test_master_addr_must_be_trainer_rank_0s_node(monkeypatch):
    """node02 holds 10.9.0.2 (it can bind it), node01 does not: master_addr=10.9.0.2 puts the rendezvous where
    torchrun's node-rank 0 (node01) does not serve it; both trainer nodes say so before anything starts."""
    holds = {"node01": {"node01": True, "10.9.0.2": False}, "node02": {"node01": False, "10.9.0.2": True}}
    here = {"node": "node01"}
    monkeypatch.setattr(listen_check, "_holds", lambda name: holds[here["node"]].get(name))
    wrong = plan_for(CFG_TINY, [*THREE, "placement.master_addr=10.9.0.2"], nodes=3, gpus=0)
    problem = master_host_problem(wrong, hostname="node01")
    assert "placement.master_addr=10.9.0.2 is not an address of this node (node01)" in problem
    assert "set placement.master_addr to an address of node01, or leave it empty" in problem
    here["node"] = "node02"
    problem = master_host_problem(wrong, hostname="node02")
    assert "is an address of this node (node02), but trainer rank 0 runs on the plan's first trainer node, " \
           "node01" in problem
    assert master_host_problem(wrong, hostname="node03") is None  # the engine's node has no trainer rank
    right = plan_for(CFG_TINY, THREE, nodes=3, gpus=0)
    assert master_host_problem(right, hostname="node02") is None
    here["node"] = "node01"
    assert master_host_problem(right, hostname="node01") is None
    assert master_host_problem(plan_for(CFG_TINY, [], nodes=1, gpus=0), hostname="node01") is None  # one node
    unknown = plan_for(CFG_TINY, [*THREE, "placement.master_addr=node09"], nodes=3, gpus=0)
    assert master_host_problem(unknown, hostname="node01") is None  # does not resolve: torchrun says so


def test_holds_is_a_real_bind():
    assert listen_check._holds("127.0.0.1") is True
    assert listen_check._holds("192.0.2.99") is False  # TEST-NET-1: no interface of this machine holds it
    assert listen_check._holds("no-such-host.invalid") is None
