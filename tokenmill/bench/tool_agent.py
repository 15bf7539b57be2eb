"""The agent archetype with real tool calls: prefix reuse and constrained decoding measured together.

Every request carries the same OpenAI `tools` (a coding agent's four functions) with
`tool_choice: "required"` and `parallel_tool_calls: false`. The server's chat template writes the
tools into the system prompt, after the workload's long system text, so every turn of every
session shares that prefix. Each reply is one tool call, decoded under the server's JSON-schema
grammar (required calls are enforced, as vLLM and tokenmill do); the bench reassembles it from the
streamed `delta.tool_calls` and appends it to the conversation as an assistant `tool_calls` message,
and the next turn appends the tool's result as a `role: "tool"` message answering that call's id
(sessions.Conversation). String arguments have a `maxLength`, so a call completes inside the turn's
max_tokens (with ignore_eos the rest is stop tokens).

Imports `workloads` and registers itself there; `workloads` imports this module at its end, so the
registration happens whichever of the two is imported first.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tokenmill.bench.metrics import SLO
from tokenmill.bench.sessions import Session, Turn
from tokenmill.bench.tokens import PromptFactory
from tokenmill.bench.workloads import WORKLOADS, Agent, WorkloadParams, jittered


def _function(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": list(properties),
                       "additionalProperties": False}}}


TOOLS: tuple[dict[str, Any], ...] = (
    _function("run_python", "Run a Python snippet in the project's sandbox and return its output.",
              {"code": {"type": "string", "maxLength": 160}, "timeout_s": {"type": "integer", "minimum": 1,
                                                                          "maximum": 60}}),
    _function("read_file", "Read a file of the project.", {"path": {"type": "string", "maxLength": 60}}),
    _function("search_code", "Search the project's code for a pattern.",
              {"pattern": {"type": "string", "maxLength": 40}, "max_results": {"type": "integer", "minimum": 1,
                                                                               "maximum": 20}}),
    _function("write_file", "Replace a file of the project.", {"path": {"type": "string", "maxLength": 60},
                                                               "content": {"type": "string", "maxLength": 160}}),
)


class ToolAgent(Agent):
    name = "tool_agent"
    description = ("agent with tool calls: tools in the system prompt, one required call per turn (JSON-schema "
                   "grammar), tool results appended; prefix reuse + constrained decoding; E2E budget")
    preamble = ("You are a coding agent working in a Python project. Each turn, call exactly one tool; read its "
                "result and decide the next call.")
    tools: tuple[dict[str, Any], ...] = TOOLS

    def default_params(self) -> WorkloadParams:
        # output_len: room for the longest call (160-character strings) with its JSON around it.
        return WorkloadParams(num_sessions=8, turns=4, input_len=128, output_len=96, system_len=768)

    def default_slo(self) -> SLO:
        return SLO(e2e_s=10.0)

    async def _session(self, params: WorkloadParams, system: tuple[str, int] | None, prompts: PromptFactory,
                       rng: np.random.Generator) -> Session:
        session = await super()._session(params, system, prompts, rng)
        return dataclasses.replace(session, tools=self.tools, tool_choice="required",
                                   parallel_tool_calls=False)

    async def _turn(self, params: WorkloadParams, index: int, prompts: PromptFactory,
                    rng: np.random.Generator) -> Turn:
        num_tokens = jittered(params.input_len, params.range_ratio, rng)
        text = await prompts.text(self.text_kind, num_tokens, rng)
        if index == 0:
            return Turn(f"Fix this module:\n```python\n{text}\n```", num_tokens,
                        jittered(params.output_len, params.range_ratio, rng))
        # The previous call's result (a code excerpt as a read_file/search/run output would give).
        return Turn(text, num_tokens, jittered(params.output_len, params.range_ratio, rng), role="tool")


WORKLOADS[ToolAgent.name] = ToolAgent()
