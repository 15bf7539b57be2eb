"""Service classes at the API (docs/workload_classes.md): how a request gets its class (body
`service_tier`, header, API key, endpoint default), admission that keeps room for interactive
requests, per-class metrics and SLO attainment, the class in the request log and the batch job's
default (the `serve` flags, the dashboard panel and idle calibration: test_service_class_flags.py)."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, LiveServer, start_server, wait_until
from tokenmill.batch.requests import BatchLineError, Endpoint, build_request
from tokenmill.config import ServerConfig, ServiceClassConfig, SLOTarget
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.request import FinishReason
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.stats import ClassStepStats, StepStats
from tokenmill.engine.step_time import StepTimeFit
from tokenmill.errors import RequestValidationError
from tokenmill.server.admission import Admission
from tokenmill.server.class_metrics import ClassMetrics
from tokenmill.server.errors import ApiError
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.openai_inputs import requested_service_class
from tokenmill.server.protocol import ChatRequest, CompletionRequest
from tokenmill.server.request_log import request_fields

INTERACTIVE, STANDARD, BATCH = ServiceClass.INTERACTIVE, ServiceClass.STANDARD, ServiceClass.BATCH
CHAT = [{"role": "user", "content": "hi"}]


def _series(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        match = re.fullmatch(rf"{re.escape(name)}\{{(.*)\}} (\S+)", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    """One chat completion of the one-message conversation (Any: the client's overloads are noise here)."""
    create: Any = client.chat.completions.create
    return create(model=MODEL, messages=CHAT, **kwargs)


def _scrape(live: LiveServer, name: str, **labels: str) -> float:
    return _series(httpx.get(f"{live.url}/metrics").text, name, **labels)


@contextmanager
def paused(engine: AsyncEngine) -> Iterator[threading.Event]:
    """Requests reach the engine but no step runs until the gate opens: they stay waiting."""
    gate = threading.Event()
    def wait_for_gate() -> None:
        gate.wait(timeout=60)  # bounded: a failing test must not wedge the engine thread

    engine.fault_injector = wait_for_gate
    try:
        yield gate
    finally:
        gate.set()
        engine.fault_injector = None


# ------------------------------------------------------------------------------ the class of a body


@pytest.mark.parametrize(("tier", "expected"), [
    ("interactive", INTERACTIVE), ("standard", STANDARD), ("batch", BATCH), ("priority", INTERACTIVE),
    ("default", STANDARD), ("auto", STANDARD), ("flex", BATCH), ("BATCH", BATCH), (None, None)])
def test_service_tier_values_and_openai_aliases(tier: str | None, expected: ServiceClass | None) -> None:
    body = CompletionRequest.model_validate({"prompt": "x", **({} if tier is None else {"service_tier": tier})})
    assert requested_service_class(body) is expected


def test_an_unknown_service_tier_names_the_field_and_the_choices() -> None:
    body = ChatRequest.model_validate({"messages": CHAT, "service_tier": "scale"})
    with pytest.raises(RequestValidationError) as caught:
        requested_service_class(body)
    assert caught.value.param == "service_tier"
    assert "'scale' is not supported" in str(caught.value) and "interactive, standard, batch" in str(caught.value)


# --------------------------------------------------------------------------------------- admission


def test_batch_flood_fills_only_its_share_and_interactive_keeps_the_reserve() -> None:
    admission = Admission(max_waiting_requests=8, max_waiting_tokens=1000, retry_after_s=3, interactive_reserve=0.25)
    assert admission.limits_for(BATCH) == (6, 750) and admission.limits_for(INTERACTIVE) == (8, 1000)
    tickets = [admission.admit(1, 10, BATCH) for _ in range(6)]
    with pytest.raises(ApiError) as refused:
        admission.admit(1, 10, BATCH)
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "3"}
    with pytest.raises(ApiError):
        admission.admit(1, 10, STANDARD)  # standard shares the non-reserved part with batch
    interactive = [admission.admit(1, 10, INTERACTIVE) for _ in range(2)]
    with pytest.raises(ApiError):
        admission.admit(1, 10, INTERACTIVE)  # the whole queue is full now
    assert admission.num_waiting_by_class == {INTERACTIVE: 2, STANDARD: 0, BATCH: 6}
    admission.mark_started(tickets[0])
    with pytest.raises(ApiError):
        admission.admit(1, 10, BATCH)  # waiting chat requests count against the batch share too
    for ticket in interactive:
        admission.mark_started(ticket)
    assert admission.admit(1, 10, BATCH).service_class is BATCH  # 5 + 1 <= 6
    for ticket in [*tickets, *interactive]:
        admission.release(ticket)
    assert admission.num_waiting_by_class[INTERACTIVE] == 0 and admission.num_waiting_by_class[BATCH] == 1


