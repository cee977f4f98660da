"""`python -m redcoast` runs the `redcoast` command."""

from .cli import main

main()
