"""User-supplied prompts: JSONL (one object per line) or a JSON array, in one of three shapes.

    {"prompt": "...", "output_len": 128}                            one single-turn session
    {"messages": [{"role": "system"|"user"|..., "content": "..."}]}  a session of the user turns
    {"conversations": [{"from": "human"|"gpt"|"system", "value": "..."}]}   ShareGPT

Assistant messages in the file are not sent: each later turn follows the model's own reply. In
ShareGPT, as in vLLM, a turn's output length is the token count of the reply that follows it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.errors import BenchError
from tokenmill.bench.sessions import Session, Turn
from tokenmill.bench.tokens import PromptFactory

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "assistant": "assistant", "system": "system"}


def read_records(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
        if text.lstrip().startswith("["):
            items = json.loads(text)
        else:
            items = [json.loads(line) for line in text.splitlines() if line.strip()]
    except (OSError, ValueError) as exc:
        raise BenchError(f"cannot read the dataset {path}: {exc}") from exc
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise BenchError(f"the dataset {path} must hold JSON objects (JSONL or a JSON array)")
    return items


def as_messages(item: dict[str, Any]) -> list[tuple[str, str]]:
    """(role, text) pairs of one record, whatever its shape."""
    if "prompt" in item:
        return [("user", str(item["prompt"]))]
    if "messages" in item:
        return [(str(m.get("role", "user")), str(m.get("content", ""))) for m in item["messages"]]
    if "conversations" in item:
        return [(_SHAREGPT_ROLES.get(str(m.get("from")), "user"), str(m.get("value", "")))
                for m in item["conversations"]]
    raise BenchError("each dataset record needs `prompt`, `messages` or `conversations` (ShareGPT); "
                     f"got keys {sorted(item)}")


async def load_sessions(path: Path, num_sessions: int, max_turns: int, default_output_len: int,
                        prompts: PromptFactory, rng: np.random.Generator) -> list[Session]:
    """`num_sessions` records sampled without replacement (with, if the file is smaller)."""
    items = [item for item in read_records(path) if any(role == "user" for role, _ in as_messages(item))]
    if not items:
        raise BenchError(f"the dataset {path} has no record with a user message")
    picks = rng.choice(len(items), size=num_sessions, replace=num_sessions > len(items))
    return [await _session(items[int(i)], max_turns, default_output_len, prompts) for i in picks]


async def _session(item: dict[str, Any], max_turns: int, default_output_len: int, prompts: PromptFactory) -> Session:
    messages = as_messages(item)
    system = next((text for role, text in messages if role == "system"), None)
    turns: list[Turn] = []
    for index, (role, text) in enumerate(messages):
        if role != "user" or len(turns) == max_turns:
            continue
        output_len = await _output_len(item, messages, index, default_output_len, prompts)
        turns.append(Turn(text, await prompts.count(text), output_len))
    system_tokens = await prompts.count(system) if system is not None else 0
    return Session(tuple(turns), system, system_tokens)


async def _output_len(item: dict[str, Any], messages: list[tuple[str, str]], index: int, default: int,
                      prompts: PromptFactory) -> int:
    if "output_len" in item:
        return max(1, int(item["output_len"]))
    following = messages[index + 1] if index + 1 < len(messages) else None
    if "conversations" in item and following is not None and following[0] == "assistant":
        return max(1, await prompts.count(following[1]))
    return default