def test_token_bound_reserves_too_and_what_can_never_fit_its_class_is_a_400() -> None:
    admission = Admission(max_waiting_requests=100, max_waiting_tokens=100, retry_after_s=1, interactive_reserve=0.5)
    admission.admit(1, 40, BATCH)
    with pytest.raises(ApiError) as refused:
        admission.admit(1, 20, BATCH)  # 60 > 50: wait and retry
    assert refused.value.status == 429
    assert admission.admit(1, 60, INTERACTIVE).num_tokens == 60  # 100 <= 100
    with pytest.raises(ApiError) as never:
        admission.admit(1, 51, BATCH)  # more than the batch share could ever hold
    assert never.value.status == 400 and never.value.param == "prompt"


def test_no_reserve_keeps_the_single_bound() -> None:
    admission = Admission(max_waiting_requests=2, max_waiting_tokens=64, retry_after_s=1)
    admission.admit(1, 5, BATCH)
    admission.admit(1, 5, BATCH)
    with pytest.raises(ApiError):
        admission.admit(1, 5, INTERACTIVE)


# ------------------------------------------------------------------------------------------ metrics


def _finished(ttft_s: float, tpot_s: float, num_tokens: int, queue_s: float = 0.01) -> RequestOutput:
    arrival = 100.0
    first_token = arrival + ttft_s
    metrics = RequestMetrics(arrival, arrival + queue_s, first_token, first_token + tpot_s * (num_tokens - 1))
    completion = CompletionOutput(0, "x" * num_tokens, list(range(num_tokens)), None, FinishReason.LENGTH)
    return RequestOutput("r", "p", [1, 2, 3], [completion], True, metrics)


