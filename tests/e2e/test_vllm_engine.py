"""The real `megarl engine` (vLLM CPU) over HTTP against HF teacher-forced log-probs, fp32.

One engine process per class (dense; dense with two tensor-parallel workers; MoE with two), shared by the
tests of its class: a vLLM engine costs ~20-35 s and ~3 GB to start. Measurements (start
time, tokens/s, update times) are printed with a ``MEASURE`` prefix (-s).
These engines and `megarl generate` start without VLLM_CPU_KVCACHE_SPACE and
OMP_NUM_THREADS, as in a new user's shell: the flags' defaults must do.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import ENGINE_VARS
from safetensors.torch import load_file

from megarl.errors import EngineError, InputError
from megarl.models.tiny import write_tiny_checkpoint
from megarl.rollout.base import UPDATE_PHASES
from megarl.rollout.client import EngineClient, free_port, launch_engine_process, stop_engine_process
from megarl.rollout.engine_shards import vllm_tp_rule
from megarl.rollout.interrupt import continuation_request, generate_resumable
from megarl.rollout.router import EngineRouter
from megarl.rollout.weight_spec import tensor_specs
from megarl.rollout.weight_sync import WeightBroadcaster
from megarl.types import GenerateRequest, SamplingParams

REPO = Path(__file__).resolve().parents[2]
ENV = {"OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
PROMPT = [1, 5, 6, 7]
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_engine")
    dense, moe = REPO / "configs/models/tiny_qwen3.yaml", REPO / "configs/models/tiny_qwen3_moe.yaml"
    return {name: str(write_tiny_checkpoint(yaml, root / name, seed=seed))
            for name, yaml, seed in [("dense0", dense, 0), ("dense1", dense, 1), ("moe0", moe, 0), ("moe1", moe, 1)]}


_PROCS: dict[str, subprocess.Popen] = {}  # url -> the engine process serving it
_KEYS: dict[str, str] = {}  # url -> that engine's key (every request carries it)


def _serve(ckpt: str, extra_args: tuple = ()):
    t0 = time.perf_counter()
    proc, client = launch_engine_process(ckpt, "vllm", env=dict.fromkeys(ENGINE_VARS), startup_timeout_s=240,
                                         extra_args=extra_args)
    print(f"\nMEASURE engine start (process up to /health ok): {time.perf_counter() - t0:.1f} s")
    _PROCS[client.url] = proc
    _KEYS[client.url] = client.key
    return proc, client.url


def _group_read(pgid: int, read) -> list:
    """``read(/proc/<pid> directory)`` of each process in process group ``pgid`` (an engine and vLLM's processes)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            out.append(read(stat.parent))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def _group_environments(pgid: int) -> list[dict[str, str]]:
    def environ(proc: Path) -> dict[str, str]:
        raw = (proc / "environ").read_bytes()
        return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
    return _group_read(pgid, environ)


def _group_cpus(pgid: int) -> list[set[int]]:
    """The cores each thread of each process in group ``pgid`` may run on."""
    def cpus(proc: Path) -> list[set[int]]:
        return [os.sched_getaffinity(int(t.name)) for t in (proc / "task").iterdir()]
    return [c for per_proc in _group_read(pgid, cpus) for c in per_proc]


# -- helpers -------------------------------------------------------------------------------------
_MODELS: dict[str, torch.nn.Module] = {}


def teacher_logps(ckpt: str, prompt: list[int], output: list[int], temperature: float = 1.0) -> list[float]:
    """HF log-probs of each output token given prompt + the outputs before it."""
    import transformers

    if ckpt not in _MODELS:
        _MODELS[ckpt] = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = _MODELS[ckpt](torch.tensor([prompt + output])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1: len(prompt) - 1 + len(output)] / temperature, -1)
    return lp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def maxdiff(a, b) -> float:
    assert len(a) == len(b) and a
    return max(abs(x - y) for x, y in zip(a, b))


def request(rid, prompt=PROMPT, **sampling) -> GenerateRequest:
    sampling.setdefault("seed", 0)
    sampling.setdefault("max_new_tokens", 64)
    return GenerateRequest(rid, list(prompt), SamplingParams(**sampling))


