"""The weight broadcast's rendezvous: a stranger writes nothing the group reads, and it listens where it must.

The group's ranks post their gloo addresses in the rendezvous store. A
stranger who could write there first would point rank 0 at an address of his
(he then receives the weights) or at nothing (the publish fails). Each test
plays the stranger with torch's own ``TCPStore`` client (what the rendezvous
was before) and writes the key rank 1's address lives under, at the
guessable prefix the old store used; the legitimate publish must still reach
the engine, intact.
"""
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from megarl.rollout.client import free_port
from megarl.rollout.weight_sync import WeightBroadcaster, join_weight_group, receive_named_tensors

TENSORS = [("a", torch.arange(12, dtype=torch.float32).reshape(3, 4)), ("b", torch.ones(5, dtype=torch.int64))]


def _stranger_writes(host: str, port: int) -> str:
    """A client without the group's secret tries to write rank 1's gloo address key; what happened."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5), wait_for_workers=False)
        store.set(f"tcp://{host}:{port}/0/1", b"bogus rank 1 address")
        if store.get(f"tcp://{host}:{port}/0/1") != b"bogus rank 1 address":
            return "not kept"
    except Exception as e:  # noqa: BLE001 - refused: what a stranger should get
        return f"refused: {type(e).__name__}"
    return "written"


def _receive(info: dict, out: dict) -> None:
    try:
        group, _store, device = join_weight_group(info)
        out["tensors"] = {name: t.clone() for name, t in receive_named_tensors(group, device)}
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["error"] = e


def test_a_stranger_without_the_secret_writes_nothing_the_group_reads():
    host, port = "127.0.0.1", free_port()
    sender = WeightBroadcaster(host, port, world_size=2, backend="gloo", timeout_s=15)
    box = {}

    def trainer():
        try:
            box["stats"] = sender.broadcast(iter(TENSORS))
        except Exception as e:  # noqa: BLE001 - reported to the test
            box["error"] = e

    th = threading.Thread(target=trainer)
    th.start()  # rank 0 serves the rendezvous and waits for rank 1's address
    try:
        stranger = _stranger_writes(host, port)
        out = {}
        _receive(sender.group_info(rank=1), out)
        th.join(timeout=60)
        assert stranger.startswith("refused"), f"a client without the secret wrote into the rendezvous ({stranger})"
        assert "error" not in box and "error" not in out, (box, out)
        assert out["tensors"].keys() == {"a", "b"} and all(torch.equal(out["tensors"][n], t) for n, t in TENSORS)
        assert sender.rendezvous.n_refused >= 1, "the server counted the stranger's connections as refused"
    finally:
        sender.close()


def test_a_client_with_another_secret_cannot_join_and_no_server_without_the_secret_fools_an_engine():
    from megarl.errors import EngineError
    from megarl.rollout.rendezvous import RendezvousServer, RendezvousStore, new_secret

    secret = new_secret()
    server = RendezvousServer("127.0.0.1", 0, secret)
    try:
        with pytest.raises(EngineError, match="refused this process's secret"):
            RendezvousStore("127.0.0.1", server.port, new_secret(), timeout_s=5).set("0/1", b"x")
        member = RendezvousStore("127.0.0.1", server.port, secret, timeout_s=5)
        member.set("0/1", b"rank 1")
        assert member.get("0/1") == b"rank 1" and server.n_refused == 1
        assert server.store.num_keys() == 1, "only the member's key is in the store"
        # an engine handed a group whose server holds another secret refuses to rendezvous there
        impostor = RendezvousServer("127.0.0.1", 0, new_secret())
        with pytest.raises(EngineError, match="refused this process's secret|not this group's"):
            RendezvousStore("127.0.0.1", impostor.port, secret, timeout_s=5)
        impostor.close()
        member.close()
    finally:
        server.close()


def test_the_rendezvous_listens_on_the_address_engines_reach_not_every_interface():
    """Served for 127.0.0.2 (a loopback address of its own), the rendezvous is not reachable at 127.0.0.1."""
    import socket

    port = free_port()
    sender = WeightBroadcaster("127.0.0.2", port, world_size=2, backend="gloo", timeout_s=5)
    sender.start_rendezvous()  # what the first publish starts before it creates the group
    try:
        reach = {}
        for host in ("127.0.0.2", "127.0.0.1"):
            try:
                socket.create_connection((host, port), timeout=1).close()
                reach[host] = True
            except ConnectionRefusedError:
                reach[host] = False
        assert reach == {"127.0.0.2": True, "127.0.0.1": False}, reach
    finally:
        sender.close()


def _try(fn) -> None:
    try:
        fn()
    except Exception:  # noqa: BLE001 - no engine joins: the connect times out, the test is elsewhere
        pass


def test_every_interface_only_when_asked(tmp_path, monkeypatch):
    """placement.weight_sync_bind=0.0.0.0 reaches the publisher's rendezvous, which then listens everywhere."""
    import socket

    from megarl.builder import load_run_config
    from megarl.rollout.publish import make_publisher
    from megarl.rollout.rendezvous import RendezvousServer, new_secret

    for key in ("MEGARL_WEIGHT_SYNC_ADDR", "MEGARL_ENGINE_ADDRS"):
        monkeypatch.delenv(key, raising=False)
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
    cfg = load_run_config(tiny, ["rollout.weight_sync=broadcast"])
    assert make_publisher(cfg, None, None, tmp_path).bind_host is None
    cfg = load_run_config(tiny, ["rollout.weight_sync=broadcast", "placement.weight_sync_bind=0.0.0.0"])
    assert make_publisher(cfg, None, None, tmp_path).bind_host == "0.0.0.0"
    server = RendezvousServer("127.0.0.2", 0, new_secret(), bind_host="0.0.0.0")
    try:
        for addr in ("127.0.0.2", "127.0.0.1"):
            socket.create_connection((addr, server.port), timeout=1).close()
    finally:
        server.close()


