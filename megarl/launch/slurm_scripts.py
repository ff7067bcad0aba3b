"""The ``bash -c`` texts of megarl's Slurm steps: which program a task of a step runs.

Both pick by what Slurm tells the task, never by how it orders nodes or tasks on its own:

- :func:`node_rank_script`: the trainer step's task on each node runs torchrun with that node's rank in the
  plan, so node rank 0 (trainer rank 0, the controller) is the plan's first trainer host.
- :func:`engine_tasks_script`: the engines of one node share one step, a task each (``SLURM_LOCALID``), and
  each task takes its own slice of the step's GPUs as ``CUDA_VISIBLE_DEVICES``, as the torchrun path gives
  each engine its own. One step, because all engines join one NCCL group for the weight broadcast: where a
  site's Slurm constrains devices with cgroups (``ConstrainDevices=yes`` in cgroup.conf), each step sees only
  its own GPUs, and NCCL's peer-to-peer import between GPUs of two steps on one node fails
  (``cuMemImportFromShareableHandle ... failure 101``). Inside one step every task sees the step's GPUs, so
  the engines' communicators reach each other whatever the site's cgroup settings.
"""
from __future__ import annotations

import shlex


def node_rank_script(hosts, argv_before: list[str], argv_after: list[str]) -> str:
    """``bash -c`` text that runs torchrun with this node's rank in ``hosts`` as ``--node-rank``.

    The rank comes from the Slurm node name (SLURMD_NODENAME), so node rank 0, where trainer rank 0 (the
    controller) runs, is ``hosts[0]``: the host the rendezvous and the engines' weight broadcast address
    name. torchrun's c10d rendezvous would order nodes its own way (sorted host names), not the plan's.
    """
    cases = " ".join(f"{shlex.quote(h)}) r={i};;" for i, h in enumerate(hosts))
    return (f'case "$SLURMD_NODENAME" in {cases} *) echo "megarl: node $SLURMD_NODENAME is not a trainer host '
            f'({",".join(hosts)})" >&2; exit 1;; esac; exec {shlex.join(argv_before)} --node-rank="$r" '
            f"{shlex.join(argv_after)}")


def engine_tasks_script(tasks: list[tuple[list[str], int]], gpus: bool) -> str:
    """``bash -c`` text for a step of one task per engine: task ``i`` (``SLURM_LOCALID``) runs ``tasks[i][0]``
    with its ``tasks[i][1]`` GPUs, the next slice of the step's ``CUDA_VISIBLE_DEVICES`` (module doc).

    ``gpus``: False on CPU, where no task gets ``CUDA_VISIBLE_DEVICES``."""
    total = sum(n for _, n in tasks)
    cases, offset = [], 0
    for i, (argv, n) in enumerate(tasks):
        cases.append(f"{i}) o={offset} n={n}; set -- {shlex.join(argv)};;")
        offset += n
    text = (f'case "$SLURM_LOCALID" in {" ".join(cases)} *) echo "megarl: task $SLURM_LOCALID of the engine step '
            f'has no engine ({len(tasks)} tasks)" >&2; exit 1;; esac; ')
    if gpus:
        text += (f'IFS=, read -ra g <<< "${{CUDA_VISIBLE_DEVICES:-{",".join(map(str, range(total)))}}}"; '
                 f'if [ "${{#g[@]}}" -lt {total} ]; then echo "megarl: the engine step sees ${{#g[@]}} GPUs '
                 f'(CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES), its {len(tasks)} engines need {total}" >&2; exit 1; '
                 f'fi; export CUDA_VISIBLE_DEVICES="$(IFS=,; echo "${{g[*]:$o:$n}}")"; ')
    return text + 'exec "$@"'
