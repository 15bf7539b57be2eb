"""The `tokenmill` entry point: thin wrappers that parse arguments, call the library and print.

Adding a command: write `add_<cmd>_parser(subparsers)` in `tokenmill/cli/<cmd>.py` that registers its
arguments and sets `handler=`, then append it to `_PARSER_SETUPS`. Handlers return the exit status;
user-facing failures are raised as `TokenmillError` and printed by `main` as one line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

from tokenmill.cli.batch import add_batch_parser
from tokenmill.cli.bench import add_bench_parser
from tokenmill.cli.eval import add_eval_parser
from tokenmill.cli.gateway import add_gateway_parsers
from tokenmill.cli.generate import add_generate_parser
from tokenmill.cli.models import add_models_parser, add_pull_parser
from tokenmill.cli.serve import add_serve_parser
from tokenmill.errors import TokenmillError

_Subparsers = Any  # argparse's _SubParsersAction is private; its generic type adds nothing here
Handler = Callable[[argparse.Namespace], int]


# --- entry point ---

_PARSER_SETUPS: list[Callable[[_Subparsers], None]] = [
    add_pull_parser, add_models_parser, add_generate_parser, add_serve_parser, add_batch_parser,
    add_gateway_parsers, add_bench_parser, add_eval_parser,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference serving engine")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="command")
    for setup in _PARSER_SETUPS:
        setup(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse takes a command's positionals in one run, so in `generate MODEL --chat PROMPT` the prompt
        # after the option was left over (the README's own example failed so): words that are not options
        # join the command's positional list.
        options = [e for e in extra if e.startswith("-")]
        if options or not isinstance(getattr(args, "args", None), list):
            parser.error(f"unrecognized arguments: {' '.join(options or extra)}")
        args.args.extend(extra)
    handler: Handler = args.handler
    try:
        return handler(args)
    except TokenmillError as error:
        one_line = " ".join(str(error).split())
        print(f"error: {one_line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
