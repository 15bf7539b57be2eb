"""/v1/conversations (OpenAI's Conversations API) through the official client, a response given
`conversation` (answers from its items, appends its input and output), the 400s and 404s, and the Agents
SDK's OpenAIConversationsSession keeping an agent's history on the server."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, start_server
from tokenmill.config import ServerConfig

GREEDY: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}


def _user(text: str, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text, **extra}


def test_a_conversation_and_its_items_are_created_read_changed_and_deleted(client: openai.OpenAI) -> None:
    conv = client.conversations.create(items=[_user("a", id="msg_a"), _user("b")], metadata={"topic": "x"})
    assert conv.id.startswith("conv_") and conv.metadata == {"topic": "x"}
    assert client.conversations.retrieve(conv.id).created_at == conv.created_at
    assert client.conversations.update(conv.id, metadata={"topic": "y"}).metadata == {"topic": "y"}
    added = client.conversations.items.create(conv.id, items=[_user("c"), {
        "type": "function_call_output", "call_id": "call_1", "output": "42"}])
    assert [i.type for i in added.data] == ["message", "function_call_output"]
    asc = [i.id for i in client.conversations.items.list(conv.id, order="asc", limit=1)]  # the SDK pages
    assert asc[0] == "msg_a" and len(asc) == 4
    assert [i.id for i in client.conversations.items.list(conv.id)] == asc[::-1]  # newest first by default
    item = client.conversations.items.retrieve("msg_a", conversation_id=conv.id)
    assert item.type == "message" and item.content[0].text == "a"  # type: ignore[union-attr]
    after = client.conversations.items.delete("msg_a", conversation_id=conv.id)
    assert after.id == conv.id and [i.id for i in client.conversations.items.list(conv.id, order="asc")] == asc[1:]
    assert client.conversations.delete(conv.id).deleted is True
    with pytest.raises(openai.NotFoundError):
        client.conversations.retrieve(conv.id)


def test_a_response_answers_from_its_conversation_and_appends_to_it(client: openai.OpenAI) -> None:
    conv = client.conversations.create(items=[_user("My name is Ann.")])
    first = client.responses.create(model=MODEL, conversation=conv.id, input="And yours?", max_output_tokens=5,
                                    extra_body=GREEDY)
    chat = client.chat.completions.create(model=MODEL, max_tokens=5, extra_body=GREEDY, messages=[
        {"role": "user", "content": "My name is Ann."}, {"role": "user", "content": "And yours?"}])
    assert first.output_text == chat.choices[0].message.content
    assert first.conversation is not None and first.conversation.id == conv.id
    items = list(client.conversations.items.list(conv.id, order="asc"))
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"), ("message", "user"), ("message", "assistant")]
    assert items[2].id == first.output[0].id
    second = client.responses.create(model=MODEL, conversation={"id": conv.id}, input="Thanks.",
                                     max_output_tokens=2, extra_body=GREEDY)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + 5  # the first answer is in its prompt
    assert len(list(client.conversations.items.list(conv.id))) == 5
    listed = [i.id for i in client.responses.input_items.list(second.id, order="asc")]
    assert listed[:3] == [i.id for i in items]


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/responses", {"input": "x", "conversation": "conv_nope"}, 404, "conversation"),
    ("/v1/responses", {"input": "x", "conversation": {"name": "x"}}, 400, "conversation"),
    ("/v1/responses", {"input": "x", "conversation": "conv_1", "previous_response_id": "resp_1"}, 400,
     "conversation"),
    ("/v1/conversations", {"items": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "items"),
    ("/v1/conversations", {"items": [_user("x")] * 21}, 400, "items"),
    ("/v1/conversations", {"metadata": {"k": "v" * 513}}, 400, "metadata"),
    ("/v1/conversations/conv_nope/items", {"items": [_user("x")]}, 404, None),
])
def test_bad_conversation_requests_are_clear_errors(structured_live: LiveServer, path: str, body: dict[str, Any],
                                                    status: int, param: str | None) -> None:
    response = httpx.post(f"{structured_live.url}{path}", json={"model": MODEL, **body})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_an_agents_sdk_session_keeps_its_history_in_a_conversation(structured_live: LiveServer,
                                                                    client: openai.OpenAI) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    eos = structured_live.engine.tokenizer.eos_token_id  # pushed: a turn ends at once (incomplete ones raise)

    async def main() -> tuple[str, list[Any], str]:
        sdk_client = openai.AsyncOpenAI(base_url=f"{structured_live.url}/v1", api_key="unused", max_retries=0)
        session = agents.OpenAIConversationsSession(openai_client=sdk_client)
        agent = agents.Agent(name="echo", instructions="Be brief.",
                             model=agents.OpenAIResponsesModel(MODEL, sdk_client),
                             model_settings=agents.ModelSettings(temperature=0.0, max_tokens=8,
                                                                 extra_body={"logit_bias": {str(eos): 100}}))
        await agents.Runner.run(agent, "Hello", session=session, max_turns=1)
        await agents.Runner.run(agent, "Again", session=session, max_turns=1)
        # the other way: the SDK names the conversation, and the server keeps the history
        server_side = await sdk_client.conversations.create()
        for text in ("Hello", "Again"):
            await agents.Runner.run(agent, text, conversation_id=server_side.id, max_turns=1)
        return await session._get_session_id(), await session.get_items(), server_side.id

    conv_id, items, server_side_id = asyncio.run(main())
    roles = [(item.get("type", "message"), item.get("role")) for item in items]
    assert roles == [("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "assistant")]
    assert len(list(client.conversations.items.list(conv_id))) == 4
    kept = list(client.conversations.items.list(server_side_id, order="asc"))
    assert [getattr(i, "role", None) for i in kept] == ["user", "assistant", "user", "assistant"]


def test_a_server_that_keeps_no_conversations_answers_400_on_both_paths(structured_live: LiveServer) -> None:
    server = start_server(structured_live.engine, ServerConfig(served_model_name=MODEL, responses_store_size=0))
    try:
        named = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "x", "conversation": "c"})
        created = httpx.post(f"{server.url}/v1/conversations", json={})
    finally:
        server.stop()
    assert (named.status_code, named.json()["error"]["param"]) == (400, "conversation"), named.text
    assert created.status_code == 400 and "keeps no conversations" in created.json()["error"]["message"]
