"""The routing key of a request: a session id when the client names one, else its prompt's prefix.

The prefix is the first `num_chars` characters of the prompt as the model would read it
(chat messages as role/content lines), so requests that share a system prompt and history land
on the replica whose prefix cache already holds them. Characters, not tokens: the gateway has
no tokenizer, and at ~4 characters a token 256 characters cover a few KV blocks.

A body's `cache_salt` leads the prefix key: a salted request can only reuse blocks of its own salt
(engine/block_hash.py), so each tenant's shared system prompt gets its own home replica instead of
every tenant's piling onto one replica where none of them can use the others' blocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Headers a client may use to pin a conversation (vLLM production-stack and SGLang router spellings).
SESSION_HEADERS = ("x-session-id", "x-user-id")


def route_prefix(body: Any, headers: Mapping[str, str], num_chars: int) -> str | None:
    for header in SESSION_HEADERS:
        if headers.get(header):
            return f"session:{headers[header]}"
    if not isinstance(body, dict):
        return None
    text = _prompt_text(body)
    if not text:
        return None
    salt = body.get("cache_salt")
    return f"salt:{salt}\n{text[:num_chars]}" if isinstance(salt, str) and salt else text[:num_chars]


def _prompt_text(body: dict[str, Any]) -> str | None:
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(_message_text(m) for m in messages if isinstance(m, dict))
    if "input" in body:  # the Responses API: instructions, then the input string or items
        return _responses_text(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of prompts: route by the first
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):  # token ids
        return " ".join(str(token) for token in prompt)
    return None


def _message_text(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return f"{message.get('role', '')}: {content if isinstance(content, str) else ''}\n"


def _responses_text(body: dict[str, Any]) -> str | None:
    instructions = body.get("instructions")
    text = f"system: {instructions}\n" if isinstance(instructions, str) and instructions else ""
    items = body.get("input")
    if isinstance(items, str):
        return text + f"user: {items}\n"
    if not isinstance(items, list):
        return text or None
    for item in items:
        if not isinstance(item, dict):
            continue
        if item.get("type", "message") == "message":
            text += _message_text(item)
        else:  # function calls and their outputs: the history an agent's next turn repeats
            text += f"{item.get('type')}: {item.get('name', '')}{item.get('arguments', '')}{item.get('output', '')}\n"
    return text
