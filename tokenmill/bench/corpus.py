"""Local text to cut prompts from, no downloads: English prose from the docstrings of stdlib
modules, and Python code from their source. Fixed for a given Python version, so two runs (and
two targets) with the same seed send the same prompts."""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings
from enum import StrEnum

# Chosen for size and variety; the order is part of the corpus, keep it stable.
_PROSE_MODULES = ("json", "argparse", "collections", "textwrap", "functools", "itertools", "pathlib",
                  "subprocess", "logging", "dataclasses", "asyncio", "unittest", "typing", "re", "string",
                  "statistics", "datetime", "csv", "shutil", "tempfile", "heapq", "bisect", "enum", "contextlib")
_CODE_MODULES = ("json.decoder", "json.encoder", "textwrap", "heapq", "bisect", "csv", "shutil", "tempfile",
                 "string", "statistics", "fractions", "difflib", "dataclasses", "functools", "pprint", "queue")


class TextKind(StrEnum):
    PROSE = "prose"
    CODE = "code"


@functools.cache
def corpus_text(kind: TextKind) -> str:
    return _prose() if kind is TextKind.PROSE else _code()


def _prose() -> str:
    # Reading every member's docstring touches deprecated aliases (typing.io, typing.re) that warn.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _docstrings()


def _docstrings() -> str:
    pieces: list[str] = []
    for name in _PROSE_MODULES:
        module = importlib.import_module(name)
        pieces.append(inspect.getdoc(module) or "")
        for _, member in sorted(vars(module).items()):
            if (inspect.isclass(member) or inspect.isfunction(member)) and getattr(member, "__module__", "") == name:
                pieces.append(inspect.getdoc(member) or "")
    return "\n\n".join(piece for piece in pieces if piece)


def _code() -> str:
    return "\n\n".join(inspect.getsource(importlib.import_module(name)) for name in _CODE_MODULES)
