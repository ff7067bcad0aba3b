"""`megarl verify-recovery` is a check: exit code 1 when a strategy that claims exactness is not exact.

The deliberately wrong strategy (a snapshot that scores version v with the
weights of v + 1, tests/unit/recovery_scorer.py) is registered in the CLI's own
process before the command runs, like a user's strategy module would be.
"""
import json
import subprocess
import sys

from conftest import ENGINE_VARS, ENV, ROOT, run_megarl

REGISTER_WRONG_AND_RUN = (
    "import sys; sys.path.insert(0, 'tests/unit'); "
    "from recovery_scorer import snapshot_next_version_class; from recovery.registry import register; "
    "register(snapshot_next_version_class()); from megarl.cli import main; sys.exit(main(sys.argv[1:]))")


def test_verify_fails_for_a_wrong_exact_strategy(ckpt, tmp_path):
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-c", REGISTER_WRONG_AND_RUN, "verify-recovery", "--config",
                        "configs/verify_cpu.yaml", "--strategies", "snapshot_next_version", "--steps", "4",
                        "--output", str(report), f"model.checkpoint={ckpt}"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(report.read_text())["strategies"]["snapshot_next_version"]
    assert s["claims_exact"] and not s["measured_exact"] and s["max_abs_err"] > 1e-5 and s["n_tokens"] > 0, s
    assert (f"FAILED: snapshot_next_version claims exactness but its max abs error {s['max_abs_err']:.3g} "
            f"exceeds --tol 1e-05 by {s['max_abs_err'] - 1e-5:.3g}") in r.stderr, r.stderr[-3000:]


def test_verify_with_the_vllm_engine_splices_and_is_exact(tmp_path):
    # configs/verify_vllm_cpu.yaml says how answers that run to the token cap keep generation the bottleneck,
    # so that every publish finds requests mid-answer. Started without VLLM_CPU_KVCACHE_SPACE and
    # OMP_NUM_THREADS (a new user's shell), the engine takes its KV cache and threads from rollout.kv_cache_gb
    # and rollout.cpu_threads
    report = tmp_path / "report.json"
    r = run_megarl("verify-recovery", "--config", "configs/verify_vllm_cpu.yaml", "--strategies", "snapshot",
                   "--steps", "10", "--output", str(report), f"model.checkpoint={tmp_path / 'text_model'}",
                   "rollout.kv_cache_gb=2", timeout=600, unset=ENGINE_VARS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kv cache 2 GiB, 1 CPU thread(s)" in (tmp_path / "engines" / "engine0.log").read_text()
    s = json.loads(report.read_text())["strategies"]["snapshot"]
    assert s["claims_exact"] and s["measured_exact"] and s["max_abs_err"] <= 1e-5, s
    assert s["n_sequences"] == 40 and s["max_versions_per_sequence"] >= 2, s
    # rollout.splice_at_tokens (configs/verify_cpu.yaml): every other group's 2 trajectories are held at 8
    # tokens until a publish; group 1's are held at version 0 while group 2 completes the first batch
    assert s["n_spliced_sequences"] >= 2, s


def test_with_bf16_engines_the_exact_strategies_stay_exact_and_behav_shows_r_d(ckpt, tmp_path):
    # engines in bf16 beside the fp32 trainer (rollout.dtype; the HF engine here, the vLLM engine's bf16 path is
    # tests/e2e/test_vllm_bf16.py): logp_behav is no longer the trainer's
    # logp_old. snapshot is judged against the trainer's own forward of each token's version and stays exact;
    # behav's anchor is logp_behav itself, so its error is the discrepancy r_d
    report = tmp_path / "report.json"
    r = run_megarl("verify-recovery", "--config", "configs/verify_cpu.yaml", "--strategies", "snapshot,behav",
                   "--steps", "4", "--output", str(report), f"model.checkpoint={ckpt}", "rollout.dtype=bfloat16",
                   timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    strategies = json.loads(report.read_text())["strategies"]
    snap, behav = strategies["snapshot"], strategies["behav"]
    assert snap["measured_exact"] and snap["max_abs_err"] <= 1e-5 and snap["n_tokens"] > 0, snap
    assert behav["max_abs_err"] > 1e-4 and behav["r_d_abs_max"] == behav["max_abs_err"], behav
    assert snap["r_d_abs_mean"] > 1e-5, snap  # the engines' discrepancy is there under snapshot too
    assert "megarl engine (hf, bfloat16)" in (tmp_path / "engines" / "engine0.log").read_text()
    records = [json.loads(line) for line in (tmp_path / "verify-snapshot" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["r_d/abs_logp_max"] > 0 and x["behav_w/masked_frac"] >= 0 for x in records), records[-1]
    # what the engines loaded at each publish: bf16, cast once by the trainer
    print(f"\n[bf16 engines] snapshot max err {snap['max_abs_err']:.2g}; behav |logp_old - logp_behav| "
          f"mean {behav['r_d_abs_mean']:.3g} max {behav['r_d_abs_max']:.3g}")


def test_moe_routing_replay_with_bf16_vllm_engines_keeps_the_exact_strategies_exact(tmp_path):
    # the tiny Qwen3-MoE on the vLLM CPU engine in bf16 beside the fp32 trainer: the engine's routers pick other
    # experts than the trainer's for a share of the tokens. Its routes (captured by megarl's worker extension)
    # replay in every forward of snapshot, interrupt_sync and dedicated, which stay exact on spliced sequences
    # (rollout.splice_at_tokens=2: the digit tokenizer's answers are short); strict: no request may lack routes
    report = tmp_path / "report.json"
    r = run_megarl("verify-recovery", "--config", "configs/verify_vllm_cpu.yaml", "--strategies",
                   "snapshot,interrupt_sync,dedicated", "--steps", "3", "--output", str(report),
                   "model.init_model=configs/models/tiny_qwen3_moe.yaml", f"model.checkpoint={tmp_path / 'moe'}",
                   "rollout.routing_replay=true", "rollout.routing_replay_strict=true", "rollout.splice_at_tokens=2",
                   "rollout.max_new_tokens=32", "rollout.dtype=bfloat16", "rollout.kv_cache_gb=1", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name, s in json.loads(report.read_text())["strategies"].items():
        assert s["claims_exact"] and s["measured_exact"] and s["max_abs_err"] <= 1e-5, (name, s)
        assert s["n_spliced_sequences"] >= 1 and s["max_versions_per_sequence"] >= 2, (name, s)
        # without replay the reference would have routed some tokens elsewhere: replay did something
        assert s["routes"]["tokens_differ_frac"] > 0, (name, s["routes"])
        records = [json.loads(x) for x in (tmp_path / f"verify-{name}" / "metrics.jsonl").read_text().splitlines()]
        steps = [x for x in records if "reward_mean" in x]
        assert len(steps) == 3 and all(x["n_routes_missing"] == 0 and x["routes/n_decisions"] > 0 for x in steps)
