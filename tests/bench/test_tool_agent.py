"""The tool-calling agent against a real `tokenmill serve` of the tiny model: every request carries
the tools with a required call, every reply is a call whose arguments fit its schema (the server's
grammar), reassembled from the streamed deltas, and every later turn answers the previous call's
id with a tool message, re-sending the conversation so far (the prefix cache hits)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from tests.bench.test_end_to_end import bench
from tokenmill.bench import runner
from tokenmill.bench.tool_agent import ToolAgent, _function
from tokenmill.bench.workloads import WORKLOADS

# Short calls: the tiny model's vocabulary is byte-level and its context 256 tokens.
SMALL_TOOLS = (_function("lookup", "Look a key up.", {"key": {"enum": ["a", "b", "c"]}}),
               _function("run", "Run step n.", {"n": {"type": "integer", "minimum": 0, "maximum": 9}}))


def test_tool_agent_round_trips_calls_against_tokenmill_serve(served_url: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    workload = WORKLOADS["tool_agent"]
    assert isinstance(workload, ToolAgent)
    monkeypatch.setattr(workload, "tools", SMALL_TOOLS)
    monkeypatch.setattr(workload, "preamble", "Call a tool.")
    seen: list[tuple[dict[str, Any], list[dict[str, Any]], str]] = []
    real = runner.send_message

    async def recording(*args: Any) -> tuple[str, list[dict[str, Any]]]:
        text, calls = await real(*args)
        seen.append((args[3], calls, text))
        return text, calls

    monkeypatch.setattr(runner, "send_message", recording)
    doc = bench(["run", "--target", served_url, "--workload", "tool_agent", "--num-sessions", "2", "--turns", "2",
                 "--input-len", "4", "--output-len", "56", "--system-len", "4", "--rate", "20", "--no-plots"],
                tmp_path)
    [run] = doc["runs"]
    metrics = run["metrics"]
    assert (metrics["num_completed"], metrics["errors"]) == (4, {})
    assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in run["requests"])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in SMALL_TOOLS}
    call_ids: set[str] = set()
    for payload, calls, text in seen:
        assert payload["tools"] == list(SMALL_TOOLS) and payload["tool_choice"] == "required"
        assert payload["parallel_tool_calls"] is False
        assert len(calls) == 1, (text, calls)
        call = calls[0]
        assert call["id"].startswith("call_") and call["function"]["name"] in schemas
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        call_ids.add(call["id"])
    answers = [p["messages"] for p, _, _ in seen if p["messages"][-1]["role"] == "tool"]
    assert len(answers) == 2  # turn 1 of both sessions
    for messages in answers:
        assistant, tool = messages[-2], messages[-1]
        assert assistant["role"] == "assistant" and len(assistant["tool_calls"]) == 1
        assert tool["tool_call_id"] == assistant["tool_calls"][0]["id"] in call_ids
    assert run["server_metrics"]["prefix_cache_hit_rate"] > 0.3
