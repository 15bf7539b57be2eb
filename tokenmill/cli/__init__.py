"""`tokenmill <command>`: one module per command group; `main` is the entry point."""

from tokenmill.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
