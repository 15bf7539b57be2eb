"""Text ↔ token ids, incremental detokenization and chat templates for one model.

Wraps a `tokenizers.Tokenizer` (the Hugging Face Rust library) built from a HF directory
(tokenizer.json) or rebuilt from a GGUF file's metadata (see gguf_tokenizer.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream as _RustDecodeStream

from tokenmill.errors import ModelFormatError, RequestValidationError, TokenmillError
from tokenmill.models.loading.gguf_tokenizer import EOG_TOKEN_TEXTS, TokenizerMeta, load_gguf_tokenizer


class DecodeStream:
    """Turns token ids into text one at a time, holding back bytes of an unfinished character.

    Decoding each id alone would be wrong: a character's UTF-8 bytes may span several byte-level
    or byte-fallback tokens, and SentencePiece decoders drop the space of the first token only.
    The Rust stream decodes the ids since the last emitted boundary and returns what they added.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._stream = _RustDecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """The text `token_id` completes; '' while a multi-byte character is still incomplete."""
        return self._stream.step(self._tokenizer, token_id) or ""


class Tokenizer:
    """A model's tokenizer: encode/decode, end-of-generation ids and its chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, meta: TokenizerMeta, name: str = "model") -> None:
        self._backend = backend
        self._meta = meta
        self.name = name

    # ---------------------------------------------------------------------------- construction

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], name: str | None = None) -> Tokenizer:
        """The tokenizer a GGUF file embeds; the second load of a file reads a cache (see gguf_tokenizer)."""
        backend, meta = load_gguf_tokenizer(path)
        return cls(backend, meta, name=name or Path(path).stem)

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike[str], name: str | None = None) -> Tokenizer:
        """A Hugging Face directory: tokenizer.json plus the configs naming BOS/EOS and the template."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise ModelFormatError(f"{root} has no tokenizer.json: save the tokenizer with transformers first")
        try:
            backend = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:
            raise ModelFormatError(f"cannot parse {root / 'tokenizer.json'}: {exc}; re-save the tokenizer") from exc
        return cls(backend, _hf_dir_meta(root, backend), name=name or root.resolve().name)

    # -------------------------------------------------------------------------------- vocabulary

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._meta.bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the model's eos first, then end-of-turn ids."""
        return self._meta.eos_token_ids

    @property
    def eos_token_id(self) -> int | None:
        return self._meta.eos_token_ids[0] if self._meta.eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        return self._meta.pad_token_id

    @property
    def bos_token(self) -> str | None:
        return self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else None

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else None

    @property
    def add_bos_token(self) -> bool:
        return self._meta.add_bos_token

    @property
    def chat_template(self) -> str | None:
        return self._meta.chat_template

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._backend

    def id_to_token(self, token_id: int) -> str | None:
        token: str | None = self._backend.id_to_token(token_id)
        return token

    def token_to_id(self, token: str) -> int | None:
        token_id: int | None = self._backend.token_to_id(token)
        return token_id

    # -------------------------------------------------------------------------- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text (`<|im_end|>`) become their ids.

        With `add_special_tokens`, BOS is prepended when the model wants it and the text does not
        already start with it (a rendered Gemma chat template writes `<bos>` itself).
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self._meta.bos_token_id
        if add_special_tokens and self._meta.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def new_decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(self._backend, skip_special_tokens)

    # ---------------------------------------------------------------------------- chat template

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render `messages` with the model's Jinja chat template, as transformers does."""
        if self._meta.chat_template is None:
            raise TokenmillError(
                f"model {self.name} has no chat template: use the completions endpoint or a chat-tuned model"
            )
        template = _compile_template(self._meta.chat_template)
        try:
            return template.render(
                messages=[_plain_message(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as exc:
            raise RequestValidationError(f"chat template of {self.name} rejected the messages: {exc}") from exc


# ------------------------------------------------------------------------------- chat template


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes `<>&'`, which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # Templates come with downloaded models: untrusted code, hence the sandbox.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelFormatError(
            f"the model's chat template does not parse ({exc}): fix or replace the template"
        ) from exc


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: keys set to None dropped, text parts joined into one string."""
    plain = {key: value for key, value in message.items() if value is not None}
    content = plain.get("content")
    if isinstance(content, list):
        plain["content"] = _join_text_parts(content)
    return plain


def _join_text_parts(parts: list[Any]) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise RequestValidationError(f"message content part of type {kind!r} is not supported: send text parts")
        texts.append(part["text"])
    # Several text parts read as paragraphs of one message (the OpenAI API and vLLM join them so).
    return "\n".join(texts)


# ---------------------------------------------------------------------------- HF directories


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"cannot parse {path}: {exc}; re-save the model directory") from exc
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _hf_dir_meta(root: Path, backend: tokenizers.Tokenizer) -> TokenizerMeta:
    config = _read_json(root / "tokenizer_config.json")
    generation = _read_json(root / "generation_config.json")
    model = _read_json(root / "config.json")

    def token_id(name: str) -> int | None:
        text = _token_text(config.get(name))
        return backend.token_to_id(text) if text is not None else None

    eos_ids = [
        *_id_list(token_id("eos_token")),
        *_id_list(generation.get("eos_token_id")),
        *_id_list(model.get("eos_token_id")),
        *_eog_added_token_ids(backend),
    ]
    bos_id = token_id("bos_token")
    if bos_id is None:
        bos_id = next(iter(_id_list(generation.get("bos_token_id")) or _id_list(model.get("bos_token_id"))), None)
    return TokenizerMeta(
        bos_token_id=bos_id,
        eos_token_ids=tuple(dict.fromkeys(eos_ids)),
        pad_token_id=token_id("pad_token"),
        unk_token_id=token_id("unk_token"),
        # tokenizer.json's post-processor usually adds BOS already; encode() never doubles it.
        add_bos_token=bool(config.get("add_bos_token", False)) and bos_id is not None,
        chat_template=_hf_chat_template(root, config),
    )


def _eog_added_token_ids(backend: tokenizers.Tokenizer) -> list[int]:
    added: dict[int, tokenizers.AddedToken] = backend.get_added_tokens_decoder()
    return sorted(i for i, token in added.items() if token.content in EOG_TOKEN_TEXTS)


def _hf_chat_template(root: Path, config: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        template = _read_json(root / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None
