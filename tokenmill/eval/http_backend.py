"""Any OpenAI-compatible server as an eval backend: `/v1/completions` (echo + logprobs over token-id
prompts, the request lm-evaluation-harness's `local-completions` sends), `/tokenize` and
`/tokenizer_info` (tokenmill and vLLM serve both).

Requests go one prompt each, `concurrency` at a time, so the server's continuous batching does
the batching and any server that takes a single prompt works.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any, TypeVar

import httpx

from tokenmill.eval.client import (
    Backend,
    EvalError,
    GenerateOptions,
    Generation,
    PositionLogprobs,
    Progress,
    Prompt,
)
from tokenmill.eval.metrics import TokenKey

T = TypeVar("T")
_ID_PREFIX = "token_id:"
_ERROR_CHARS = 300
DEFAULT_MAX_LENGTH = 2047  # a server that states no context length: assume 2048 tokens


class HttpBackend(Backend):
    def __init__(self, url: str, model: str | None = None, *, api_key: str | None = None, concurrency: int = 8,
                 timeout_s: float = 600.0) -> None:
        if concurrency < 1:
            raise EvalError("concurrency must be at least 1")
        self.root = url.rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(base_url=self.root, headers=headers, timeout=timeout_s,
                                    limits=httpx.Limits(max_connections=concurrency))
        self.concurrency = concurrency
        self.model = model or self._first_model()
        self.name = f"{self.model}@{self.root}"
        self._info: dict[str, Any] | None = None
        self._max_len: int | None = None

    # -- plumbing

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = self._client.request(method, path, json=body)
        except httpx.HTTPError as error:
            raise EvalError(f"{method} {self.root}{path} failed: {error}") from error
        if response.status_code != 200:
            raise EvalError(f"{method} {self.root}{path}: HTTP {response.status_code}: "
                            f"{' '.join(response.text.split())[:_ERROR_CHARS]}")
        return response.json()

    def _first_model(self) -> str:
        data = self._request("GET", "/v1/models").get("data") or []
        if not data:
            raise EvalError(f"{self.root}/v1/models lists no model: pass model=NAME in the spec")
        return str(data[0]["id"])

    def _tokenizer_info(self) -> dict[str, Any]:
        if self._info is None:
            self._info = self._request("GET", "/tokenizer_info")
        return self._info

    def _map(self, fn: Callable[[Any], T], items: Sequence[Any], progress: Progress | None) -> list[T]:
        results: list[T | None] = [None] * len(items)
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            futures = {pool.submit(fn, item): i for i, item in enumerate(items)}
            for future in as_completed(futures):
                results[futures[future]] = future.result()
                if progress is not None:
                    progress(1)
        return results  # type: ignore[return-value]  # every slot is filled above

    # -- Backend

    def tokenize(self, text: str) -> list[int]:
        # `content`/`add_special` are llama-server's names for the same thing; tokenmill ignores them.
        body = {"model": self.model, "prompt": text, "add_special_tokens": False, "content": text,
                "add_special": False}
        tokens = self._request("POST", "/tokenize", body).get("tokens")
        if not isinstance(tokens, list):
            raise EvalError(f"{self.root}/tokenize returned no token list")
        return [int(t) for t in tokens]

    def prompt_bos(self) -> int | None:
        info = self._tokenizer_info()
        bos = info.get("bos_token_id")
        return int(bos) if info.get("add_bos_token") and bos is not None else None

    def max_length(self) -> int:
        if self._max_len is None:
            cards = self._request("GET", "/v1/models").get("data") or []
            card = next((c for c in cards if c.get("id") == self.model), cards[0] if cards else {})
            length = card.get("max_model_len") or self._tokenizer_info().get("model_max_length")
            self._max_len = int(length) - 1 if length else DEFAULT_MAX_LENGTH
        return self._max_len

    def prefix_token(self) -> int:
        info = self._tokenizer_info()
        for key in ("bos_token_id", "eos_token_id"):
            if info.get(key) is not None:
                return int(info[key])
        raise EvalError(f"{self.root}/tokenizer_info names neither a BOS nor an EOS token")

    def score(self, prompts: Sequence[list[int]], top_k: int,
              progress: Progress | None = None) -> list[list[PositionLogprobs]]:
        return self._map(lambda prompt: self._score_one(prompt, top_k), prompts, progress)

    def _score_one(self, prompt: list[int], top_k: int) -> list[PositionLogprobs]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "echo": True,
                "logprobs": top_k, "return_tokens_as_token_ids": True}
        choice = self._request("POST", "/v1/completions", body)["choices"][0]
        logprobs = choice.get("logprobs") or {}
        tokens, lps, tops = logprobs.get("tokens"), logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
        if not tokens or len(tokens) < len(prompt) or lps is None or tops is None:
            raise EvalError(f"{self.root} did not echo the prompt's logprobs (needs `echo` with `logprobs`)")
        positions = []
        for i in range(1, len(prompt)):
            key = _key(tokens[i])
            if isinstance(key, int) and key != prompt[i]:
                raise EvalError(f"{self.root} echoed token {key} at position {i}, the prompt has {prompt[i]}")
            top = {_key(k): float(v) for k, v in (tops[i] or {}).items()}
            positions.append(PositionLogprobs(key, float(lps[i]), top))
        return positions

    def generate(self, prompts: Sequence[Prompt], options: GenerateOptions,
                 progress: Progress | None = None) -> list[Generation]:
        return self._map(lambda prompt: self._generate_one(prompt, options), prompts, progress)

    def _generate_one(self, prompt: Prompt, options: GenerateOptions) -> Generation:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": options.max_tokens,
                                "temperature": options.temperature, "logprobs": 0,
                                "return_tokens_as_token_ids": True}
        if options.stop:
            body["stop"] = list(options.stop)
        if options.seed is not None:
            body["seed"] = options.seed
        choice = self._request("POST", "/v1/completions", body)["choices"][0]
        tokens = list((choice.get("logprobs") or {}).get("tokens") or [])
        keys = [_key(t) for t in tokens]
        ids = [k for k in keys if isinstance(k, int)]
        token_ids = ids if tokens and len(ids) == len(keys) else None
        return Generation(str(choice.get("text") or ""), token_ids, [str(t) for t in tokens],
                          choice.get("finish_reason"))

    def describe(self) -> dict[str, Any]:
        return {"kind": "http", "url": self.root, "model": self.model}

    def close(self) -> None:
        self._client.close()


def _key(token: str) -> TokenKey:
    if token.startswith(_ID_PREFIX):
        try:
            return int(token[len(_ID_PREFIX):])
        except ValueError:
            return token
    return token
