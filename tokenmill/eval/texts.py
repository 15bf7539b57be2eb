"""Local evaluation text: the bench's stdlib-docstring prose, a held-out prose text from a disjoint
set of stdlib modules, and stdlib code; cut into passages by characters at paragraph breaks, so
two models with different tokenizers score exactly the same text."""

from __future__ import annotations

import functools
import importlib
import inspect
import warnings

from tokenmill.bench.corpus import _PROSE_MODULES, TextKind, corpus_text

# Modules that share nothing with the bench corpus's prose set (checked in the tests); the order
# is part of the corpus.
HELDOUT_MODULES = ("email.message", "http.client", "urllib.parse", "zipfile", "tarfile", "decimal", "calendar",
                   "random", "pickle", "threading", "sqlite3", "configparser", "optparse", "gettext", "locale",
                   "mailbox", "ftplib", "smtplib", "wave", "zoneinfo", "uuid", "secrets", "hashlib", "base64")

CORPORA = ("docstrings", "heldout", "code")


@functools.cache
def corpus(name: str) -> str:
    if name == "docstrings":
        return corpus_text(TextKind.PROSE)
    if name == "code":
        return corpus_text(TextKind.CODE)
    if name == "heldout":
        return _heldout()
    raise ValueError(f"unknown corpus {name!r}: one of {', '.join(CORPORA)}")


def _heldout() -> str:
    assert not set(HELDOUT_MODULES) & set(_PROSE_MODULES)
    pieces: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in HELDOUT_MODULES:
            module = importlib.import_module(name)
            pieces.append(inspect.getdoc(module) or "")
            for _, member in sorted(vars(module).items()):
                if ((inspect.isclass(member) or inspect.isfunction(member))
                        and getattr(member, "__module__", "") == name):
                    pieces.append(inspect.getdoc(member) or "")
    return "\n\n".join(piece for piece in pieces if piece and len(piece) > 40)


def passages(text: str, num: int, chars: int, *, min_chars: int = 200) -> list[str]:
    """Up to `num` disjoint passages of about `chars` characters, spread evenly over `text`.

    Each starts at a paragraph break and grows paragraph by paragraph until it has `chars`
    characters (a longer paragraph is cut at a whitespace). Deterministic for a given text.
    """
    paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
    stride = max(len(paragraphs) // max(num, 1), 1)
    result: list[str] = []
    for start in range(0, len(paragraphs), stride):
        pieces: list[str] = []
        size = 0
        for paragraph in paragraphs[start:start + stride]:
            pieces.append(paragraph)
            size += len(paragraph) + 2
            if size >= chars:
                break
        passage = "\n\n".join(pieces)
        if len(passage) > chars:
            cut = passage.rfind(" ", 0, chars)
            passage = passage[:cut if cut > chars // 2 else chars]
        if len(passage) >= min_chars:
            result.append(passage)
        if len(result) == num:
            break
    return result
