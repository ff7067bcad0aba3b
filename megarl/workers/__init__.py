"""Worker processes for user code that must not take the run down: reward functions and agent tools.

:class:`megarl.workers.pool.WorkerPool` runs calls in fresh interpreters
(megarl/workers/process.py) with a time limit, a memory limit and crash
containment; the reward service (megarl/rewards/service.py) and the agent
tool service (megarl/agents/tools.py) are both built on it.
"""
