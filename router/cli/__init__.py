"""The `hotswap` command (`main.py`) and its subcommands that talk to a running router."""

from router.cli.main import main

__all__ = ["main"]
