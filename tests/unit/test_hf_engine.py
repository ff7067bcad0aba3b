"""HF rollout backend against teacher-forced log-probs of the same HF weights (tiny dense Qwen3, fp32)."""
from __future__ import annotations

import asyncio
import json
import math
import threading
from pathlib import Path

import pytest
import torch

from megarl.errors import EngineError, InputError
from megarl.models.tiny import write_tiny_checkpoint
from megarl.rollout.base import UPDATE_PHASES
from megarl.rollout.hf_engine import HFEngine, processed_logprobs
from megarl.rollout.interrupt import generate_resumable
from megarl.rollout.weight_spec import tensor_specs
from megarl.rollout.weight_sync import WeightBroadcaster, save_for_engines
from megarl.types import GenerateRequest, SamplingParams

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 5, 6, 7, 8]
TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_engine")
    dense = REPO / "configs/models/tiny_qwen3.yaml"
    return {"v0": str(write_tiny_checkpoint(dense, root / "dense0", seed=0)),
            "v1": str(write_tiny_checkpoint(dense, root / "dense1", seed=1)),
            "moe": str(write_tiny_checkpoint(REPO / "configs/models/tiny_qwen3_moe.yaml", root / "moe", seed=0))}


_MODELS: dict[str, torch.nn.Module] = {}


