"""`megarl bench`: every recovery strategy on the same config and seed, measured and compared.

``run`` trains one strategy per process and writes the outputs, ``report``
turns metrics.jsonl records into report.json / report.md, ``plots`` draws
overhead.png and reward.png. Imports stay lazy: nothing heavy loads here.
"""