def with_client(url, fn):
    async def go():
        client = EngineClient(url, key=_KEYS.get(url))
        try:
            return await fn(client)
        finally:
            await client.close()
    return asyncio.run(go())


async def update_by_broadcast(client, ckpt: str, version: int, shards: int = 1, rule=None) -> tuple[float, dict]:
    """Trainer side in a thread (rank 0 of a fresh group), the engine joining through the router; ``shards``
    > 1: each worker receives its slices only, cut by ``rule`` (default: megarl's rule for the checkpoint)."""
    named = list(load_file(Path(ckpt) / "model.safetensors").items())
    router = EngineRouter([client])
    _, world = await router.broadcast_layout()  # 1 + the engine's workers
    sender = WeightBroadcaster("127.0.0.1", free_port(), world_size=world, timeout_s=120, shards=shards)
    if shards > 1 and rule is None:
        rule = vllm_tp_rule(json.loads((Path(ckpt) / "config.json").read_text()), shards)
    box: dict = {}

    def trainer():
        box["stats"] = sender.broadcast(iter(named), bucket_bytes=1 << 16, rule=rule)  # several buckets
        sender.close()
    th = threading.Thread(target=trainer, daemon=True)
    th.start()
    t0 = time.perf_counter()
    try:
        # the router assigns rank 1 to its only engine (its workers 1..world-1), as for a fleet
        await router.update_weights_from_broadcast(sender.group_info(), tensor_specs(named), version)
    finally:
        th.join(timeout=120)
    return time.perf_counter() - t0, box


async def wait_in_flight(client, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await client.health())["in_flight"] < n and time.monotonic() < deadline:
        await asyncio.sleep(0.01)


# -- dense ---------------------------------------------------------------------------------------
#: the dense engine runs pinned to one core (placement.cpu_affinity.engines, `megarl engine --cpu-cores`)
ENGINE_CORE = max(os.sched_getaffinity(0))


@pytest.fixture(scope="class")
def dense_url(ckpts):
    proc, url = _serve(ckpts["dense0"], extra_args=("--cpu-cores", str(ENGINE_CORE)))
    yield url
    stop_engine_process(proc)