def teacher_logits(ckpt: str, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Logits predicting each output token from prompt + the outputs before it: [len(output), V]."""
    import transformers

    if ckpt not in _MODELS:
        _MODELS[ckpt] = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = _MODELS[ckpt](torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) - 1 + len(output)]


def picked(logp: torch.Tensor, output: list[int]) -> list[float]:
    return logp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def maxdiff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


def run(coro):
    return asyncio.run(coro)


def request(rid="r", prompt=PROMPT, **sampling) -> GenerateRequest:
    sampling.setdefault("seed", 0)
    sampling.setdefault("max_new_tokens", 40)
    return GenerateRequest(rid, list(prompt), SamplingParams(**sampling))


async def _engine(ckpt):
    return await HFEngine.create(ckpt)


def test_logp_at_temperature_1_equals_teacher_forced(ckpts):
    async def go():
        eng = await _engine(ckpts["v0"])
        res = await eng.generate(request(max_new_tokens=60))
        await eng.close()
        return res
    res = run(go())
    assert res.finish_reason == "length" and len(res.output_ids) == 60 and set(res.versions) == {0}
    ref = picked(torch.log_softmax(teacher_logits(ckpts["v0"], PROMPT, res.output_ids), -1), res.output_ids)
    assert maxdiff(res.logp_behav, ref) <= TOL


def test_temperature_and_top_k_logp_is_of_the_processed_distribution(ckpts):
    async def go():
        eng = await _engine(ckpts["v0"])
        a = await eng.generate(request("t", temperature=0.7))
        b = await eng.generate(request("k", temperature=0.9, top_k=3))
        await eng.close()
        return a, b
    a, b = run(go())
    ref_a = picked(torch.log_softmax(teacher_logits(ckpts["v0"], PROMPT, a.output_ids) / 0.7, -1), a.output_ids)
    assert maxdiff(a.logp_behav, ref_a) <= TOL
    logits = teacher_logits(ckpts["v0"], PROMPT, b.output_ids) / 0.9
    kth = logits.topk(3, dim=-1).values[:, -1:]
    masked = logits.masked_fill(logits < kth, float("-inf"))
    assert all(masked[i, t] > float("-inf") for i, t in enumerate(b.output_ids)), "sampled outside the top 3"
    assert maxdiff(b.logp_behav, picked(torch.log_softmax(masked, -1), b.output_ids)) <= TOL


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    lp = processed_logprobs(logits, SamplingParams(top_p=0.6))
    # 0.5 alone < 0.6, so {0.5, 0.3} survives, renormalized to 0.625 / 0.375
    assert torch.allclose(lp.exp(), torch.tensor([0.625, 0.375, 0.0]), atol=1e-6)
    lp = processed_logprobs(logits, SamplingParams(top_p=0.4))  # the top token alone suffices
    assert torch.allclose(lp.exp(), torch.tensor([1.0, 0.0, 0.0]), atol=1e-6)


def test_seeds_reproduce_and_differ(ckpts):
    async def go():
        eng = await _engine(ckpts["v0"])
        out = [await eng.generate(request(f"s{i}", seed=s)) for i, s in enumerate([7, 7, 8])]
        await eng.close()
        return out
    a, b, c = run(go())
    assert a.output_ids == b.output_ids and a.logp_behav == b.logp_behav
    assert a.output_ids != c.output_ids


def test_stop_tokens_and_context_limit(ckpts):
    async def go():
        eng = await _engine(ckpts["v0"])
        stopped = await eng.generate(request("stop", stop_token_ids=list(range(18))))
        long_ok = await eng.generate(request("fill", prompt=[5] * 120, max_new_tokens=50))
        with pytest.raises(InputError, match="128"):
            await eng.generate(request("too-long", prompt=[5] * 128))
        after = await eng.generate(request("after", max_new_tokens=3))
        await eng.close()
        return stopped, long_ok, after
    stopped, long_ok, after = run(go())
    assert stopped.finish_reason == "stop" and len(stopped.output_ids) == 1
    assert long_ok.finish_reason == "length" and len(long_ok.output_ids) == 8  # 120 + 8 = context 128
    assert len(after.output_ids) == 3


def test_stops_at_each_eos_of_the_generation_config(ckpts):
    from megarl.config.schema import DataConfig, ModelConfig, RolloutConfig
    from megarl.tokenizer import RunTokenizer

    tok = RunTokenizer.load(ModelConfig(checkpoint=ckpts["v0"]), RolloutConfig(), DataConfig())
    gen_eos = json.loads((Path(ckpts["v0"]) / "generation_config.json").read_text())["eos_token_id"]
    assert tok.stop_token_ids == sorted(gen_eos) and len(gen_eos) == 2
    prompt = tok.encode_rendered([tok.render("123")])[0]

    async def go():
        eng = await _engine(ckpts["v0"])
        res = await asyncio.gather(*(eng.generate(request(f"e{i}", prompt=prompt, seed=i, max_new_tokens=40,
                                                          stop_token_ids=tok.stop_token_ids)) for i in range(32)))
        await eng.close()
        return res
    res = run(go())
    stopped = [r for r in res if r.finish_reason == "stop"]
    assert all(r.output_ids[-1] in gen_eos and not set(r.output_ids[:-1]) & set(gen_eos) for r in stopped)
    assert {r.output_ids[-1] for r in stopped} == set(gen_eos)


def _abort_after(eng: HFEngine, n_tokens: int, loop) -> None:
    """Abort all requests from the model's forward hook after ``n_tokens`` steps (deterministic)."""
    calls = [0]

    def hook(*_):
        calls[0] += 1
        if calls[0] == n_tokens:
            asyncio.run_coroutine_threadsafe(eng.abort_all(), loop).result()

    eng.model.register_forward_hook(hook)


def test_abort_returns_partial(ckpts):
    async def go():
        eng = await _engine(ckpts["v0"])
        _abort_after(eng, 10, asyncio.get_running_loop())
        res = await eng.generate(request(max_new_tokens=100))
        await eng.close()
        return res
    res = run(go())
    assert res.finish_reason == "abort" and len(res.output_ids) == 10
    ref = picked(torch.log_softmax(teacher_logits(ckpts["v0"], PROMPT, res.output_ids), -1), res.output_ids)
    assert maxdiff(res.logp_behav, ref) <= TOL


def test_update_from_disk_changes_logps_and_version(ckpts, tmp_path):
    from safetensors.torch import load_file

    # the trainer's disk path: save_for_engines writes safetensors only (no config.json)
    save_for_engines(load_file(Path(ckpts["v1"]) / "model.safetensors").items(), tmp_path / "v1")

    async def go():
        eng = await _engine(ckpts["v0"])
        before = await eng.generate(request())
        phases = await eng.update_weights_from_disk(str(tmp_path / "v1"), 1)
        after = await eng.generate(request())
        version = await eng.version()
        await eng.close()
        return before, after, version, phases
    before, after, version, phases = run(go())
    assert version == 1 and set(after.versions) == {1} and set(before.versions) == {0}
    # every phase is reported; the HF engine has no prefix cache, and the load is the bulk of the stall
    assert set(phases) == {f"engine_{p}_s" for p in UPDATE_PHASES} and phases["engine_cache_reset_s"] == 0
    assert phases["engine_reload_s"] == max(phases.values()) > 0
    ref = picked(torch.log_softmax(teacher_logits(ckpts["v1"], PROMPT, after.output_ids), -1), after.output_ids)
    assert maxdiff(after.logp_behav, ref) <= TOL
    old = picked(torch.log_softmax(teacher_logits(ckpts["v0"], PROMPT, after.output_ids), -1), after.output_ids)
    assert maxdiff(after.logp_behav, old) > 1e-2  # the update really changed the model


def test_update_from_broadcast_and_shape_mismatch(ckpts):
    from safetensors.torch import load_file

    from megarl.rollout.client import free_port

    new = list(load_file(Path(ckpts["v1"]) / "model.safetensors").items())
    moe = list(load_file(Path(ckpts["moe"]) / "model.safetensors").items())

    async def go():
        eng = await _engine(ckpts["v0"])
        sender = WeightBroadcaster("127.0.0.1", free_port(), world_size=2, timeout_s=60)
        box = {}

        def trainer():
            box["stats"] = sender.broadcast(iter(moe), bucket_bytes=1 << 15)  # refused, drained by the engine
            box["stats"] = sender.broadcast(iter(new), bucket_bytes=1 << 15)  # several buckets
            sender.close()
        th = threading.Thread(target=trainer)
        th.start()
        info = sender.group_info(rank=1)
        with pytest.raises(EngineError, match=r"tensor .model\.layers"):
            await eng.update_weights_from_broadcast(info, tensor_specs(moe), 5)
        still = await eng.generate(request("still", max_new_tokens=4))
        await eng.update_weights_from_broadcast(info, tensor_specs(new), 2)
        th.join(timeout=60)
        with pytest.raises(EngineError, match=r"tensor .model\.layers"):
            await eng.update_weights_from_disk(ckpts["moe"], 9)
        after = await eng.generate(request())
        version = await eng.version()
        await eng.close()
        return still, after, version, box
    still, after, version, box = run(go())
    assert set(still.versions) == {0}
    assert version == 2 and set(after.versions) == {2} and box["stats"]["tensors"] == len(new)
    ref = picked(torch.log_softmax(teacher_logits(ckpts["v1"], PROMPT, after.output_ids), -1), after.output_ids)
    assert maxdiff(after.logp_behav, ref) <= TOL


def test_abort_update_resume_splices_versions(ckpts):
    async def go():
        eng = await _engine(ckpts["v0"])
        loop = asyncio.get_running_loop()
        calls = [0]

        def hook(*_):  # mid-generation, start a weight update (which aborts the request)
            calls[0] += 1
            if calls[0] == 12:
                asyncio.run_coroutine_threadsafe(_update(), loop)

        async def _update():
            await eng.update_weights_from_disk(ckpts["v1"], 1)
        eng.model.register_forward_hook(hook)  # the old model object: only counts v0 steps
        res, interrupts = await generate_resumable(eng, request(max_new_tokens=40))
        await eng.close()
        return res, interrupts
    res, interrupts = run(go())
    assert interrupts == 1 and res.finish_reason == "length" and len(res.output_ids) == 40
    k = res.versions.index(1)
    assert k >= 1 and set(res.versions[:k]) == {0} and set(res.versions[k:]) == {1}
    for ckpt, sl in ((ckpts["v0"], slice(0, k)), (ckpts["v1"], slice(k, None))):
        ref = picked(torch.log_softmax(teacher_logits(ckpt, PROMPT, res.output_ids), -1), res.output_ids)
        assert maxdiff(res.logp_behav[sl], ref[sl]) <= TOL, ckpt
    assert not math.isnan(sum(res.logp_behav))


def test_router_routes_least_loaded_and_fans_out(ckpts):
    from megarl.rollout.base import Engine
    from megarl.rollout.client import EngineClient
    from megarl.rollout.router import EngineRouter

    async def go():
        engines = [await _engine(ckpts["v0"]), await _engine(ckpts["v0"])]
        router = EngineRouter(engines)
        assert isinstance(router, Engine) and isinstance(engines[0], Engine) and isinstance(EngineClient("x"), Engine)
        seen = []
        for e in engines:  # record which engine served each request
            orig = e.generate

            async def tagged(req, e=e, orig=orig):
                seen.append(engines.index(e))
                return await orig(req)
            e.generate = tagged
        res = await asyncio.gather(*(router.generate(request(f"q{i}", max_new_tokens=5)) for i in range(4)))
        phases = await router.update_weights_from_disk(ckpts["v1"], 3)
        own = [e.last_update_phases for e in engines]
        versions = [await e.version() for e in engines]
        health = await router.health()
        await router.close()
        return res, seen, versions, health, await router.version(), phases, own
    res, seen, versions, health, rv, phases, own = run(go())
    # the engines update at once: each phase of the stall is the slower engine's
    assert phases == {k: max(o[k] for o in own) for k in own[0]}
    assert sorted(seen) == [0, 0, 1, 1] and all(len(r.output_ids) == 5 for r in res)
    assert versions == [3, 3] and rv == 3 and health["ok"] and len(health["engines"]) == 2


def test_pause_holds_new_requests_until_resume(ckpts):
    async def go():
        eng = await _engine(ckpts["v0"])
        await eng.pause()
        task = asyncio.create_task(eng.generate(request(max_new_tokens=3)))
        await asyncio.sleep(0.2)
        held = not task.done()
        await eng.resume()
        res = await task
        await eng.close()
        return held, res
    held, res = run(go())
    assert held and res.finish_reason == "length" and len(res.output_ids) == 3
