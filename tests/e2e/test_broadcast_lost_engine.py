"""Two vLLM CPU engines; one is lost (its whole process group killed) after the first bucket of a broadcast.

The survivor's interrupted reload must leave it able to load the disk copy of
the same version and serve it (its log-probs those of the new weights); the
supervisor restarts the lost engine from the disk copy, and the next publish
reaches both by broadcast. The sender ends as NCCL ends it (WatchdogBroadcaster).
tests/unit/test_broadcast_survivors.py gives the survivor NCCL's receive
semantics (on HF engines); here the group is gloo, as on every CPU run. The
vLLM engines' logs (a failed broadcast in a worker included) hold no group's
secret.
"""
import asyncio
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))

from broadcast_faults import KILL_ENV  # noqa: E402
from broadcast_group_kill import GroupKillBroadcaster  # noqa: E402
from test_publish import REQUEST, CheckpointExporter, engine_matches  # noqa: E402


def test_a_lost_vllm_engine_costs_only_itself(tmp_path, monkeypatch):
    import megarl.publish
    from megarl.models.tiny import write_tiny_checkpoint
    from megarl.publish import BroadcastPublisher
    from megarl.rollout.client import launch_engine_process
    from megarl.rollout.supervisor import EngineSupervisor

    model = REPO / "configs/models/tiny_qwen3.yaml"
    base, other = (write_tiny_checkpoint(model, tmp_path / name, seed=seed) for name, seed in (("v0", 0), ("v1", 1)))

    def launch(i: int):
        return launch_engine_process(str(base), "vllm", log_path=str(tmp_path / f"engine{i}.log"),
                                     startup_timeout_s=240)

    import megarl.rollout.weight_sync as weight_sync

    made, new_secret = [], weight_sync.new_secret
    monkeypatch.setattr(weight_sync, "new_secret", lambda: made.append(new_secret()) or made[-1])
    engines = [launch(0), launch(1)]
    monkeypatch.setenv(KILL_ENV, f"{engines[0][0].pid}:{tmp_path / 'killed'}")
    monkeypatch.setattr(megarl.publish, "WeightBroadcaster", GroupKillBroadcaster)

    async def main():
        sup = EngineSupervisor(engines, launch=launch, weights=(str(base), 0))
        await sup.start()
        weights_dir = tmp_path / "weights"
        pub = BroadcastPublisher(CheckpointExporter(Path(other)), sup, weights_dir, timeout_s=60)
        pub.bucket_bytes = 16 << 10  # several buckets for the tiny model, so the engine dies mid-stream
        try:
            await pub.prepare(1)
            t0 = time.perf_counter()
            first = await pub.apply(1)
            fallback_s = time.perf_counter() - t0
            assert (tmp_path / "killed").exists() and engines[0][0].poll() is not None
            assert first["weight_sync_fallbacks"] == 1 and first["weight_sync_bytes"] == 0
            assert sup.stats()["n_engine_failures"] == 1, "only the lost engine failed"
            survivor = await engines[1][1].generate(REQUEST)
            for _ in range(2400):  # the lost engine restarts from the disk copy (a vLLM start: ~20 s)
                if sup.n_restarts:
                    break
                await asyncio.sleep(0.1)
            assert sup.n_restarts == 1 and sup.weights == (str(weights_dir / "v1"), 1)
            pub.trainer = CheckpointExporter(Path(base))
            await pub.prepare(2)
            second = await pub.apply(2)
            assert second["weight_sync_bytes"] > 0 and second["weight_sync_groups"] == 2
            both = [await sup.generate(REQUEST) for _ in range(2)]
            return fallback_s, survivor, both
        finally:
            pub.close()
            await sup.close()

    fallback_s, survivor, both = asyncio.run(main())
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("engine*.log"))
    assert "left the weight broadcast" in logs or "Connection closed" in logs, "the survivor's failure is logged"
    assert len(made) == 2 and not [s for s in made if s in logs], "a group's secret reached an engine's log"
    print(f"\nvLLM engine lost mid-broadcast: the survivor on the disk copy after {fallback_s:.2f} s")
    assert fallback_s < 30, f"the survivor waited {fallback_s:.1f} s"
    assert set(survivor.versions) == {1} and engine_matches(Path(other), survivor) < 1e-4
    assert all(set(r.versions) == {2} and engine_matches(Path(base), r) < 1e-4 for r in both)