class TestDense:
    @pytest.fixture
    def url(self, dense_url):
        return dense_url

    def test_logp_behav_matches_hf_teacher_forced(self, url, ckpts):
        async def go(c):
            await c.update_weights_from_disk(ckpts["dense0"], 0)
            reqs = [request(f"a{i}", seed=i) for i in range(8)]
            await asyncio.gather(*(c.generate(r) for r in reqs))  # warm-up
            t0 = time.perf_counter()
            res = await asyncio.gather(*(c.generate(r) for r in reqs))
            dt = time.perf_counter() - t0
            t07 = await c.generate(request("t07", temperature=0.7))
            stopped = await c.generate(request("stop", stop_token_ids=list(range(18))))
            return res, dt, t07, stopped
        res, dt, t07, stopped = with_client(url, go)
        assert stopped.finish_reason == "stop" and len(stopped.output_ids) == 1  # stop token kept, as in hf
        n = sum(len(r.output_ids) for r in res)
        print(f"\nMEASURE dense 8 x 64 tokens over HTTP: {dt:.2f} s, {n / dt:.0f} tokens/s")
        assert n == 8 * 64 and all(r.finish_reason == "length" and set(r.versions) == {0} for r in res)
        for r in res:
            assert maxdiff(r.logp_behav, teacher_logps(ckpts["dense0"], PROMPT, r.output_ids)) <= TOL
        assert maxdiff(t07.logp_behav, teacher_logps(ckpts["dense0"], PROMPT, t07.output_ids, 0.7)) <= TOL

    def test_stops_at_each_eos_of_the_generation_config(self, url, ckpts):
        # the stop ids a run uses: the tokenizer's EOS and both eos_token_id of generation_config.json
        from megarl.config.schema import DataConfig, ModelConfig, RolloutConfig
        from megarl.tokenizer import RunTokenizer

        tok = RunTokenizer.load(ModelConfig(checkpoint=ckpts["dense0"]), RolloutConfig(), DataConfig())
        gen_eos = json.loads((Path(ckpts["dense0"]) / "generation_config.json").read_text())["eos_token_id"]
        assert tok.stop_token_ids == sorted(gen_eos) and len(gen_eos) == 2
        prompt = tok.encode_rendered([tok.render("123")])[0]

        async def go(c):
            await c.update_weights_from_disk(ckpts["dense0"], 0)
            reqs = [request(f"eos{i}", prompt, seed=i, max_new_tokens=40, stop_token_ids=tok.stop_token_ids)
                    for i in range(48)]
            return await asyncio.gather(*(c.generate(r) for r in reqs))
        res = with_client(url, go)
        stopped = [r for r in res if r.finish_reason == "stop"]
        # the stop token is the last response token (kept, and trained on), and nothing after or before it
        assert all(r.output_ids[-1] in gen_eos and not set(r.output_ids[:-1]) & set(gen_eos) for r in stopped)
        assert all(not set(r.output_ids) & set(gen_eos) for r in res if r.finish_reason == "length")
        assert {r.output_ids[-1] for r in stopped} == set(gen_eos)  # each of the two ends some response

    def test_many_seeded_long_prompts_in_one_step(self, url, ckpts):
        # more prompt tokens than one scheduler step takes: a split prefill of a seeded request made vLLM's
        # CPU worker rewind a CPU generator's offset, which it cannot ("CPU Generator does not use offset"),
        # and the engine died
        async def go(c):
            await c.update_weights_from_disk(ckpts["dense0"], 0)
            reqs = [request(f"long{i}", [1 + i % 15] * 100, seed=i, max_new_tokens=4) for i in range(48)]
            return await asyncio.gather(*(c.generate(r) for r in reqs))
        res = with_client(url, go)
        assert len(res) == 48 and all(len(r.output_ids) == 4 for r in res)

    def test_started_without_the_variables_it_takes_the_flag_defaults(self, url):
        health = with_client(url, lambda c: c.health())
        assert (health["kv_cache_gb"], health["cpu_threads"]) == (1, 1)  # rollout.kv_cache_gb, rollout.cpu_threads
        if not Path("/proc/self/environ").is_file():
            pytest.skip("no /proc: the variables vLLM's processes got cannot be read")
        # vLLM's engine-core and worker processes got them; the server itself has them not
        envs = _group_environments(_PROCS[url].pid)
        vllm_side = [e for e in envs if "VLLM_CPU_KVCACHE_SPACE" in e]
        assert len(envs) >= 3 and vllm_side, envs
        assert all(e["VLLM_CPU_KVCACHE_SPACE"] == "1" and e.get("OMP_NUM_THREADS") == "1" for e in vllm_side)

    def test_engine_and_vllm_processes_run_on_its_cores(self, url):
        # the server pinned itself before vLLM started its engine-core and worker processes: they inherit it
        cpus = _group_cpus(_PROCS[url].pid)
        assert len(cpus) >= 3 and all(c == {ENGINE_CORE} for c in cpus), cpus
        envs = [e for e in _group_environments(_PROCS[url].pid) if "VLLM_CPU_KVCACHE_SPACE" in e]
        assert envs and all(e["VLLM_CPU_OMP_THREADS_BIND"] == str(ENGINE_CORE) for e in envs)  # its OpenMP threads too

    def test_update_from_disk_and_broadcast(self, url, ckpts):
        async def go(c):
            t0 = time.perf_counter()
            phases = await c.update_weights_from_disk(ckpts["dense1"], 11)
            disk_s = time.perf_counter() - t0
            on_disk = (await c.generate(request("d")), await c.version())
            bcast_s, box = await update_by_broadcast(c, ckpts["dense0"], 12)
            by_bcast = (await c.generate(request("b")), await c.version())
            return disk_s, phases, on_disk, bcast_s, box, by_bcast
        disk_s, phases, (r1, v1), bcast_s, box, (r2, v2) = with_client(url, go)
        print(f"\nMEASURE dense weight update over HTTP: disk {disk_s * 1e3:.0f} ms, "
              f"broadcast {bcast_s * 1e3:.0f} ms ({box['stats']['bytes'] / 1e6:.2f} MB); "
              f"engine phases (ms): {', '.join(f'{k} {1e3 * v:.1f}' for k, v in phases.items())}")
        # nothing was in flight: no abort, no pause (vLLM's pause alone sleeps 20 ms); the reload is timed
        assert set(phases) == {f"engine_{p}_s" for p in UPDATE_PHASES}
        assert phases["engine_abort_s"] == phases["engine_pause_s"] == 0 < phases["engine_reload_s"] <= disk_s
        assert v1 == 11 and set(r1.versions) == {11}
        # guards the tied lm_head re-pack after reload (without it: ~1 nat off)
        assert maxdiff(r1.logp_behav, teacher_logps(ckpts["dense1"], PROMPT, r1.output_ids)) <= TOL
        assert v2 == 12 and set(r2.versions) == {12}
        assert maxdiff(r2.logp_behav, teacher_logps(ckpts["dense0"], PROMPT, r2.output_ids)) <= TOL

    def test_abort_update_resume_tags_each_segment_with_its_version(self, url, ckpts):
        n_new = 128 - len(PROMPT) - 1
        weights = {20: ckpts["dense0"], 21: ckpts["dense1"]}

        def check_segments(ids, logps, versions):
            """Each version's tokens match teacher-forced log-probs of that version's weights."""
            for v in set(versions):
                idx = [i for i, x in enumerate(versions) if x == v]
                ref = teacher_logps(weights[v], PROMPT, ids)
                assert maxdiff([logps[i] for i in idx], [ref[i] for i in idx]) <= TOL, v

        async def go(c):
            await c.update_weights_from_disk(weights[20], 20)
            # explicit abort: how soon requests finish depends on the machine, so retry with later aborts
            for delay in (0.02, 0.05, 0.1, 0.2, 0.4, 0.8):
                reqs = [request(f"r{i}", max_new_tokens=n_new, seed=i) for i in range(48)]
                tasks = [asyncio.create_task(c.generate(r)) for r in reqs]
                await wait_in_flight(c, len(reqs))
                await asyncio.sleep(delay)
                await c.abort_all()
                partial = await asyncio.gather(*tasks)
                if any(p.finish_reason == "abort" and 0 < len(p.output_ids) < n_new for p in partial):
                    break
            await c.update_weights_from_disk(weights[21], 21)
            rest = await asyncio.gather(*(c.generate(continuation_request(r, p.output_ids, 1))
                                          for r, p in zip(reqs, partial)))
            # the update itself interrupting requests, which generate_resumable resubmits
            version = 21
            paused = []
            for delay in (0.02, 0.05, 0.1, 0.2, 0.4, 0.8):
                tasks = [asyncio.create_task(generate_resumable(c, request(f"g{i}", max_new_tokens=n_new, seed=i)))
                         for i in range(48)]
                await wait_in_flight(c, 48)
                await asyncio.sleep(delay)
                version += 1
                weights[version] = ckpts["dense0"] if version % 2 == 0 else ckpts["dense1"]
                phases = await c.update_weights_from_disk(weights[version], version)
                paused.append(phases["engine_pause_s"])
                resumable = await asyncio.gather(*tasks)
                if any(len(set(r.versions)) == 2 for r, _ in resumable):
                    break
            return partial, rest, resumable, paused
        partial, rest, resumable, paused = with_client(url, go)
        assert all(s > 0 for s in paused)  # requests were in flight: the engine paused vLLM
        aborted = [i for i, p in enumerate(partial) if p.finish_reason == "abort" and p.output_ids]
        assert aborted, "no request was still running at abort_all"
        for i in aborted:
            k = len(partial[i].output_ids)
            versions = partial[i].versions + rest[i].versions
            assert set(versions[:k]) == {20} and set(versions[k:]) <= {21}
            assert len(versions) == n_new and rest[i].finish_reason == "length"
            check_segments(partial[i].output_ids + rest[i].output_ids, partial[i].logp_behav + rest[i].logp_behav,
                           versions)
        assert all(r.finish_reason == "length" and len(r.output_ids) == n_new for r, _ in resumable)
        spliced = [r for r, n in resumable if n > 0 and len(set(r.versions)) == 2]
        assert spliced, "the update interrupted no request mid-generation"
        for r in spliced:
            k = r.versions.index(r.versions[-1])
            assert k > 0 and r.versions[k - 1] < r.versions[k]  # old version first, then the new one
            check_segments(r.output_ids, r.logp_behav, r.versions)

    def test_requests_arriving_during_an_update_wait_for_it(self, url, ckpts):
        """With nothing in flight an update skips vLLM's pause; requests sent while it runs are held back by the
        engine, so every token is still tagged with the weights that sampled it."""
        weights = {40: ckpts["dense0"], 41: ckpts["dense1"], 42: ckpts["dense0"], 43: ckpts["dense1"]}

        async def go(c):
            await c.update_weights_from_disk(weights[40], 40)
            results = []
            for version in (41, 42, 43):
                update = asyncio.create_task(c.update_weights_from_disk(weights[version], version))
                await asyncio.sleep(0.005 * (version - 40))  # into the ~15 ms update, at different points
                reqs = [generate_resumable(c, request(f"w{version}-{i}", max_new_tokens=16, seed=i)) for i in range(8)]
                results += await asyncio.gather(*reqs)
                await update
            return results
        results = with_client(url, go)
        for r, _ in results:
            for v in set(r.versions):
                idx = [i for i, x in enumerate(r.versions) if x == v]
                ref = teacher_logps(weights[v], PROMPT, r.output_ids)
                assert maxdiff([r.logp_behav[i] for i in idx], [ref[i] for i in idx]) <= TOL, v

    def test_errors_leave_the_engine_serving(self, url, ckpts):
        async def go(c):
            with pytest.raises(InputError, match="130 tokens"):
                await c.generate(request("long", prompt=[5] * 130))
            version = await c.version()
            with pytest.raises(EngineError, match=r"tensor 'model\.layers"):
                await c.update_weights_from_disk(ckpts["moe0"], 99)
            with pytest.raises(EngineError, match=r"tensor 'model\.layers"):
                await update_by_broadcast(c, ckpts["moe0"], 98)  # refused, drained: the trainer completes
            after = await c.generate(request("after", max_new_tokens=8))
            return version, after, await c.version()
        version, after, version_after = with_client(url, go)
        assert version_after == version and set(after.versions) == {version} and len(after.output_ids) == 8


