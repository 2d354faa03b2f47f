"""`python -m dsec_cli` is the `dsec` command."""

from .cli import main

main()
