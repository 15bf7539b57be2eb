"""The OpenAI Agents SDK (`openai-agents`) runs agents against tokenmill: its Responses and chat-completions
models, streamed and not, call a tool and finish. On the tiny random model the first turn's call is forced
(tool_choice required; the SDK then resets it to auto, as it does by default); with Qwen2.5-Coder-1.5B (slow)
the model decides, and must answer after the tool's result instead of calling again (written_calls.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from tests.server.conftest import MODEL, LiveServer, serve_real_model

agents = pytest.importorskip("agents")
openai = pytest.importorskip("openai")
agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers


def _run(live: LiveServer, model: str, api: str, stream: bool, settings: dict[str, Any],
         question: str) -> tuple[Any, list[str]]:
    calls: list[str] = []

    @agents.function_tool
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The current time in a time zone (utc or cet)."""
        calls.append(zone)
        return f"It is 12:00 in {zone}."

    async def main() -> Any:
        client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
        kind = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
        agent = agents.Agent(name="clock", instructions="Use the tool, then answer with its result.",
                             tools=[get_time], model=kind(model, client),
                             model_settings=agents.ModelSettings(temperature=0.0, **settings))
        if not stream:
            return await agents.Runner.run(agent, question, max_turns=4)
        result = agents.Runner.run_streamed(agent, question, max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(main()), calls


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_an_agent_calls_its_tool_and_finishes(structured_live: LiveServer, api: str, stream: bool) -> None:
    # The random model would write to max_tokens after the call (a streamed Responses run then ends incomplete,
    # which the SDK raises on): its end-of-text token is pushed, which the call's grammar still holds back
    eos = structured_live.engine.tokenizer.eos_token_id
    settings = {"tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60,
                "extra_body": {"logit_bias": {str(eos): 100}}}
    result, calls = _run(structured_live, MODEL, api, stream, settings, "What time is it?")
    assert len(calls) == 1 and calls[0] in ("utc", "cet")
    assert isinstance(result.final_output, str)


@pytest.fixture(scope="module")
def coder() -> Iterator[LiveServer]:
    yield from serve_real_model("qwen2.5-coder-1.5b", num_blocks=512)


@pytest.mark.slow
@pytest.mark.parametrize("api", ["responses", "chat"])
def test_a_real_agent_answers_after_the_tools_result(coder: LiveServer, api: str) -> None:
    """Qwen2.5-Coder-1.5B writes calls as ```json blocks; shown them back as written it called the tool after
    every result until max_turns (written_calls.py). It must call once and answer."""
    _, calls = _run(coder, "qwen2.5-coder-1.5b", api, False, {"max_tokens": 80}, "What time is it in utc?")
    assert calls == ["utc"]
