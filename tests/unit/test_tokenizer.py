"""Tokenizer layer on tiny GGUF files written with gguf.GGUFWriter: no real weights needed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import gguf
import pytest
import tokenizers

from tokenmill.errors import ModelFormatError, RequestValidationError, TokenmillError
from tokenmill.models.loading import gguf_tokenizer, gguf_tokenizer_cache
from tokenmill.models.loading.gguf_tokenizer import TokenType, generate_merges
from tokenmill.models.loading.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BPE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
BPE_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
SPM_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
SPM_PIECES = ["▁", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", "▁hello", "▁w", "or", "wor"]
SPM_PIECES += ["▁wor", "ld", "world", "▁world", "<start_of_turn>", "<end_of_turn>"]


def _id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    assert token_id is not None, token
    return token_id


def _byte_alphabet() -> list[str]:
    table = gguf_tokenizer._bytes_to_unicode()
    return [table[b] for b in range(256)]


def write_gguf(path: Path, arch: str, kv: dict[str, Any]) -> Path:
    writer = gguf.GGUFWriter(path, arch=arch)
    for key, value in kv.items():
        writer.add_key_value(key, value[0], value[1], value[2] if len(value) > 2 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _strings(values: list[str]) -> tuple[Any, ...]:
    return (values, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING)


def _ints(values: list[int]) -> tuple[Any, ...]:
    return (values, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)


def _int(value: int) -> tuple[Any, ...]:
    return (value, gguf.GGUFValueType.UINT32)


@pytest.fixture
def bpe_gguf(tmp_path: Path) -> Path:
    return write_bpe_gguf(tmp_path)


def write_bpe_gguf(tmp_path: Path) -> Path:
    """Byte-level BPE like SmolLM2/Qwen: 256 byte symbols, a few merges, ChatML specials."""
    merged = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
    tokens = [*BPE_SPECIALS, *_byte_alphabet(), *merged]
    kinds = [TokenType.CONTROL] * 3 + [TokenType.NORMAL] * (len(tokens) - 3)
    return write_gguf(
        tmp_path / "tiny-bpe.gguf",
        "llama",
        {
            "tokenizer.ggml.model": ("gpt2", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.pre": ("qwen2", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.tokens": _strings(tokens),
            "tokenizer.ggml.token_type": _ints([int(k) for k in kinds]),
            "tokenizer.ggml.merges": _strings(BPE_MERGES),
            "tokenizer.ggml.bos_token_id": _int(1),
            "tokenizer.ggml.eos_token_id": _int(2),
            "tokenizer.ggml.add_bos_token": (False, gguf.GGUFValueType.BOOL),
            "tokenizer.chat_template": (CHATML, gguf.GGUFValueType.STRING),
        },
    )


def spm_gguf(tmp_path: Path, arch: str) -> Path:
    """SentencePiece-style vocabulary like Gemma 3: scores, byte fallback tokens, no merges."""
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = [*SPM_SPECIALS, *byte_tokens, *SPM_PIECES]
    kinds = [TokenType.CONTROL, TokenType.CONTROL, TokenType.CONTROL, TokenType.UNKNOWN]
    kinds += [TokenType.BYTE] * 256 + [TokenType.NORMAL] * (len(SPM_PIECES) - 2) + [TokenType.CONTROL] * 2
    return write_gguf(
        tmp_path / f"tiny-spm-{arch}.gguf",
        arch,
        {
            "tokenizer.ggml.model": ("llama", gguf.GGUFValueType.STRING),
            "tokenizer.ggml.tokens": _strings(tokens),
            "tokenizer.ggml.scores": (
                [-float(i) for i in range(len(tokens))],
                gguf.GGUFValueType.ARRAY,
                gguf.GGUFValueType.FLOAT32,
            ),
            "tokenizer.ggml.token_type": _ints([int(k) for k in kinds]),
            "tokenizer.ggml.bos_token_id": _int(2),
            "tokenizer.ggml.eos_token_id": _int(1),
            "tokenizer.ggml.unknown_token_id": _int(3),
            "tokenizer.ggml.add_bos_token": (True, gguf.GGUFValueType.BOOL),
        },
    )


# ------------------------------------------------------------------------------- byte-level BPE


def test_bpe_applies_merges_and_special_tokens(bpe_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf)
    hello, world = _id(tok, "hello"), _id(tok, "Ġworld")
    assert tok.encode("hello world") == [hello, world]  # add_bos_token is False in the file
    assert tok.encode("<|im_start|>hello<|im_end|>") == [1, hello, 2]
    assert tok.decode([1, hello, 2]) == "hello"
    assert tok.decode([1, hello, 2], skip_special_tokens=False) == "<|im_start|>hello<|im_end|>"


@pytest.mark.parametrize("text", ["hello world", "  Zürich 日本語 🤗\n\n\tx = 1234;", "<|im_end|> é", ""])
def test_bpe_round_trip(bpe_gguf: Path, text: str) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf)
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_bpe_special_ids_and_eos(bpe_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf)
    assert (tok.bos_token_id, tok.bos_token, tok.eos_token) == (1, "<|im_start|>", "<|im_end|>")
    # <|endoftext|> also ends generation, as llama.cpp decides by its text.
    assert tok.eos_token_ids == (2, 0)
    assert tok.vocab_size == 3 + 256 + 9
    assert tok.id_to_token(tok.vocab_size + 5) is None


def test_qwen2_regex_splits_digits_one_by_one(bpe_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf)
    pieces = tok.backend.pre_tokenizer.pre_tokenize_str("ab 123")
    assert [p for p, _ in pieces] == ["ab", "Ġ", "1", "2", "3"]


# ---------------------------------------------------------------------------- SentencePiece BPE


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_spm_adds_bos_once(tmp_path: Path, arch: str) -> None:
    tok = Tokenizer.from_gguf(spm_gguf(tmp_path, arch))
    body = tok.encode("hello world", add_special_tokens=False)
    assert tok.decode(body) == "hello world"
    assert tok.encode("hello world") == [2, *body]
    with_bos = tok.encode("<bos>hello world")  # a rendered template that writes <bos> gets no second one
    assert with_bos[0] == 2 and with_bos.count(2) == 1


def test_gemma_has_no_prefix_space_and_merges_by_position(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(spm_gguf(tmp_path, "gemma3"))
    ids = tok.encode("hello world", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["hello", "▁world"]


def test_llama_spm_prepends_space(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(spm_gguf(tmp_path, "llama"))
    ids = tok.encode("hello world", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["▁hello", "▁world"]


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_spm_byte_fallback_round_trip(tmp_path: Path, arch: str) -> None:
    tok = Tokenizer.from_gguf(spm_gguf(tmp_path, arch))
    ids = tok.encode("日", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids][-3:] == ["<0xE6>", "<0x97>", "<0xA5>"]
    assert tok.decode(tok.encode("hello 日本 world")) == "hello 日本 world"


def test_spm_control_tokens_match_whole(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(spm_gguf(tmp_path, "gemma3"))
    start, end = tok.token_to_id("<start_of_turn>"), tok.token_to_id("<end_of_turn>")
    ids = tok.encode("<start_of_turn>hello<end_of_turn>", add_special_tokens=False)
    assert ids[0] == start and ids[-1] == end
    assert end in tok.eos_token_ids


def test_generate_merges_prefers_score_then_longer_left() -> None:
    ids = {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5}
    scores = {"a": 0.0, "b": 0.0, "c": 0.0, "ab": -1.0, "bc": -2.0, "abc": -0.5}
    assert generate_merges(ids, scores) == [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c")]


# ----------------------------------------------------------------------------- incremental decode


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    stream = tok.new_decode_stream()
    return [stream.step(i) for i in ids]


def test_decode_stream_holds_back_split_utf8(bpe_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf)
    ids = tok.encode("hello é🤗")
    pieces = _stream(tok, ids)
    assert len(ids) == 1 + 1 + 2 + 4  # é is two byte tokens, 🤗 four
    assert pieces == ["hello", " ", "", "é", "", "", "", "🤗"]


def test_decode_stream_skips_special_tokens(bpe_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf)
    ids = tok.encode("<|im_start|>hello world<|im_end|>")
    assert "".join(_stream(tok, ids)) == "hello world"
    stream = tok.new_decode_stream(skip_special_tokens=False)
    assert "".join(stream.step(i) for i in ids) == "<|im_start|>hello world<|im_end|>"


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_decode_stream_byte_fallback(tmp_path: Path, arch: str) -> None:
    tok = Tokenizer.from_gguf(spm_gguf(tmp_path, arch))
    ids = tok.encode("hello 日 world")
    pieces = _stream(tok, ids)
    assert pieces[-4:-1] == ["", "", "日"]
    assert "".join(pieces) == "hello 日 world"


# ------------------------------------------------------------------------------------- caching


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's tokenizer caches go to its own TOKENMILL_HOME, not the user's."""
    home = tmp_path / "home"
    monkeypatch.setenv("TOKENMILL_HOME", str(home))
    return home / "tokenizers"