def test_per_class_histograms_and_slo_attainment_against_the_class_targets() -> None:
    config = ServiceClassConfig(interactive=SLOTarget(ttft_s=0.5, tpot_s=0.1), standard=SLOTarget(ttft_s=2.0))
    server = ServerMetrics(MODEL)
    metrics = ClassMetrics(server.registry, MODEL, config)
    metrics.on_finished(_finished(0.2, 0.05, 11), INTERACTIVE)  # meets both
    metrics.on_finished(_finished(0.9, 0.05, 11), INTERACTIVE)  # TTFT missed
    metrics.on_finished(_finished(0.2, 0.30, 11), INTERACTIVE)  # TPOT missed
    metrics.on_finished(_finished(0.2, 0.30, 1), INTERACTIVE)  # one token: no TPOT to miss
    metrics.on_finished(_finished(3.0, 0.30, 5), STANDARD)  # TTFT missed, no TPOT target
    metrics.on_finished(_finished(9.0, 9.0, 5), BATCH)  # no targets: not judged
    text = server.render()[0].decode()
    met = {(c, k): _series(text, "tokenmill:slo_met_total", service_class=c, slo=k)
           for c in ("interactive", "standard", "batch") for k in ("ttft", "tpot", "all")}
    assert [met["interactive", k] for k in ("ttft", "tpot", "all")] == [3, 3, 2]
    assert [met["standard", k] for k in ("ttft", "tpot", "all")] == [0, 1, 0]
    assert [met["batch", k] for k in ("ttft", "tpot", "all")] == [0, 0, 0]
    requests = {c: _series(text, "tokenmill:slo_requests_total", service_class=c) for c in ("interactive", "standard",
                                                                                             "batch")}
    assert requests == {"interactive": 4, "standard": 1, "batch": 0}
    assert _series(text, "tokenmill:service_class_requests_total", service_class="batch") == 1
    assert _series(text, "tokenmill:service_class_generation_tokens_total", service_class="interactive") == 34
    # TTFT 0.9 s lands above the 0.75 s bucket edge; the three others below it.
    assert _series(text, "tokenmill:service_class_time_to_first_token_seconds_bucket", service_class="interactive",
                   le="0.75") == 3
    assert _series(text, "tokenmill:service_class_time_per_output_token_seconds_count",
                   service_class="interactive") == 3  # the one-token request has no TPOT
    assert _series(text, "tokenmill:service_class_time_per_output_token_seconds_bucket", service_class="interactive",
                   le="0.075") == 2
    assert _series(text, "tokenmill:service_class_queue_time_seconds_count", service_class="standard") == 1
    assert _series(text, "tokenmill:slo_target_seconds", service_class="interactive", slo="tpot") == 0.1
    assert 'tokenmill:slo_target_seconds{model_name="tiny",service_class="batch"' not in text


def test_step_decisions_and_the_step_time_fit_become_gauges() -> None:
    server = ServerMetrics(MODEL)
    metrics = ClassMetrics(server.registry, MODEL, ServiceClassConfig())
    text = server.render()[0].decode()
    assert "tokenmill:step_time_model_coefficient_seconds{" not in text  # no fit yet: no coefficients
    decisions = ClassStepStats(scheduled_tokens={"interactive": 3, "standard": 0, "batch": 20},
                               scheduled_seqs={"interactive": 3, "standard": 0, "batch": 2}, num_deferred=5,
                               protected_class="interactive", step_time_limit_s=0.09, predicted_step_time_s=0.08,
                               step_time_fit=StepTimeFit(0.02, 0.002, 0.001, 40))
    stats = StepStats(5, 7, 23, 0, 0.5, 0, 0, 0.085, classes=decisions,
                      class_inter_token_latencies_s={"interactive": [0.05, 0.06], "batch": [0.5]},
                      class_num_running={"interactive": 3, "standard": 0, "batch": 2},
                      class_num_waiting={"interactive": 0, "standard": 1, "batch": 6})
    metrics.on_step(stats, [])
    metrics.on_step(stats, [])
    text = server.render()[0].decode()
    assert _series(text, "tokenmill:step_time_model_coefficient_seconds", term="per_token") == 0.002
    assert _series(text, "tokenmill:step_time_model_coefficient_seconds", term="base") == 0.02
    assert _series(text, "tokenmill:step_time_model_samples") == 40
    assert (_series(text, "tokenmill:step_time_limit_seconds"), _series(text, "tokenmill:step_time_seconds")) == (
        0.09, 0.085)
    assert _series(text, "tokenmill:service_class_deferred_requests_total") == 10
    assert _series(text, "tokenmill:service_class_scheduled_tokens_total", service_class="batch") == 40
    assert _series(text, "tokenmill:service_class_num_requests_waiting", service_class="batch") == 6
    assert _series(text, "tokenmill:service_class_inter_token_latency_seconds_count", service_class="interactive") == 4
    assert _series(text, "tokenmill:service_class_inter_token_latency_seconds_bucket", service_class="batch",
                   le="0.4") == 0


def test_request_log_line_names_the_class() -> None:
    fields = request_fields(_finished(0.1, 0.01, 3), request_id="r", model=MODEL, mode="meta", service_class=BATCH)
    assert fields["service_class"] == "batch"


# ---------------------------------------------------------------------------------- over HTTP