# -- MoE -----------------------------------------------------------------------------------------
def swapped(rule):
    """A wrong cut for the negative control: worker t gets worker k-1-t's slices."""
    def wrong(name, shape):
        slices = rule(name, shape)
        return None if slices is None else slices[::-1]
    return wrong


def sharded_round_trip(url: str, ckpts: dict, new: str, old: str, tag: str) -> None:
    """On a TP2 engine serving ``old``: a broadcast cut per worker (each receives only its slices) loads
    ``new`` as the HF model computes it, with about half the bytes of a full broadcast to both workers;
    cut wrongly (the slices swapped between the workers) it does not (the negative control), and a
    correct one repairs it."""
    rule = vllm_tp_rule(json.loads((Path(ckpts[new]) / "config.json").read_text()), 2)

    async def go(c):
        _, full = await update_by_broadcast(c, ckpts[old], 40)
        _, cut = await update_by_broadcast(c, ckpts[new], 41, shards=2)
        ok = await c.generate(request(f"{tag}1"))
        await update_by_broadcast(c, ckpts[new], 42, shards=2, rule=swapped(rule))
        wrong = await c.generate(request(f"{tag}2"))
        await update_by_broadcast(c, ckpts[new], 43, shards=2)
        again = await c.generate(request(f"{tag}3"))
        return full, cut, ok, wrong, again
    full, cut, ok, wrong, again = with_client(url, go)
    model_bytes = sum(t.numel() * t.element_size() for t in load_file(Path(ckpts[new]) / "model.safetensors").values())
    # a full broadcast reaches both workers (received twice); sub-group t's buckets reach worker t alone
    print(f"\nMEASURE TP2 {tag} bytes the engine received: full {2 * full['stats']['bytes']}, cut per worker "
          f"{cut['stats']['bytes']} (model {model_bytes})")
    assert full["stats"]["bytes"] == model_bytes
    assert model_bytes <= cut["stats"]["bytes"] <= 1.1 * model_bytes
    assert set(ok.versions) == {41}
    assert maxdiff(ok.logp_behav, teacher_logps(ckpts[new], PROMPT, ok.output_ids)) <= TOL
    assert maxdiff(wrong.logp_behav, teacher_logps(ckpts[new], PROMPT, wrong.output_ids)) > 0.1
    assert maxdiff(again.logp_behav, teacher_logps(ckpts[new], PROMPT, again.output_ids)) <= TOL