def _entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []


def test_second_load_reads_the_cache_not_the_gguf(bpe_gguf: Path, cache_home: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    first = Tokenizer.from_gguf(bpe_gguf)
    names = _entries(cache_home)
    assert len(names) == 2 and all(n.startswith("tiny-bpe-") for n in names)
    assert sorted(p.name for p in bpe_gguf.parent.iterdir()) == ["home", "tiny-bpe.gguf"]  # nothing beside it

    def no_reader(*args: object, **kwargs: object) -> None:
        raise AssertionError("GGUFReader used despite a fresh cache")

    monkeypatch.setattr(gguf_tokenizer.gguf, "GGUFReader", no_reader)
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
    real_reader = gguf.GGUFReader

    def counting_reader(*args: Any) -> gguf.GGUFReader:
        calls.append(args)
        return real_reader(*args)

    monkeypatch.setattr(gguf_tokenizer.gguf, "GGUFReader", counting_reader)
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
        {"tokenizer.ggml.model": ("rwkv", gguf.GGUFValueType.STRING), "tokenizer.ggml.tokens": _strings(["a"])},
    )
    with pytest.raises(ModelFormatError, match="unsupported GGUF tokenizer model 'rwkv'"):
        Tokenizer.from_gguf(rwkv)


# -------------------------------------------------------------------------------- chat template


