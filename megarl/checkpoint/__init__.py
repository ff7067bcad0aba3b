"""The run checkpoint: what a checkpoint holds, its directories and signed files, when to write one,
the background writer, resume."""
