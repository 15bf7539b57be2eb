"""One choice of a response body, from an engine output: shared by both endpoints (whole choices and
stream chunks) and by `tokenmill batch`, so a body gets the same answer from either (FastAPI-free)."""

from __future__ import annotations

from tokenmill.engine.inputs import EncodedPrompt
from tokenmill.engine.request import TokenLogprob
from tokenmill.server.fanout import ChoiceUpdate
from tokenmill.server.logprob_format import chat_logprobs, completion_logprobs, prompt_logprobs
from tokenmill.server.openai_tools import ToolPlan, parse_tool_calls, tool_calls_out
from tokenmill.server.protocol import ChatRequest, CompletionRequest
from tokenmill.server.response_bodies import ChatChoice, ChatLogprobs, ChatMessageOut, CompletionChoice, PromptLogprobs
from tokenmill.server.state import TokenTexts


def echo_text(texts: TokenTexts, prompt: EncodedPrompt) -> str:
    return prompt.text if prompt.text is not None else texts.decode(prompt.token_ids)


def completion_choice(body: CompletionRequest, texts: TokenTexts, update: ChoiceUpdate, text: str,
                      token_ids: list[int], logprobs: list[TokenLogprob] | None, first_offset: int = 0,
                      with_prompt: bool = True) -> CompletionChoice:
    """A choice from `text` and its tokens (a whole answer, or a stream's new part); the prompt goes
    first when echoing (and `with_prompt`: a stream's first chunk of the choice)."""
    prompt = update.child.prompt
    echo = body.echo and with_prompt
    ids: list[int] = [*prompt.token_ids, *token_ids] if echo else list(token_ids)
    lps: list[TokenLogprob | None] = list(logprobs or [])
    if echo:
        lps = [*(update.prompt_logprobs or [None] * len(prompt.token_ids)), *lps]
    legacy = None
    if body.logprobs is not None:
        legacy = completion_logprobs(texts, ids, lps, first_offset, body.logprobs, body.return_tokens_as_token_ids)
    prompt_lps = None
    if body.prompt_logprobs is not None and update.prompt_logprobs is not None:
        prompt_lps = prompt_logprobs(texts, prompt.token_ids, update.prompt_logprobs, body.prompt_logprobs)
    return CompletionChoice(index=update.child.index, text=(echo_text(texts, prompt) if echo else "") + text,
                            logprobs=legacy, finish_reason=update.finish_reason,
                            stop_reason=update.output.stop_reason, prompt_logprobs=prompt_lps)


def chat_choice(body: ChatRequest, texts: TokenTexts, tools: ToolPlan | None, update: ChoiceUpdate) -> ChatChoice:
    """A whole answer; with tools, the calls it makes parsed out of its text."""
    out = update.output
    message, finish_reason = ChatMessageOut(content=out.text), update.finish_reason
    if tools is not None:
        content, calls = parse_tool_calls(tools, out.text)
        if calls:
            message = ChatMessageOut(content=content, tool_calls=tool_calls_out(calls))
            finish_reason = tool_finish(finish_reason)
    return ChatChoice(index=update.child.index, message=message,
                      logprobs=chat_choice_logprobs(body, texts, out.token_ids, out.logprobs),
                      finish_reason=finish_reason, stop_reason=out.stop_reason)


def tool_finish(reason: str | None) -> str | None:
    # OpenAI: "tool_calls" when the model stopped to call tools; a cut-off answer stays "length".
    return "tool_calls" if reason == "stop" else reason


def chat_choice_logprobs(body: ChatRequest, texts: TokenTexts, token_ids: list[int],
                         logprobs: list[TokenLogprob] | None) -> ChatLogprobs | None:
    if not body.logprobs:
        return None
    return chat_logprobs(texts, token_ids, logprobs or [], body.top_logprobs or 0)


def chat_prompt_logprobs(body: ChatRequest, texts: TokenTexts, update: ChoiceUpdate) -> PromptLogprobs | None:
    """vLLM's, once for the response (every choice has the same prompt)."""
    if body.prompt_logprobs is None or update.prompt_logprobs is None:
        return None
    return prompt_logprobs(texts, update.child.prompt.token_ids, update.prompt_logprobs, body.prompt_logprobs)
