"""Engine logprobs in the OpenAI formats (the legacy completions object, chat's per-token list) and vLLM's
prompt_logprobs."""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.engine.request import TokenLogprob
from tokenmill.server.pipeline import finite_logprob
from tokenmill.server.response_bodies import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TokenLogprobOut,
    TopLogprob,
)
from tokenmill.server.state import TokenTexts


def completion_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None],
                        first_offset: int, num_top: int, as_token_ids: bool = False) -> CompletionLogprobs:
    """Parallel lists, one entry per token; `text_offset` indexes into the choice's text.

    A None logprob (the first prompt token, which has no context) gives null entries, as in
    the OpenAI API's echo. The top dict holds the top-n and the chosen token, as vLLM's does.
    `as_token_ids` names tokens "token_id:N" (vLLM's `return_tokens_as_token_ids`): distinct tokens
    with the same text (partial UTF-8 bytes) then stay distinct, and clients get exact ids back.
    `num_top`: the top-n shown (an echoed prompt's entries may carry more, for prompt_logprobs).
    """
    result = CompletionLogprobs()
    name = _token_id_name if as_token_ids else texts.text
    offset = first_offset
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        token = name(token_id)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if lp is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        result.token_logprobs.append(finite_logprob(lp.logprob))
        top = {name(t): finite_logprob(v) for t, v in lp.top[:num_top]}
        top.setdefault(token, finite_logprob(lp.logprob))
        result.top_logprobs.append(top)
    return result


def _token_id_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def chat_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None],
                  num_top: int) -> ChatLogprobs:
    content = [_chat_entry(texts, token_id, lp, num_top)
               for token_id, lp in zip(token_ids, logprobs, strict=True) if lp is not None]
    return ChatLogprobs(content=content)


def _chat_entry(texts: TokenTexts, token_id: int, lp: TokenLogprob, num_top: int) -> TokenLogprobOut:
    top = [TopLogprob(token=texts.text(t), logprob=finite_logprob(v), bytes=texts.utf8(t)) for t, v in lp.top[:num_top]]
    return TokenLogprobOut(token=texts.text(token_id), logprob=finite_logprob(lp.logprob),
                           bytes=texts.utf8(token_id), top_logprobs=top)


def prompt_logprobs(texts: TokenTexts, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None],
                    num_top: int) -> PromptLogprobs:
    """vLLM's format: the prompt token's entry first (its true rank), then the top `num_top` (ranks 1..n)."""
    out: PromptLogprobs = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        if lp is None:
            out.append(None)
            continue
        entry = {str(token_id): PromptLogprob(logprob=finite_logprob(lp.logprob), rank=lp.rank,
                                              decoded_token=texts.text(token_id))}
        for rank, (top_id, value) in enumerate(lp.top[:num_top], start=1):
            entry.setdefault(str(top_id), PromptLogprob(logprob=finite_logprob(value), rank=rank,
                                                        decoded_token=texts.text(top_id)))
        out.append(entry)
    return out
