"""The spawned dedicated scoring child (recovery/_dedicated_scorer.py's _child_main) outlives a SIGUSR1 sent to
trainer rank 0's process group: torchrun passes a stop on to each worker with killpg, which reaches the child too,
and the trainer still needs the child to checkpoint the strategy's state before it closes it. Before, the child
died of the signal (exit code -10) and the stop's checkpoint failed."""
import multiprocessing as mp
import os
import signal
import time

from recovery._dedicated_scorer import _child_main


def no_model(checkpoint_dir: str, temperature: float = 1.0) -> None:
    """The factory the child builds its scorer with: the state and stop messages of this test reach no model."""
    return None


def test_the_spawned_scorer_survives_a_stop_signal_and_answers_the_state_request(tmp_path):
    ctx = mp.get_context("spawn")
    in_q, out_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_child_main, args=(f"{__name__}:no_model", str(tmp_path), {}, 1, in_q, out_q),
                       daemon=True)
    proc.start()
    try:
        assert out_q.get(timeout=60) == ("ready", None)
        os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(0.5)
        assert proc.is_alive(), f"the scoring child died of SIGUSR1 (exit code {proc.exitcode})"
        in_q.put(("state", None))
        assert out_q.get(timeout=30) == ("state", None)
        in_q.put(("stop", None))
        proc.join(timeout=30)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