def _two_workers(ckpt: str):
    """A class's engine of vLLM tensor parallelism 2 serving ``ckpt``: its url, then it is stopped."""
    proc, url = _serve(ckpt, ("--tensor-parallel-size", "2"))
    yield url
    stop_engine_process(proc)


class TestTensorParallel:
    """An engine with vLLM tensor parallelism 2: both workers join the broadcast group (ranks 1 and 2)
    and load the full tensors into their shards, or (shards) only their slices; disk updates reach both
    workers too."""

    @pytest.fixture(scope="class")
    def url(self, ckpts):
        yield from _two_workers(ckpts["dense0"])

    def test_generate_and_update_with_two_workers(self, url, ckpts):
        async def go(c):
            health = await c.health()
            first = await c.generate(request("t0"))
            await c.update_weights_from_disk(ckpts["dense1"], 31)
            on_disk = await c.generate(request("t1"))
            bcast_s, box = await update_by_broadcast(c, ckpts["dense0"], 32)
            by_bcast = await c.generate(request("t2"))
            return health, first, on_disk, bcast_s, box, by_bcast
        health, first, on_disk, bcast_s, box, by_bcast = with_client(url, go)
        print(f"\nMEASURE TP2 engine broadcast update: {bcast_s * 1e3:.0f} ms ({box['stats']['bytes'] / 1e6:.2f} MB)")
        assert health["n_workers"] == 2
        assert maxdiff(first.logp_behav, teacher_logps(ckpts["dense0"], PROMPT, first.output_ids)) <= TOL
        assert set(on_disk.versions) == {31}
        assert maxdiff(on_disk.logp_behav, teacher_logps(ckpts["dense1"], PROMPT, on_disk.output_ids)) <= TOL
        assert set(by_bcast.versions) == {32}
        assert maxdiff(by_bcast.logp_behav, teacher_logps(ckpts["dense0"], PROMPT, by_bcast.output_ids)) <= TOL

    def test_each_worker_receives_only_its_slices(self, url, ckpts):
        sharded_round_trip(url, ckpts, "dense1", "dense0", "dense")


