"""`megarl advise`: which old-logit strategy to use on this model and this cluster, measured in a few steps.

A short calibration run on the user's own config measures the train-inference
gap, the staleness, how far each approximate anchor sits from the exact
``logp_old`` and what that changes in the loss (megarl/advise/measure.py; the
probe in the loop is recovery/_calibration_probe.py), what each strategy
costs here (megarl/advise/costs.py), then
applies the decision rules (megarl/advise/rules.py) and writes the table,
advise.json and a picture (megarl/advise/report.py). The orchestration is
megarl/advise/calibrate.py; the command is megarl/commands/advise.py.
"""
