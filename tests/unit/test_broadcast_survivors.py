"""An engine lost during a broadcast publish costs that engine alone, under NCCL's failure semantics.

Two engines: engine 0 a real HF engine process, killed after the first bucket
(broadcast_faults.WatchdogBroadcaster, whose sender then ends as NCCL ends
it); engine 1 an HF engine in this process whose group has NCCL's receive
semantics (nccl_receive_fake: it does not notice the sender's end, and would
wait out the communicator's timeout). The survivor must leave the broadcast
when the publisher calls it off, load the disk copy, and serve the version;
the killed engine restarts from the disk copy; the next publish reaches both
by broadcast. What only a GPU shows: NCCL's own abort of the communicator and
its watchdog's timing (tests/gpu/gpu_check.py runs the broadcast on NCCL).
"""
import asyncio
import time
from pathlib import Path

from nccl_receive_fake import NcclSemanticsReceiverFake
from test_publish import REPO, REQUEST, CheckpointExporter, engine_matches

STEP_TIMEOUT_S = 20.0


def test_survivor_leaves_a_publish_the_sender_lost_and_loads_the_disk_copy(tmp_path, monkeypatch, caplog, capfd):
    """The module doc's run; besides, no group's secret reaches a log (this process's, the sender's output,
    an engine's log file)."""
    from broadcast_faults import KILL_ENV, WatchdogBroadcaster

    import megarl.rollout.publish
    import megarl.rollout.weight_sync as weight_sync
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.rollout.client import launch_engine_process
    from megarl.rollout.hf_engine import HFEngine
    from megarl.rollout.publish import BroadcastPublisher
    from megarl.rollout.supervisor import EngineSupervisor

    model = REPO / "configs/models/tiny_qwen3.yaml"
    base, other = (write_tiny_checkpoint(model, tmp_path / name, seed=seed) for name, seed in (("v0", 0), ("v1", 1)))
    fakes = []
    make_group = weight_sync._make_group

    def nccl_like_receivers(host, port, rank, world_size, backend, timeout_s, *rest, **kw):
        pg, store, device = make_group(host, port, rank, world_size, backend, timeout_s, *rest, **kw)
        fakes.append(NcclSemanticsReceiverFake(pg, comm_timeout_s=timeout_s))  # only this process's ranks: receivers
        return fakes[-1], store, device

    monkeypatch.setattr(weight_sync, "_make_group", nccl_like_receivers)
    made, new_secret = [], weight_sync.new_secret
    monkeypatch.setattr(weight_sync, "new_secret", lambda: made.append(new_secret()) or made[-1])

    def launch(i: int):
        return launch_engine_process(str(base), "hf", log_path=str(tmp_path / f"engine{i}.log"))

    async def main():
        lost = launch(0)
        survivor = await HFEngine.create(str(base))
        monkeypatch.setenv(KILL_ENV, f"{lost[0].pid}:{tmp_path / 'killed'}")
        monkeypatch.setattr(megarl.rollout.publish, "WeightBroadcaster", WatchdogBroadcaster)
        sup = EngineSupervisor([lost, (None, survivor)], launch=launch, weights=(str(base), 0))
        await sup.start()
        weights_dir = tmp_path / "weights"
        pub = BroadcastPublisher(CheckpointExporter(Path(other)), sup, weights_dir, timeout_s=STEP_TIMEOUT_S)
        pub.bucket_bytes = 16 << 10  # several buckets for the tiny model, so the engine dies mid-stream
        try:
            await pub.prepare(1)
            t0 = time.perf_counter()
            first = await pub.apply(1)
            fallback_s = time.perf_counter() - t0
            assert (tmp_path / "killed").exists() and lost[0].poll() is not None
            assert fakes[0].n_lost >= 1, "the survivor's collective really lost its sender"
            assert {k: v for k, v in first.items() if k.startswith("weight_sync")} == \
                {"weight_sync_bytes": 0, "weight_sync_groups": 1, "weight_sync_fallbacks": 1}
            assert await survivor.version() == 1, "the survivor loaded the disk copy"
            assert sup.stats()["n_engine_failures"] == 1, "only the killed engine failed"
            res1 = await survivor.generate(REQUEST)
            for _ in range(600):  # the killed engine restarts from the disk copy
                if sup.n_restarts:
                    break
                await asyncio.sleep(0.1)
            assert sup.n_restarts == 1 and sup.weights == (str(weights_dir / "v1"), 1)
            pub.trainer = CheckpointExporter(Path(base))
            await pub.prepare(2)
            second = await pub.apply(2)
            assert second["weight_sync_bytes"] > 0 and second["weight_sync_groups"] == 2
            res2 = [await sup.generate(REQUEST) for _ in range(2)]
            return fallback_s, res1, res2
        finally:
            pub.close()
            await sup.close()

    caplog.set_level("DEBUG")
    fallback_s, res1, res2 = asyncio.run(main())
    out, err = capfd.readouterr()
    logs = caplog.text + out + err + "".join(p.read_text() for p in tmp_path.glob("engine*.log"))
    assert len(made) == 2 and not [s for s in made if s in logs], "a group's secret was printed"
    print(f"\nlost engine, NCCL receive semantics: the survivor on the disk copy after {fallback_s:.2f} s")
    assert fallback_s < STEP_TIMEOUT_S / 2, f"the survivor waited for the communicator's timeout ({fallback_s:.1f} s)"
    assert set(res1.versions) == {1} and engine_matches(Path(other), res1) < 1e-4
    assert all(set(r.versions) == {2} and engine_matches(Path(base), r) < 1e-4 for r in res2)