class TestMoE:
    """The MoE model on an engine of vLLM tensor parallelism 2: log-probs at two temperatures, then after a disk
    update and a full broadcast; then the cut per worker: experts split by vLLM's fused-MoE loader (w1/w3 rows,
    w2 columns), the router gate and the norms whole to each worker."""

    @pytest.fixture(scope="class")
    def url(self, ckpts):
        yield from _two_workers(ckpts["moe0"])

    def test_logp_and_updates_match_hf(self, url, ckpts):
        async def go(c):
            before = await c.generate(request("m0"))
            t07 = await c.generate(request("m07", temperature=0.7))
            await c.update_weights_from_disk(ckpts["moe1"], 1)
            on_disk = await c.generate(request("m1"))
            await update_by_broadcast(c, ckpts["moe0"], 2)
            by_bcast = await c.generate(request("m2"))
            return before, t07, on_disk, by_bcast
        before, t07, on_disk, by_bcast = with_client(url, go)
        assert maxdiff(before.logp_behav, teacher_logps(ckpts["moe0"], PROMPT, before.output_ids)) <= TOL
        assert maxdiff(t07.logp_behav, teacher_logps(ckpts["moe0"], PROMPT, t07.output_ids, 0.7)) <= TOL
        # guards the fused-MoE re-pack after reload (without it: wrong outputs)
        assert set(on_disk.versions) == {1}
        assert maxdiff(on_disk.logp_behav, teacher_logps(ckpts["moe1"], PROMPT, on_disk.output_ids)) <= TOL
        assert set(by_bcast.versions) == {2}
        assert maxdiff(by_bcast.logp_behav, teacher_logps(ckpts["moe0"], PROMPT, by_bcast.output_ids)) <= TOL

    def test_each_worker_receives_only_its_slices(self, url, ckpts):
        sharded_round_trip(url, ckpts, "moe1", "moe0", "moe")


