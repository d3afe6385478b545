"""The `moetier` command line: one module per command, wired in cli/app.py (`main`).

Thin by design: each command maps its flags onto the frozen config dataclasses and calls
the Python API. Nothing in moetier imports this package.
"""
