"""`tokenmill batch` answers a body as the server does: the same choices, logprobs in each format, echo,
prompt_logprobs and Responses API items (both build answers with server/choices.py and
server/responses_output.py; this holds the batch job's plumbing to it)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL, LiveServer
from tokenmill.batch.runner import run_batch
from tokenmill.llm import LLM

_CHAT = [{"role": "user", "content": "Name a colour."}]
BODIES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 4, "logprobs": 2}),
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 3, "logprobs": 1, "echo": True}),
    ("/v1/completions", {"prompt": ["one two", "three"], "max_tokens": 2, "n": 2, "prompt_logprobs": 2}),
    ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 3, "logprobs": 0, "echo": True, "prompt_logprobs": 3,
                         "return_tokens_as_token_ids": True}),
    ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 2}),
    ("/v1/chat/completions", {"messages": _CHAT, "max_tokens": 2, "n": 2, "prompt_logprobs": 1}),
    ("/v1/responses", {"input": "Name a colour.", "instructions": "Be brief.", "max_output_tokens": 4,
                       "top_logprobs": 2, "store": False}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
                       "max_output_tokens": 40, "store": False, "tool_choice": "required", "ignore_eos": False,
                       "parallel_tool_calls": False,
                       "tools": [{"type": "function", "name": "f", "parameters": {
                           "type": "object", "properties": {"x": {"enum": ["a", "b"]}}, "required": ["x"]}}]}),
]
# ids, times and what differs by design (the server's class and cache hits; a batch line's class is batch)
_IGNORED = {"id", "created", "created_at", "call_id", "tokenmill", "service_tier", "prompt_tokens_details",
            "input_tokens_details"}


def _same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, abs_tol=1e-4), where
    elif isinstance(a, dict):
        assert isinstance(b, dict), (where, a, b)
        assert set(a) - _IGNORED == set(b) - _IGNORED, (where, sorted(a), sorted(b))
        for key in set(a) - _IGNORED:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def batch_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), dtype="float32", device="cpu", num_kv_blocks=256)


def test_batch_lines_answer_as_the_server(live: LiveServer, batch_llm: LLM, tmp_path: Path) -> None:
    common = {"model": MODEL, "temperature": 0.0, "ignore_eos": True}
    lines = [json.dumps({"custom_id": str(i), "method": "POST", "url": url, "body": {**common, **body}})
             for i, (url, body) in enumerate(BODIES)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    summary = run_batch(batch_llm, tmp_path / "in.jsonl", tmp_path / "out.jsonl", model_name=MODEL, progress=False)
    assert summary.num_succeeded == len(BODIES), (tmp_path / "out.jsonl").read_text()
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    answered = {r["custom_id"]: r["response"] for r in records}
    for i, (url, body) in enumerate(BODIES):
        served = httpx.post(f"{live.url}{url}", json={**common, **body}, timeout=60)
        assert served.status_code == 200, served.text
        assert answered[str(i)]["status_code"] == 200
        if body.get("tools"):
            assert [item["type"] for item in served.json()["output"]] == ["function_call"]  # not vacuous
        _same(served.json(), answered[str(i)]["body"], f"{url} {body}")
