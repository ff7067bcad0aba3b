"""The dedicated old-logit scorer as a launched role: its own process, reached by the trainer over TCP.

The role is what a plan's ``dedicated`` command runs on its own node
(``python -m megarl.train`` with ``MEGARL_ROLE=dedicated``, the port and the
key), here on localhost with the default Megatron scorer. The trainer side is
``megarl verify-recovery`` with ``MEGARL_DEDICATED_ADDR`` pointing at it: the
real loop (HF engine, eta 2, interruptible rollouts) with every anchor
compared with a forward of the exact version that sampled each token.
"""
import json
import secrets
import subprocess

from conftest import ENV, MEGARL, ROOT, assert_exact_fp32

from megarl.rollout.client import free_port


def test_dedicated_role_on_its_own_process_is_exact(text_ckpt, tmp_path):
    port, key = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in ENV.items() if not k.startswith("MEGARL_")}
    env["MEGARL_DEDICATED_AUTHKEY"] = key
    role = subprocess.Popen([*MEGARL, "train", "--config", "configs/verify_cpu.yaml", f"model.checkpoint={text_ckpt}",
                             "recovery.name=dedicated"],
                            cwd=ROOT, env={**env, "MEGARL_ROLE": "dedicated", "MEGARL_SERVER_PORT": str(port),
                                          "MEGARL_SERVER_HOST": "127.0.0.1"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        report = tmp_path / "report.json"
        r = subprocess.run([*MEGARL, "verify-recovery", "--config", "configs/verify_cpu.yaml", "--strategies",
                            "dedicated", "--steps", "6", "--output", str(report), f"model.checkpoint={text_ckpt}",
                            "recovery.dedicated.start_timeout_s=120", "recovery.dedicated.wait_timeout_s=120"],
                           cwd=ROOT, env={**env, "MEGARL_DEDICATED_ADDR": f"127.0.0.1:{port}"},
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        role_out, _ = role.communicate(timeout=60)  # the trainer's stop ends it
    finally:
        if role.poll() is None:
            role.kill()
            role.communicate()
    assert role.returncode == 0, role_out[-3000:]
    s = json.loads(report.read_text())["strategies"]["dedicated"]
    assert_exact_fp32("dedicated", s)
    assert s["n_tokens"] > 0 and s["max_versions_per_sequence"] >= 2, s  # spliced sequences were scored too
    # the version directories the role loaded (on the shared run directory) are gone
    assert not (tmp_path / "verify-dedicated" / "dedicated").exists()
