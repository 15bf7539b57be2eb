"""Prompts of controlled length, workloads' sessions and user datasets, with the offline tokenizer."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from tokenmill.bench.corpus import TextKind
from tokenmill.bench.datasets import load_sessions
from tokenmill.bench.errors import BenchError
from tokenmill.bench.sessions import Api, Conversation
from tokenmill.bench.tokens import ApproxTokenizer, PromptFactory, chunks
from tokenmill.bench.workloads import WorkloadParams, get_workload, jittered


@pytest.fixture(scope="module")
def prompts() -> PromptFactory:
    return PromptFactory(ApproxTokenizer())


def test_prompts_have_the_asked_token_count(prompts: PromptFactory) -> None:
    rng = np.random.default_rng(0)
    for num_tokens in (1, 17, 300):
        text = asyncio.run(prompts.text(TextKind.PROSE, num_tokens, rng))
        assert asyncio.run(prompts.count(text)) == num_tokens
    # Longer than the corpus: it wraps around; re-encoding shifts a few pieces at chunk seams.
    wrapped = asyncio.run(prompts.text(TextKind.PROSE, 40_000, rng))
    assert asyncio.run(prompts.count(wrapped)) == pytest.approx(40_000, rel=0.01)
    code = asyncio.run(prompts.text(TextKind.CODE, 200, rng))
    assert "def " in code or "class " in code or "return" in code


def test_chunks_cover_the_text_and_cut_at_newlines() -> None:
    text = "".join(f"line {i}\n" for i in range(2000))
    pieces = chunks(text, 500)
    assert "".join(pieces) == text and all(p.endswith("\n") for p in pieces)


def test_workloads_build_same_sessions_for_same_seed(prompts: PromptFactory) -> None:
    params = WorkloadParams(num_sessions=4, turns=3, input_len=20, output_len=7, system_len=50, prefix_groups=2)
    agent = get_workload("agent")
    first = asyncio.run(agent.build_sessions(params, prompts, np.random.default_rng(5)))
    again = asyncio.run(agent.build_sessions(params, prompts, np.random.default_rng(5)))
    assert first == again and len(first) == 4 and all(len(s.turns) == 3 for s in first)
    assert first[0].system == first[2].system != first[1].system  # two shared-prefix groups
    assert first[0].system is not None and first[0].system.startswith(agent.preamble)
    assert first[0].turns[1].content.startswith("Tool output") and first[0].turns[0].max_tokens == 7


def test_range_ratio_jitters_lengths_within_bounds() -> None:
    rng = np.random.default_rng(0)
    values = [jittered(100, 0.25, rng) for _ in range(500)]
    assert min(values) >= 75 and max(values) <= 125 and len(set(values)) > 20
    with pytest.raises(BenchError):
        WorkloadParams(num_sessions=0, turns=1, input_len=1, output_len=1)


def test_conversation_grows_with_the_models_replies(prompts: PromptFactory) -> None:
    session = asyncio.run(get_workload("chatbot").build_sessions(
        WorkloadParams(num_sessions=1, turns=2, input_len=5, output_len=3, system_len=4), prompts,
        np.random.default_rng(0)))[0]
    conversation = Conversation(session)
    conversation.ask(session.turns[0])
    conversation.answer("reply one")
    conversation.ask(session.turns[1])
    roles = [m["role"] for m in conversation.payload(Api.CHAT)["messages"]]
    assert roles == ["system", "user", "assistant", "user"]
    assert "reply one" in conversation.payload(Api.COMPLETIONS)["prompt"]


def test_sharegpt_and_plain_jsonl(tmp_path: Path, prompts: PromptFactory) -> None:
    sharegpt = [{"conversations": [{"from": "system", "value": "Be terse."}, {"from": "human", "value": "Hi there"},
                                   {"from": "gpt", "value": "Hello! How can I help?"},
                                   {"from": "human", "value": "Tell me more"}]},
                {"conversations": [{"from": "gpt", "value": "no human turn: skipped"}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(sharegpt))
    [session] = asyncio.run(load_sessions(path, 1, 5, 9, prompts, np.random.default_rng(0)))
    assert session.system == "Be terse." and [t.content for t in session.turns] == ["Hi there", "Tell me more"]
    assert session.turns[0].max_tokens == len("Hello! How can I help?") // 4 + 1  # reply tokens, approx pieces
    assert session.turns[1].max_tokens == 9  # no reply follows: the default
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"prompt": "abc", "output_len": 4}\n\n{"messages": [{"role": "user", "content": "q"}]}\n')
    sessions = asyncio.run(load_sessions(plain, 5, 1, 2, prompts, np.random.default_rng(0)))
    assert len(sessions) == 5 and {s.turns[0].max_tokens for s in sessions} <= {4, 2}


def test_bad_dataset_says_what_is_expected(tmp_path: Path, prompts: PromptFactory) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "no known key"}\n')
    with pytest.raises(BenchError, match="prompt`, `messages` or `conversations"):
        asyncio.run(load_sessions(path, 1, 1, 1, prompts, np.random.default_rng(0)))
