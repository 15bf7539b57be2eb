"""Tokenizer layer on tiny GGUF files written with gguf.GGUFWriter: no real weights needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers

from tests.fixtures.gguf_vocab import CHATML, spm_gguf, temporary_home, write_bpe_gguf
from tokenmill.errors import ModelFormatError, RequestValidationError, TokenmillError
from tokenmill.models.loading import gguf_tokenizer
from tokenmill.models.loading.gguf_tokenizer import generate_merges
from tokenmill.models.loading.tokenizer import Tokenizer


def _id(tok: Tokenizer, token: str) -> int:
    token_id = tok.token_to_id(token)
    assert token_id is not None, token
    return token_id


@pytest.fixture(autouse=True)
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return temporary_home(tmp_path, monkeypatch)


@pytest.fixture
def bpe_gguf(tmp_path: Path) -> Path:
    return write_bpe_gguf(tmp_path)


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
