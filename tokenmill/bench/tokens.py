"""Token counts and exact-length prompts, through the target's own tokenizer when it has one.

vLLM and tokenmill serve `POST /tokenize {"prompt"}` and `POST /detokenize {"tokens"}`; llama.cpp's
server reads `content` instead of `prompt` and answers `content`. One body carries both spellings
(servers ignore fields they do not know), so one client speaks to all three. A target without
those endpoints gets `ApproxTokenizer`: 4-character pieces, OpenAI's rule of thumb.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any

import httpx
import numpy as np

from tokenmill.bench.corpus import TextKind, corpus_text

CHARS_PER_APPROX_TOKEN = 4
CORPUS_CHARS = 64_000  # ≈ 16k tokens per kind: enough variety, cheap to tokenize
CHUNK_CHARS = 4_000  # /tokenize bodies stay small; cuts at line breaks so few tokens straddle them
MAX_PARALLEL_CALLS = 8


class Tokenizer(ABC):
    name: str

    @abstractmethod
    async def encode(self, text: str) -> list[int]: ...

    @abstractmethod
    async def decode(self, token_ids: list[int]) -> str: ...


class RemoteTokenizer(Tokenizer):
    name = "server"

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str) -> None:
        self.client, self.base_url, self.model = client, base_url, model

    async def encode(self, text: str) -> list[int]:
        body = {"model": self.model, "prompt": text, "content": text, "add_special_tokens": False,
                "add_special": False}
        data = await self._post("/tokenize", body)
        tokens = data["tokens"]
        # llama.cpp answers {"id", "piece"} objects when asked for pieces; plain ids otherwise.
        return [t["id"] if isinstance(t, dict) else int(t) for t in tokens]

    async def decode(self, token_ids: list[int]) -> str:
        data = await self._post("/detokenize", {"model": self.model, "tokens": token_ids})
        text = data.get("prompt", data.get("content"))
        if not isinstance(text, str):
            raise ValueError(f"/detokenize answered no text: {data}")
        return text

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = await self.client.post(self.base_url + path, json=body)
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data


class ApproxTokenizer(Tokenizer):
    """Pieces of 4 characters stand in for tokens; ids index the pieces seen so far, so decode
    inverts encode exactly."""

    name = "approx"

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.ids: dict[str, int] = {}

    async def encode(self, text: str) -> list[int]:
        pieces = [text[i:i + CHARS_PER_APPROX_TOKEN] for i in range(0, len(text), CHARS_PER_APPROX_TOKEN)]
        return [self._id(piece) for piece in pieces]

    def _id(self, piece: str) -> int:
        if piece not in self.ids:
            self.ids[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.ids[piece]

    async def decode(self, token_ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in token_ids)


async def connect_tokenizer(client: httpx.AsyncClient, base_url: str, model: str) -> Tokenizer:
    """The target's tokenizer if it answers a round trip, else the approximation."""
    remote = RemoteTokenizer(client, base_url, model)
    try:
        ids = await remote.encode("Hello world")
        if ids and isinstance(await remote.decode(ids), str):
            return remote
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        pass
    return ApproxTokenizer()


def chunks(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Consecutive pieces of about `size` characters, cut after a newline where there is one."""
    pieces: list[str] = []
    start = 0
    while start < len(text):
        end = min(start + size, len(text))
        cut = text.rfind("\n", start, end) + 1 if end < len(text) else end
        end = cut if cut > start else end
        pieces.append(text[start:end])
        start = end
    return pieces


class PromptFactory:
    """Cuts texts of a chosen token count out of the tokenized corpus, at random offsets."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.corpus_ids: dict[TextKind, list[int]] = {}  # tokenized on first use: a workload needs one kind

    async def text(self, kind: TextKind, num_tokens: int, rng: np.random.Generator) -> str:
        if kind not in self.corpus_ids:
            self.corpus_ids[kind] = await _tokenize_corpus(self.tokenizer, kind)
        ids = self.corpus_ids[kind]
        repeats = -(-num_tokens // len(ids)) + 1  # a prompt longer than the corpus wraps around
        offset = int(rng.integers(0, len(ids)))
        window = (ids * repeats)[offset:offset + num_tokens]
        return await self.tokenizer.decode(window)

    async def count(self, text: str) -> int:
        return len(await self.tokenizer.encode(text))


async def _tokenize_corpus(tokenizer: Tokenizer, kind: TextKind) -> list[int]:
    gate = asyncio.Semaphore(MAX_PARALLEL_CALLS)

    async def encode(piece: str) -> list[int]:
        async with gate:
            return await tokenizer.encode(piece)

    parts = await asyncio.gather(*(encode(piece) for piece in chunks(corpus_text(kind)[:CORPUS_CHARS])))
    return [token for part in parts for token in part]
