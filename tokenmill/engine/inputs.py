"""What a request is before it enters the engine: an encoded prompt, the checks against the
model's limits, and the fan-out of `n` parallel samples into child requests.

Every front end (the offline `LLM`, the server, `tokenmill batch`) checks here before a request
reaches the engine loop, and `EngineCore.add_request` checks again, so there is one wording per
mistake and the engine never runs a request it cannot finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from tokenmill.engine.request import SamplingParams
from tokenmill.errors import RequestValidationError


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    text: str | None  # as the caller gave it; None when it gave token ids
    token_ids: list[int]
    cache_salt: str | None = None  # cached blocks and outputs are shared within one salt only (block_hash.py)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The model's limits a request is checked against (the same for every request of an engine)."""

    max_model_len: int
    vocab_size: int

    def check_token_ids(self, token_ids: Sequence[int], param: str) -> None:
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestValidationError(
                f"{param} holds token id {bad}, outside the vocabulary [0, {self.vocab_size})", param)

    def check_request(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """What the engine needs to run a request at all: a prompt that leaves room for one token,
        and ids it can embed. A `max_tokens` beyond the context ends the request at the context."""
        self._room(len(prompt_token_ids))
        self.check_token_ids(prompt_token_ids, "prompt")
        self.check_token_ids(params.stop_token_ids, "stop_token_ids")
        self.check_token_ids(list(params.logit_bias or ()), "logit_bias")
        self.check_token_ids(params.prediction or [], "prediction")
        self.check_token_ids(params.allowed_token_ids or [], "allowed_token_ids")
        self.check_token_ids([t for word in params.bad_words_token_ids or [] for t in word], "bad_words")

    def resolve_max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """The output budget, as the OpenAI API defines it: as asked if prompt + it fits the
        context (else an error), all that is left if not asked."""
        room = self._room(num_prompt_tokens)
        if requested is None:
            return room
        if requested > room:
            total = num_prompt_tokens + requested
            raise RequestValidationError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({requested}) = {total} exceeds the model's "
                f"context of {self.max_model_len} tokens by {total - self.max_model_len}: shorten the prompt or "
                f"lower max_tokens", "max_tokens")
        return requested

    def _room(self, num_prompt_tokens: int) -> int:
        if num_prompt_tokens == 0:
            raise RequestValidationError("the prompt is empty: send at least one token", "prompt")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise RequestValidationError(
                f"the prompt has {num_prompt_tokens} tokens but the model's context is {self.max_model_len} and at "
                f"least one token must be generated: shorten the prompt by {1 - room} tokens", "prompt")
        return room


@dataclass(frozen=True, slots=True)
class ChildRequest:
    """One of the `n` samples of one prompt: its own engine request."""

    index: int  # the choice index: prompt_index * n + sample, OpenAI's prompt-major order
    prompt_index: int
    prompt: EncodedPrompt
    params: SamplingParams  # n == 1


def fan_out(prompt_index: int, prompt: EncodedPrompt, params: SamplingParams) -> list[ChildRequest]:
    """`params.n` samples of one prompt. Seeded samples get seed + i, so they differ yet reproduce."""
    n = params.n
    children = []
    for sample in range(n):
        seed = None if params.seed is None else params.seed + sample
        child_params = params if n == 1 else replace(params, n=1, seed=seed)
        children.append(ChildRequest(prompt_index * n + sample, prompt_index, prompt, child_params))
    return children
