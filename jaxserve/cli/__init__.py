"""The `jaxserve` command line."""

from jaxserve.cli.main import main

__all__ = ["main"]
