"""Listeners other nodes reach: a trainer node whose name resolves to loopback is refused before anything starts,
naming the key that fixes it (megarl/launch/listen_check.py)."""
import socket

import pytest
from test_placement import CFG_TINY, plan_for

from megarl.errors import ConfigError
from megarl.launch import listen_check
from megarl.launch.listen_check import check_world_address, loopback_listener_problem

THREE = ["placement.trainer_nodes=2", "placement.engine_nodes=1", "placement.trainer_ranks=2",
         "rollout.weight_sync=broadcast"]
ONE_TRAINER_NODE = ["placement.engine_nodes=1", "rollout.weight_sync=broadcast"]


@pytest.fixture
def trap(monkeypatch):
    """node01's /etc/hosts maps its own name to 127.0.1.1 (the Ubuntu default); the others resolve normally."""
    table = {"node01": "127.0.1.1", "node02": "10.9.0.2", "node03": "10.9.0.3"}
    monkeypatch.setattr(listen_check.socket, "gethostbyname", lambda name: table[name])
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