# -- process and CLI errors (no model loaded) ----------------------------------------------------
def _cli(*args, timeout=60, unset=()) -> subprocess.CompletedProcess:
    """Run `megarl ARGS` without the variables ``unset``; on timeout end its whole process group
    (vLLM's engine core included)."""
    env = {k: v for k, v in {**os.environ, **ENV}.items() if k not in unset}
    proc = subprocess.Popen([sys.executable, "-m", "megarl.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"megarl {args[0]} did not finish in {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_dead_url_raises_engine_error_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(EngineError, match=url.replace(".", r"\.")):
        with_client(url, lambda c: c.generate(request("x")))


def test_unknown_backend_is_a_clear_cli_error(ckpts):
    out = _cli("engine", "--checkpoint", ckpts["dense0"], "--backend", "tensorrt", "--port", str(free_port()))
    assert out.returncode == 2 and "invalid choice: 'tensorrt'" in out.stderr


def test_port_in_use_fails_before_loading_the_model(ckpts):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        t0 = time.perf_counter()
        out = _cli("engine", "--checkpoint", ckpts["dense0"], "--backend", "vllm", "--port", str(port))
    assert out.returncode == 2 and f"port {port} on 127.0.0.1 is already in use" in out.stderr
    assert time.perf_counter() - t0 < 20, "it loaded the model first"


def test_start_failure_is_reported_by_the_launcher(tmp_path):
    with pytest.raises(EngineError, match=r"exited with code 2[\s\S]*config\.json"):
        launch_engine_process(str(tmp_path / "missing"), "vllm", env=ENV, startup_timeout_s=60)


def test_generate_cli(ckpts, tmp_path):
    prompts = [[1, 5, 6], [1, 7, 8, 9]]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    out = _cli("generate", "--checkpoint", ckpts["dense0"], "--backend", "vllm", "--input", str(tmp_path / "in.jsonl"),
               "--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "12", "--temperature", "1.0",
               "--seed", "3", timeout=240, unset=ENGINE_VARS)
    assert out.returncode == 0, out.stderr[-3000:]
    # the flags' defaults: vLLM's own block (128 tokens on CPU), its prefix cache on
    assert "(vllm, kv cache 1 GiB, 1 CPU thread(s), kv block 128 tokens, prefix cache on)" in out.stderr
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for p, row in zip(prompts, rows):
        assert set(row) == {"output_ids", "logprobs", "versions", "finish_reason"}
        assert row["finish_reason"] in ("stop", "length") and set(row["versions"]) == {0}
        # the EOS ids of generation_config.json (<|endoftext|> 0, <|im_end|> 2) stop by default
        assert row["finish_reason"] == "length" or row["output_ids"][-1] in (0, 2)
        assert maxdiff(row["logprobs"], teacher_logps(ckpts["dense0"], p, row["output_ids"])) <= TOL


def test_hf_backend_serves_the_same_api(ckpts):
    proc, client = launch_engine_process(ckpts["dense0"], "hf", env=ENV, startup_timeout_s=120)
    _KEYS[client.url] = client.key  # with_client's clients send this engine's key
    try:
        async def go(c):
            res = await c.generate(request("hf", max_new_tokens=16))
            with pytest.raises(InputError, match="130 tokens"):
                await c.generate(request("long", prompt=[5] * 130))
            await c.update_weights_from_disk(ckpts["dense1"], 4)
            return res, await c.generate(request("hf1", max_new_tokens=16)), await c.health()
        before, after, health = with_client(client.url, go)
    finally:
        stop_engine_process(proc)
    assert health["backend"] == "hf" and health["version"] == 4 and set(after.versions) == {4}
    assert maxdiff(before.logp_behav, teacher_logps(ckpts["dense0"], PROMPT, before.output_ids)) <= TOL
    assert maxdiff(after.logp_behav, teacher_logps(ckpts["dense1"], PROMPT, after.output_ids)) <= TOL