def test_chat_template_renders_strings_and_text_parts(bpe_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf)
    plain = [{"role": "user", "content": "hi"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": None}]
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(plain) == expected
    assert tok.apply_chat_template(parts) == expected
    assert tok.apply_chat_template(plain, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )


def test_chat_template_rejects_image_parts(bpe_gguf: Path) -> None:
    tok = Tokenizer.from_gguf(bpe_gguf)
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    with pytest.raises(RequestValidationError, match="'image_url' is not supported"):
        tok.apply_chat_template([message])


def test_model_without_template_says_so(tmp_path: Path) -> None:
    tok = Tokenizer.from_gguf(spm_gguf(tmp_path, "gemma3"))
    with pytest.raises(TokenmillError, match=r"^model tiny-spm-gemma3 has no chat template: "):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    meta = gguf_tokenizer.TokenizerMeta(
        **{**tok._meta.to_json(), "eos_token_ids": tok.eos_token_ids, "chat_template": template}
    )
    return Tokenizer(tok.backend, meta, name=tok.name)


def test_template_globals_match_transformers(bpe_gguf: Path) -> None:
    tok = _with_template(
        Tokenizer.from_gguf(bpe_gguf),
        "{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') | length }}\n  {% if true %}\n x{% endif %}",
    )
    rendered = tok.apply_chat_template([{"role": "user", "content": "<b>&'é"}])
    # tojson keeps <>&' and non-ASCII as-is; trim_blocks/lstrip_blocks eat the newline and indent.
    assert rendered == '<|im_start|>[{"role": "user", "content": "<b>&\'é"}]|4\n x'


def test_raise_exception_becomes_a_request_error(bpe_gguf: Path) -> None:
    tok = _with_template(Tokenizer.from_gguf(bpe_gguf), "{{ raise_exception('roles must alternate') }}")
    with pytest.raises(RequestValidationError, match="roles must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_sandbox_blocks_attribute_escapes(bpe_gguf: Path) -> None:
    tok = _with_template(Tokenizer.from_gguf(bpe_gguf), "{{ messages.__class__.__mro__ }}")
    with pytest.raises(RequestValidationError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ---------------------------------------------------------------------------------- HF directory


def test_from_hf_dir_reads_configs(bpe_gguf: Path, tmp_path: Path) -> None:
    source = Tokenizer.from_gguf(bpe_gguf)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    source.backend.save(str(hf_dir / "tokenizer.json"))
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "chat_template": CHATML}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (hf_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(hf_dir)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (1, (2, 0), False)
    assert tok.encode("hello world") == source.encode("hello world")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == source.apply_chat_template(
        [{"role": "user", "content": "hi"}]
    )


def test_from_hf_dir_prefers_chat_template_jinja(bpe_gguf: Path, tmp_path: Path) -> None:
    tokenizers.Tokenizer.save(Tokenizer.from_gguf(bpe_gguf).backend, str(tmp_path / "tokenizer.json"))
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_hf_dir(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}]) == "hi!"
    with pytest.raises(ModelFormatError, match=r"has no tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path / "nowhere")
