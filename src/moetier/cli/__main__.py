"""`python -m moetier.cli` runs the command line."""

from moetier.cli.app import main

main()
