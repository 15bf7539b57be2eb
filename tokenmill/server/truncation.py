"""The Responses API's `truncation: "auto"`: a conversation longer than the context loses its oldest turns.

The conversation is cut into turns that must stay whole: a user message, an assistant message with the
tool messages that answer its calls (a call without its output, or an output without its call, is a
conversation no template renders sensibly), or any other single message. The leading system messages (the
instructions) stay. The fewest oldest turns are dropped such that the prompt plus the answer's room fits:
found by binary search over the number dropped (each probe renders and tokenizes once), and the newest turn
is never dropped (if it alone does not fit, the request is the 400 it would have been). Dropping from the
front changes the prompt's prefix, so the turns after a cut meet fewer prefix-cache hits until the
conversation settles: the price of not failing.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.models.loading.tokenizer import Tokenizer
from tokenmill.server.openai_inputs import chat_prompt
from tokenmill.server.protocol import ChatMessage, ChatRequest


def turns_of(messages: list[ChatMessage]) -> tuple[list[ChatMessage], list[list[ChatMessage]]]:
    """The leading system messages (the instructions), and the rest in turns that are dropped whole."""
    lead = 0
    while lead < len(messages) and messages[lead].role == "system":
        lead += 1
    turns: list[list[ChatMessage]] = []
    for message in messages[lead:]:
        if message.role == "tool" and turns and turns[-1][0].role == "assistant" and turns[-1][0].tool_calls:
            turns[-1].append(message)  # an output stays with its call
        else:
            turns.append([message])
    return messages[:lead], turns


def fit_conversation(messages: list[ChatMessage], fits: Callable[[list[ChatMessage]], bool]) -> list[ChatMessage]:
    """`messages` without the fewest oldest turns that makes `fits` true (all of them if it already is; only
    the newest turn kept if nothing else does: `fits` is then left to fail where the request is built)."""
    if fits(messages):
        return messages
    system, turns = turns_of(messages)

    def kept(num_dropped: int) -> list[ChatMessage]:
        return system + [m for turn in turns[num_dropped:] for m in turn]

    low, high = 1, max(1, len(turns) - 1)  # dropping `high` turns keeps only the newest
    while low < high:  # the fewest dropped that fit: fitting is monotone in the number dropped
        middle = (low + high) // 2
        if fits(kept(middle)):
            high = middle
        else:
            low = middle + 1
    return kept(low)


def fit_chat_request(chat: ChatRequest, tokenizer: Tokenizer, max_model_len: int) -> ChatRequest:
    """`chat` with the fewest oldest turns left out that let its prompt and its asked output (at least one
    token) fit the context."""
    room = chat.max_output_tokens or 1

    def fits(messages: list[ChatMessage]) -> bool:
        prompt = chat_prompt(tokenizer, messages, chat.add_generation_prompt, chat.tools,
                             continue_final=chat.continue_final_message, template_kwargs=chat.chat_template_kwargs)
        return len(prompt.token_ids) + room <= max_model_len

    messages = fit_conversation(chat.messages, fits)
    return chat if messages is chat.messages else chat.model_copy(update={"messages": messages})
