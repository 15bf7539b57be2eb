"""The tokenizer cache under $TOKENMILL_HOME, reading a GGUF's vocabulary, and bad files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest

from tests.fixtures.gguf_vocab import spm_gguf, strings, temporary_home, write_bpe_gguf, write_gguf
from tokenmill.errors import ModelFormatError
from tokenmill.models.loading import gguf_tokenizer, gguf_tokenizer_cache
from tokenmill.models.loading.gguf_header import GgufHeader
from tokenmill.models.loading.tokenizer import Tokenizer


@pytest.fixture
def bpe_gguf(tmp_path: Path) -> Path:
    return write_bpe_gguf(tmp_path)


# ------------------------------------------------------------------------------------- caching


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return temporary_home(tmp_path, monkeypatch)


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []


def test_second_load_reads_the_cache_not_the_gguf(bpe_gguf: Path, cache_home: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    first = Tokenizer.from_gguf(bpe_gguf)
    names = _entries(cache_home)
    assert len(names) == 2 and all(n.startswith("tiny-bpe-") for n in names)
    assert sorted(p.name for p in bpe_gguf.parent.iterdir()) == ["home", "tiny-bpe.gguf"]  # nothing beside it

    def no_reader(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF read despite a fresh cache")

    monkeypatch.setattr(gguf_tokenizer, "read_gguf_header", no_reader)
    second = Tokenizer.from_gguf(bpe_gguf)
    assert second.encode("hello world <|im_end|>") == first.encode("hello world <|im_end|>")
    assert (second.eos_token_ids, second.chat_template) == (first.eos_token_ids, first.chat_template)


def test_changed_gguf_invalidates_the_cache(bpe_gguf: Path, cache_home: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    Tokenizer.from_gguf(bpe_gguf)
    before = _entries(cache_home)
    stat = bpe_gguf.stat()
    os.utime(bpe_gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    calls: list[tuple[Any, ...]] = []
    real_reader = gguf_tokenizer.read_gguf_header

    def counting_reader(*args: Any, **kwargs: Any) -> GgufHeader:
        calls.append(args)
        return real_reader(*args, **kwargs)

    monkeypatch.setattr(gguf_tokenizer, "read_gguf_header", counting_reader)
    Tokenizer.from_gguf(bpe_gguf)
    assert len(calls) == 1
    after = _entries(cache_home)
    assert len(after) == 2 and not set(after) & set(before)  # a new entry; the stale one is removed
    meta_name = next(n for n in after if n.endswith("_meta.json"))
    meta = json.loads((cache_home / meta_name).read_text())
    assert meta["stamp"]["gguf_mtime_ns"] == stat.st_mtime_ns + 10**9


def test_two_files_of_one_name_get_separate_entries(tmp_path: Path, cache_home: Path) -> None:
    """Same file name in two folders, different vocabularies: each loads its own tokenizer."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    bpe = write_bpe_gguf(tmp_path / "a")
    spm = spm_gguf(tmp_path / "b", "llama").rename(tmp_path / "b" / "tiny-bpe.gguf")
    expected = {path: Tokenizer.from_gguf(path).encode("hello world") for path in (bpe, spm)}
    assert expected[bpe] != expected[spm]
    assert len(_entries(cache_home)) == 4
    for path in (bpe, spm):
        assert Tokenizer.from_gguf(path).encode("hello world") == expected[path]


def test_file_replaced_in_place_is_not_served_the_old_cache(tmp_path: Path, cache_home: Path) -> None:
    """A different file at the same path with the same size and mtime: the inode tells them apart."""
    (tmp_path / "new").mkdir()
    path, replacement = write_bpe_gguf(tmp_path), spm_gguf(tmp_path / "new", "llama")
    size = max(path.stat().st_size, replacement.stat().st_size)
    for gguf_file in (path, replacement):  # trailing zero padding: GGUF readers go by offsets
        with gguf_file.open("ab") as out:
            out.write(bytes(size - gguf_file.stat().st_size))
    old = Tokenizer.from_gguf(path).encode("hello world")
    stat = path.stat()
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, path)
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (stat.st_size, stat.st_mtime_ns)
    assert Tokenizer.from_gguf(path).encode("hello world") != old


def test_entries_of_files_that_are_gone_are_pruned(tmp_path: Path, cache_home: Path) -> None:
    (tmp_path / "gone").mkdir()
    (tmp_path / "kept").mkdir()
    gone, kept = write_bpe_gguf(tmp_path / "gone"), spm_gguf(tmp_path / "kept", "llama")
    Tokenizer.from_gguf(gone)
    Tokenizer.from_gguf(kept)
    assert len(_entries(cache_home)) == 4
    gone.unlink()
    Tokenizer.from_gguf(write_bpe_gguf(tmp_path))  # a cache miss: the write prunes
    names = _entries(cache_home)
    assert len(names) == 4 and sum(n.startswith("tiny-spm-llama-") for n in names) == 2
    assert not any(n.startswith(gguf_tokenizer_cache.path_prefix(gone)) for n in names)


def test_unwritable_cache_home_still_loads(bpe_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("TOKENMILL_HOME", str(blocker))  # mkdir under a file fails
    first = Tokenizer.from_gguf(bpe_gguf).encode("hello world")
    assert Tokenizer.from_gguf(bpe_gguf).encode("hello world") == first


def test_corrupt_cache_is_rebuilt(bpe_gguf: Path, cache_home: Path) -> None:
    expected = Tokenizer.from_gguf(bpe_gguf).encode("hello world")
    json_name = next(n for n in _entries(cache_home) if n.endswith(".tokenizer.json"))
    (cache_home / json_name).write_text("{not json")
    assert Tokenizer.from_gguf(bpe_gguf).encode("hello world") == expected


# -------------------------------------------------------------------------------------- errors


def test_missing_and_unsupported_files_raise_model_format_error(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="does not exist"):
        Tokenizer.from_gguf(tmp_path / "absent.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelFormatError, match="cannot read GGUF"):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")
    rwkv = write_gguf(
        tmp_path / "rwkv.gguf",
        "rwkv",
        {"tokenizer.ggml.model": ("rwkv", gguf.GGUFValueType.STRING), "tokenizer.ggml.tokens": strings(["a"])},
    )
    with pytest.raises(ModelFormatError, match="unsupported GGUF tokenizer model 'rwkv'"):
        Tokenizer.from_gguf(rwkv)


# ---------------------------------------------------------------------------- reading the vocabulary


@pytest.mark.parametrize("kind", ["bpe", "spm-llama", "spm-gemma3"])
def test_vocabulary_matches_the_gguf_packages_reader(tmp_path: Path, kind: str) -> None:
    """Our header parser (the cold-start path) reads every tokenizer field as gguf.GGUFReader does."""
    path = write_bpe_gguf(tmp_path) if kind == "bpe" else spm_gguf(tmp_path, kind.removeprefix("spm-"))
    reader = gguf.GGUFReader(path, "r")
    reference = gguf_tokenizer._vocab_from_fields(
        {key: field.contents() for key, field in reader.fields.items()
         if key.startswith("tokenizer.") or key == "general.architecture"})
    vocab = gguf_tokenizer.read_gguf_vocab(path)
    assert vocab == reference
    assert all(type(t) is int for t in vocab.token_types)  # lists of Python values, not numpy scalars
    assert vocab.scores is None or all(type(x) is float for x in vocab.scores)
