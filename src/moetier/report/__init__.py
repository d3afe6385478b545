"""`moetier report`: PNG figures and an HTML index from a run directory, a simulation directory or a
routing trace. load.py detects and reads the input, data.py computes each figure's numbers, plots.py
draws them, html.py writes the index, build.py runs the steps; record.py is the writing side (the
run directories of `generate/eval/simulate --run-dir`). The command itself is moetier.cli.report.

Invariant: importing this package imports neither torch nor matplotlib (plots import it lazily).
"""