@pytest.fixture(scope="module")
def keyed(tiny_engine: AsyncEngine) -> Iterator[LiveServer]:
    config = ServerConfig(served_model_name=MODEL, api_key="open", api_key_classes=(("nightly", "batch"),))
    server = start_server(tiny_engine, config)
    yield server
    server.stop()


def test_official_client_sends_service_tier_and_gets_the_class_back(live: LiveServer) -> None:
    client = live.client()
    chat = _chat(client, max_tokens=2)
    assert chat.service_tier == "interactive"  # chat defaults to interactive
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert completion.model_extra is not None and completion.model_extra["service_tier"] == "standard"
    flex = _chat(client, max_tokens=2, service_tier="flex")
    assert flex.service_tier == "batch"
    mine = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"service_tier": "priority"})
    assert mine.model_extra is not None and mine.model_extra["service_tier"] == "interactive"


def test_every_streamed_chunk_carries_the_class(live: LiveServer) -> None:
    client = live.client()
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, stream=True,
                                                 service_tier="flex", stream_options={"include_usage": True}))
    assert len(chunks) >= 3 and {c.service_tier for c in chunks} == {"batch"}
    pieces = list(client.completions.create(model=MODEL, prompt="hi", max_tokens=3, stream=True))
    assert pieces and all(p.model_extra is not None and p.model_extra["service_tier"] == "standard" for p in pieces)


def test_a_bad_service_tier_is_an_openai_style_400(live: LiveServer) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(live.client(), max_tokens=2, service_tier="scale")
    body: Any = caught.value.body
    assert body["param"] == "service_tier" and body["type"] == "invalid_request_error"
    assert "'scale' is not supported" in body["message"]
    header = httpx.post(f"{live.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                        headers={"x-tokenmill-service-tier": "gold"})
    assert header.status_code == 400 and "x-tokenmill-service-tier" in header.json()["error"]["message"]


def test_header_sets_the_class_and_the_body_overrides_it(live: LiveServer) -> None:
    url = f"{live.url}/v1/chat/completions"
    headers = {"x-tokenmill-service-tier": "batch"}
    by_header = httpx.post(url, json={"messages": CHAT, "max_tokens": 2}, headers=headers)
    assert by_header.json()["service_tier"] == "batch"
    by_body = httpx.post(url, json={"messages": CHAT, "max_tokens": 2, "service_tier": "standard"}, headers=headers)
    assert by_body.json()["service_tier"] == "standard"


def test_api_key_class_is_the_default_and_every_key_authenticates(keyed: LiveServer) -> None:
    nightly = keyed.client(api_key="nightly")
    assert _chat(nightly, max_tokens=2).service_tier == "batch"
    assert _chat(nightly, max_tokens=2, service_tier="interactive").service_tier == "interactive"
    assert _chat(keyed.client(api_key="open"), max_tokens=2).service_tier == "interactive"
    with pytest.raises(openai.AuthenticationError):
        keyed.client(api_key="nightly2").completions.create(model=MODEL, prompt="hi", max_tokens=2)


def test_per_class_metrics_move_with_the_class_the_engine_ran(live: LiveServer) -> None:
    def counts() -> dict[str, float]:
        return {c: _scrape(live, "tokenmill:service_class_generation_tokens_total", service_class=c)
                for c in ("interactive", "standard", "batch")}

    before = counts()
    client = live.client()
    client.completions.create(model=MODEL, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True,
                                                                                 "service_tier": "batch"})
    list(_chat(client, max_tokens=4, stream=True, extra_body={"ignore_eos": True}))
    after = counts()
    assert {c: after[c] - before[c] for c in after} == {"interactive": 4, "standard": 0, "batch": 3}
    assert _scrape(live, "tokenmill:slo_requests_total", service_class="interactive") >= 1
    # The engine's per-step view agrees: it scheduled batch-class tokens.
    assert _scrape(live, "tokenmill:service_class_scheduled_tokens_total", service_class="batch") >= 3


