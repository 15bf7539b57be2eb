"""The cache of tokenizers rebuilt from GGUF files (gguf_tokenizer.py): `$TOKENMILL_HOME/tokenizers/`.

Never beside the model (that can be site-packages or read-only); one entry per file identity
(absolute path, size, mtime, inode, CACHE_FORMAT_VERSION): a tokenizer.json and a meta file written
last, as the commit marker. Entries of files that are gone are pruned whenever a new one is written.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from tokenmill.models.pull import tokenmill_home

# Bump when the builder changes what it produces, so stale caches are rebuilt.
CACHE_FORMAT_VERSION = 2

def file_stamp(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {
        "format_version": CACHE_FORMAT_VERSION,
        "gguf_size": stat.st_size,
        "gguf_mtime_ns": stat.st_mtime_ns,
        "gguf_device": stat.st_dev,
        "gguf_inode": stat.st_ino,
    }


def cache_dir() -> Path:
    return tokenmill_home() / "tokenizers"


def cache_paths(gguf_path: Path, stamp: dict[str, int]) -> tuple[Path, Path]:
    """`<stem>-<path hash>-<identity hash>.tokenizer{,_meta}.json` in cache_dir().

    The path hash keeps two files of one name apart; the identity hash (the stamp: size, mtime,
    inode, format) gives a file replaced in place a new entry instead of a shared, stale one.
    """
    identity = json.dumps(stamp, sort_keys=True)
    key = f"{path_prefix(gguf_path)}-{hashlib.sha256(identity.encode()).hexdigest()[:12]}"
    home = cache_dir()
    return home / f"{key}.tokenizer.json", home / f"{key}.tokenizer_meta.json"


def path_prefix(gguf_path: Path) -> str:
    return f"{gguf_path.stem}-{hashlib.sha256(str(gguf_path).encode()).hexdigest()[:12]}"


def read_cache(gguf_path: Path, stamp: dict[str, int]) -> tuple[Tokenizer, dict[str, Any]] | None:
    """The cached tokenizer and its meta (TokenizerMeta.to_json) of this file identity, or None."""
    json_path, meta_path = cache_paths(gguf_path, stamp)
    try:
        stored = json.loads(meta_path.read_text(encoding="utf-8"))
        if stored.get("stamp") != stamp:
            return None
        return Tokenizer.from_file(str(json_path)), dict(stored["meta"])
    except Exception:
        # A missing, stale or half-written cache is rebuilt, never an error.
        return None


def write_cache(gguf_path: Path, tokenizer: Tokenizer, meta: dict[str, Any], stamp: dict[str, int]) -> None:
    """Best effort: an unwritable home costs the next load a rebuild, nothing else."""
    json_path, meta_path = cache_paths(gguf_path, stamp)
    payload = json.dumps({"stamp": stamp, "meta": meta, "gguf_path": str(gguf_path)}, ensure_ascii=False)
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        # The meta file is the commit marker: written last, so a reader never pairs it with old JSON.
        _atomic_write(json_path, tokenizer.to_str())
        _atomic_write(meta_path, payload)
    except OSError:
        return
    _prune(json_path.parent, keep=path_prefix(gguf_path), fresh=(json_path, meta_path))


def _prune(folder: Path, keep: str, fresh: tuple[Path, Path]) -> None:
    """Drop entries of earlier versions of this file, and of files that no longer exist (models
    removed, temporary test models): a cache miss is rare, so the scan costs nothing that matters."""
    for meta_path in folder.glob("*.tokenizer_meta.json"):
        if meta_path in fresh:
            continue
        if not meta_path.name.startswith(keep + "-"):
            try:
                source = json.loads(meta_path.read_text(encoding="utf-8")).get("gguf_path")
            except (OSError, ValueError, AttributeError):
                continue
            if not isinstance(source, str) or Path(source).exists():
                continue
        for stale in (meta_path, meta_path.with_name(meta_path.name.replace("_meta.json", ".json"))):
            with contextlib.suppress(OSError):
                stale.unlink()


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
