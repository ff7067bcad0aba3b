"""Old-logit recovery strategies, one per module, chosen by `recovery.name`.

Exact (return the true ``logp_old``): snapshot, dedicated, interrupt_sync.
Approximate (return a proximal anchor): ewma, recompute, loglinear, linear, behav.
"""