def test_batch_flood_is_429d_while_a_chat_request_is_still_admitted(tiny_engine: AsyncEngine) -> None:
    config = ServerConfig(served_model_name=MODEL, max_queue_requests=4, interactive_queue_reserve=0.5,
                          retry_after_s=5)
    server = start_server(tiny_engine, config)
    try:
        url = server.url + "/v1/completions"
        body = {"prompt": "hello", "max_tokens": 3, "ignore_eos": True, "service_tier": "batch"}
        with paused(server.engine) as gate, ThreadPoolExecutor(3) as pool:
            admitted = [pool.submit(httpx.post, url, json=body, timeout=60) for _ in range(2)]
            wait_until(lambda: server.state.admission.num_waiting_by_class[BATCH] == 2, what="two batch requests")
            refused = [httpx.post(url, json=body) for _ in range(3)]
            assert {r.status_code for r in refused} == {429}
            assert refused[0].headers["retry-after"] == "5" and refused[0].json()["error"]["code"] == "queue_full"
            assert _scrape(server, "tokenmill:service_class_requests_waiting", service_class="batch") == 2
            chat = pool.submit(_chat, server.client(), max_tokens=2)
            wait_until(lambda: server.state.admission.num_waiting_by_class[INTERACTIVE] == 1, what="the chat request")
            gate.set()
            assert chat.result(timeout=60).service_tier == "interactive"
            assert [f.result().status_code for f in admitted] == [200, 200]
        assert _scrape(server, "tokenmill:service_class_requests_rejected_total", service_class="batch") == 3
        assert _scrape(server, "tokenmill:service_class_requests_rejected_total", service_class="interactive") == 0
        assert server.state.admission.num_in_flight == 0
    finally:
        server.stop()


def test_batch_requests_all_finish_under_intermittent_chat(live: LiveServer) -> None:
    """No starvation, nothing lost: every batch request completes in full while chat comes and goes."""
    url = f"{live.url}/v1/completions"
    before = _scrape(live, "tokenmill:service_class_requests_total", service_class="batch")
    body = {"prompt": "batch job", "max_tokens": 24, "ignore_eos": True, "service_tier": "batch"}
    with ThreadPoolExecutor(24) as pool:
        batch = [pool.submit(httpx.post, url, json=body, timeout=120) for _ in range(16)]
        for _ in range(4):  # chat arrives in bursts with gaps between them
            chats = [pool.submit(_chat, live.client(), max_tokens=4)
                     for _ in range(3)]
            assert all(c.result(timeout=60).service_tier == "interactive" for c in chats)
            time.sleep(0.05)
        results = [f.result(timeout=120) for f in batch]
    assert [r.status_code for r in results] == [200] * 16
    assert all(r.json()["usage"]["completion_tokens"] == 24 and r.json()["service_tier"] == "batch" for r in results)
    wait_until(lambda: _scrape(live, "tokenmill:service_class_requests_total", service_class="batch") == before + 16,
               what="all batch requests counted")


# --------------------------------------------------------------------------------------- batch job


def test_batch_job_lines_default_to_the_batch_class(tiny_engine: AsyncEngine) -> None:
    tokenizer, limits = tiny_engine.tokenizer, tiny_engine.limits
    plain = build_request("a", Endpoint.COMPLETIONS, {"prompt": "x", "max_tokens": 2, "priority": 3}, tokenizer, limits)
    assert (plain.service_class, plain.priority) == (BATCH, 3)
    asked = build_request("b", Endpoint.CHAT, {"messages": CHAT, "service_tier": "priority"}, tokenizer, limits)
    assert asked.service_class is INTERACTIVE
    with pytest.raises(BatchLineError) as caught:
        build_request("c", Endpoint.CHAT, {"messages": CHAT, "service_tier": "gold"}, tokenizer, limits)
    assert caught.value.param == "service_tier"