def test_a_failed_rendezvous_says_whether_it_was_unreachable_or_refused_the_secret_and_what_to_set(caplog):
    """Read from a real failure: two trainer nodes launched with different MEGARL_WORLD_KEYs. The client's error
    tells a port nobody listens on from a handshake the server closed, and names the setting for each store; the
    server says once per address that it refused a connection, so the node that waits for its peers is told too."""
    from megarl.errors import EngineError
    from megarl.rollout.rendezvous import WEIGHT_SYNC, RendezvousServer, RendezvousStore, new_secret
    from megarl.trainer.world_store import LABEL as WORLD

    server = RendezvousServer("127.0.0.1", 0, new_secret(), label=WORLD)
    try:
        with caplog.at_level("WARNING", logger="megarl.rollout.publish"):
            for _ in range(2):
                with pytest.raises(EngineError) as refused:
                    RendezvousStore("127.0.0.1", server.port, new_secret(), timeout_s=5, label=WORLD)
        text = str(refused.value)
        assert f"trainer world store 127.0.0.1:{server.port} refused this process's secret" in text
        assert "unreachable" not in text and "MEGARL_WORLD_KEY differs between the nodes" in text
        warned = [r.getMessage() for r in caplog.records if "refused a connection from 127.0.0.1" in r.getMessage()]
        assert len(warned) == 1 and "MEGARL_WORLD_KEY" in warned[0], caplog.text
    finally:
        server.close()
    port = free_port()
    for label, says in ((WEIGHT_SYNC, "placement.weight_sync_bind"), (WORLD, "reaches MASTER_ADDR from")):
        with pytest.raises(EngineError) as unreachable:
            RendezvousStore("127.0.0.1", port, new_secret(), timeout_s=0.3, label=label)
        text = str(unreachable.value)
        assert f"{label} 127.0.0.1:{port} unreachable (ConnectionRefusedError" in text and says in text, text
        assert "secret" not in text
