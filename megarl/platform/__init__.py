"""The machine at hand: what megatron-core needs on it (megatron.py, cpu.py, amx.py), cores bound to roles
(cpu_affinity.py) and batch-invariant kernels (batch_invariant.py).

Light on purpose: importing the package imports no torch (megarl/launch builds on cpu_affinity).
"""
