"""Background responses (`background: true` on /v1/responses) and the endpoints around them (GET with
stream/starting_after, cancel, DELETE, input_items), through the official `openai` client and raw HTTP
against a live server on the tiny model, its engine slowed where a job must still be running."""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, NUM_KV_BLOCKS, LiveServer, start_server, tiny_engine_config, wait_until
from tests.server.test_failures import slowed
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine

LONG: dict[str, Any] = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def bg_live(tiny_hf_dir) -> Iterator[LiveServer]:  # type: ignore[no-untyped-def]
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_hf_dir("llama")))
    server = start_server(engine, ServerConfig(served_model_name=MODEL, api_key="k1",
                                               api_key_classes=(("k2", "standard"),)))
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture
def client(bg_live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{bg_live.url}/v1", api_key="k1", max_retries=0)


def _create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(model=MODEL, extra_body={**LONG, **kwargs.pop("extra_body", {})}, **kwargs)


def _idle(live: LiveServer) -> bool:
    engine = live.engine
    return (engine.num_in_flight == 0 and engine.core.kv.pool.num_free == NUM_KV_BLOCKS
            and live.state.admission.num_in_flight == 0)


def _poll(client: openai.OpenAI, response_id: str) -> Any:
    wait_until(lambda: client.responses.retrieve(response_id).status not in ("queued", "in_progress"),
               what="the background response to end")
    return client.responses.retrieve(response_id)


def test_a_background_response_answers_at_once_and_ends_as_the_foreground_one(client: openai.OpenAI,
                                                                               bg_live: LiveServer) -> None:
    foreground = _create(client, input="Tell me a story", max_output_tokens=24)
    with slowed(bg_live.engine):
        started = time.monotonic()
        queued = _create(client, input="Tell me a story", max_output_tokens=24, background=True)
        assert time.monotonic() - started < 1.0  # 24 steps of 50 ms would take longer
        assert queued.background is True and queued.status in ("queued", "in_progress") and queued.usage is None
        assert bg_live.state.admission.num_in_flight == 1  # it holds its admission ticket: a drain waits for it
        done = _poll(client, queued.id)
    assert done.status == "incomplete" and done.background is True and done.store is True
    assert done.output_text == foreground.output_text and done.usage.output_tokens == 24
    assert done.service_tier == "standard"  # not the interactive class a person waiting on a chat gets
    wait_until(lambda: _idle(bg_live), what="an idle engine")


def test_its_stream_resumes_from_any_sequence_number(client: openai.OpenAI) -> None:
    events = list(_create(client, input="abc", max_output_tokens=10, background=True, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.queued", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.incomplete" and events[0].response.status == "queued"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    for after in (0, 3, len(events) - 2, len(events) - 1):
        resumed = list(client.responses.retrieve(events[0].response.id, stream=True, starting_after=after))
        assert [e.model_dump() for e in resumed] == [e.model_dump() for e in events[after + 1:]]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text == client.responses.retrieve(events[0].response.id).output_text


def test_a_client_leaving_its_stream_does_not_stop_the_job(client: openai.OpenAI, bg_live: LiveServer) -> None:
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 30, "background": True, "stream": True, **LONG}
    with slowed(bg_live.engine, 0.03), httpx.stream("POST", f"{bg_live.url}/v1/responses", json=body, timeout=30,
                                                    headers={"authorization": "Bearer k1"}) as response:
        first = json.loads(next(line for line in response.iter_lines() if line).removeprefix("data: "))
    response_id = first["response"]["id"]
    done = _poll(client, response_id)
    assert done.status == "incomplete" and done.usage.output_tokens == 30


def test_cancel_stops_a_running_job_frees_its_blocks_and_is_idempotent(client: openai.OpenAI,
                                                                      bg_live: LiveServer) -> None:
    with slowed(bg_live.engine):
        job = _create(client, input="hello", max_output_tokens=200, background=True)
        wait_until(lambda: len(client.responses.retrieve(job.id).output_text) > 0, what="some output")
        running = client.responses.retrieve(job.id)
        assert running.status == "in_progress" and running.output[0].status == "in_progress"
        assert [item.content[0].text for item in client.responses.input_items.list(job.id)] == ["hello"]
        cancelled = client.responses.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.output_text.startswith(running.output_text)
    assert cancelled.output[0].status == "incomplete"  # the message it was writing
    wait_until(lambda: _idle(bg_live), what="the cancelled job's blocks and ticket back")
    again = client.responses.cancel(job.id)
    assert again.model_dump() == cancelled.model_dump()
    assert client.responses.retrieve(job.id).status == "cancelled"
    # its stream ends where the job ended
    events = list(client.responses.retrieve(job.id, stream=True))
    assert events[0].type == "response.created" and events[-1].type != "response.completed"


def test_cancel_is_only_for_background_responses(client: openai.OpenAI, bg_live: LiveServer) -> None:
    foreground = _create(client, input="x", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
    ended = _poll(client, _create(client, input="x", max_output_tokens=2, background=True).id)
    assert client.responses.cancel(ended.id).model_dump() == ended.model_dump()  # ended: unchanged, not an error
    with pytest.raises(openai.BadRequestError, match="only background responses stream"):
        list(client.responses.retrieve(foreground.id, stream=True))


@pytest.mark.parametrize("body", [{"store": False}, {}])
def test_a_background_response_must_be_stored(bg_live: LiveServer, body: dict[str, Any]) -> None:
    if body:
        url, headers = bg_live.url, {"authorization": "Bearer k1"}
        response = httpx.post(f"{url}/v1/responses", headers=headers,
                              json={"model": MODEL, "input": "x", "background": True, **body})
    else:  # a server that keeps no responses
        server = start_server(bg_live.engine, ServerConfig(served_model_name=MODEL, responses_store_size=0))
        try:
            response = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "x", "background": True})
        finally:
            server.stop()
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "background"


def test_a_running_response_cannot_be_continued_until_it_ends(client: openai.OpenAI, bg_live: LiveServer) -> None:
    with slowed(bg_live.engine):
        job = _create(client, input="My name is Ann.", max_output_tokens=40, background=True)
        with pytest.raises(openai.BadRequestError, match="still") as caught:
            _create(client, previous_response_id=job.id, input="And yours?", max_output_tokens=2)
        assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
        _poll(client, job.id)
    follow_up = _create(client, previous_response_id=job.id, input="And yours?", max_output_tokens=2)
    assert follow_up.status == "incomplete"


def test_input_items_list_the_conversation_with_ids_and_pages(client: openai.OpenAI) -> None:
    first = _create(client, input="My name is Ann.", max_output_tokens=3)
    second = _create(client, previous_response_id=first.id, max_output_tokens=3, input=[
        {"role": "user", "content": "And yours?"},
        {"type": "message", "role": "user", "id": "msg_mine", "content": [{"type": "input_text", "text": "Hm?"}]}])
    listed = client.responses.input_items.list(second.id, order="asc")
    kinds = [(item.type, getattr(item, "role", None)) for item in listed.data]
    assert kinds == [("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "user")]
    assert listed.data[1].id == first.output[0].id and listed.data[3].id == "msg_mine"
    assert listed.data[0].content[0].text == "My name is Ann." and listed.has_more is False
    assert [i.id for i in client.responses.input_items.list(second.id).data] == [i.id for i in listed.data][::-1]
    page = client.responses.input_items.list(second.id, order="asc", limit=2, after=listed.data[0].id)
    assert [i.id for i in page.data] == [i.id for i in listed.data[1:3]] and page.has_more is True
    every = [i.id for i in client.responses.input_items.list(second.id, order="asc", limit=1)]  # the SDK pages
    assert every == [i.id for i in listed.data]
    before = client.responses.input_items.list(second.id, order="asc", limit=2, extra_query={"before": "msg_mine"})
    assert [i.id for i in before.data] == [i.id for i in listed.data[1:3]] and before.has_more is True  # previous page
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(second.id, after="msg_nope")


def test_delete_stops_a_running_job_and_forgets_it(client: openai.OpenAI, bg_live: LiveServer) -> None:
    with slowed(bg_live.engine):
        job = _create(client, input="hello", max_output_tokens=200, background=True)
        assert client.responses.delete(job.id) is None
    wait_until(lambda: _idle(bg_live), what="the deleted job's blocks back")
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(job.id)


def test_another_key_neither_sees_nor_cancels_a_job(client: openai.OpenAI, bg_live: LiveServer) -> None:
    other = openai.OpenAI(base_url=f"{bg_live.url}/v1", api_key="k2", max_retries=0)
    with slowed(bg_live.engine):
        job = _create(client, input="hello", max_output_tokens=40, background=True)
        for call in (other.responses.retrieve, other.responses.cancel, other.responses.input_items.list):
            with pytest.raises(openai.NotFoundError):
                call(job.id)
        assert client.responses.retrieve(job.id).status in ("queued", "in_progress")
        client.responses.cancel(job.id)


def test_an_engine_failure_ends_the_job_as_failed(client: openai.OpenAI, bg_live: LiveServer) -> None:
    steps = itertools.count()

    def crash_later() -> None:
        time.sleep(0.02)
        if next(steps) >= 5:
            raise RuntimeError("injected fault")

    bg_live.engine.fault_injector = crash_later
    try:
        job = _create(client, input="hello", max_output_tokens=100, background=True)
        failed = _poll(client, job.id)
    finally:
        bg_live.engine.fault_injector = None
    assert failed.status == "failed" and failed.error is not None and "engine failed" in failed.error.message
    events = list(client.responses.retrieve(job.id, stream=True))
    assert events[-1].type == "response.failed"
    wait_until(lambda: httpx.get(f"{bg_live.url}/ready").status_code == 200, what="readiness to recover")


def test_a_sigterm_drain_waits_for_a_running_job(tiny_hf_dir) -> None:  # type: ignore[no-untyped-def]
    engine = AsyncEngine.from_config(tiny_engine_config(tiny_hf_dir("llama")))
    live = start_server(engine, ServerConfig(served_model_name=MODEL, drain_timeout_s=30))
    client = live.client()
    try:
        with slowed(engine, 0.03):
            job = _create(client, input="hello", max_output_tokens=40, background=True)
            live.server.handle_exit(signal.SIGTERM, None)  # what the signal handler calls
            wait_until(lambda: live.state.admission.is_draining, what="draining")
            with pytest.raises(openai.APIStatusError, match="shutting down"):
                _create(client, input="x", max_output_tokens=2, background=True)
            done = _poll(client, job.id)
            assert done.status == "incomplete" and done.usage.output_tokens == 40
        live.thread.join(timeout=15)
        assert not live.thread.is_alive()
    finally:
        live.stop()
        engine.shutdown()
