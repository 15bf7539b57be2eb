"""Small pieces: SSE splitting and commit points, routing keys, /metrics parsing, backoff, CLI wiring."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator

import pytest

from tokenmill.cli import build_parser
from tokenmill.cli.gateway import build_config
from tokenmill.errors import TokenmillError
from tokenmill.gateway.app import HTTP_CLIENT_LOGGERS, quiet_http_client_logs
from tokenmill.gateway.config import GatewayConfig, RetryConfig
from tokenmill.gateway.prompt_key import route_prefix
from tokenmill.gateway.replica import parse_engine_load
from tokenmill.gateway.response_homes import ResponseHomes, referenced_response
from tokenmill.gateway.retry import backoff_s
from tokenmill.gateway.sse import carries_output, error_event, event_data, split_events


def split(chunks: list[bytes]) -> list[bytes]:
    async def source() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    async def collect() -> list[bytes]:
        return [event async for event in split_events(source())]

    return asyncio.run(collect())


def test_events_are_reassembled_across_chunk_boundaries_and_a_cut_tail_is_dropped() -> None:
    stream = b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\ndata: [DONE]\n\ndata: {"cut'
    chunks = [stream[i : i + 7] for i in range(0, len(stream), 7)]
    assert split(chunks) == [b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b"data: [DONE]\n\n"]


def test_commit_points() -> None:
    assert not carries_output(b'data: {"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}\n\n')
    assert carries_output(b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n')
    assert carries_output(b'data: {"choices":[{"index":0,"text":"Hi"}]}\n\n')
    assert carries_output(b'data: {"choices":[{"index":0,"text":"","finish_reason":"length"}]}\n\n')
    assert not carries_output(b'data: {"choices":[{"index":0,"text":""}]}\n\n')
    assert carries_output(b"data: [DONE]\n\n")
    assert event_data(error_event("boom", "replica_failed")).startswith(b'{"error":{"message":"boom"')


def test_routing_key_from_prompts_messages_and_session_headers() -> None:
    assert route_prefix({"prompt": "abcdef"}, {}, 3) == "abc"
    assert route_prefix({"prompt": ["first", "second"]}, {}, 100) == "first"
    assert route_prefix({"prompt": [1, 2, 3]}, {}, 100) == "1 2 3"
    chat = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [
        {"type": "text", "text": "hi"}]}]}
    assert route_prefix(chat, {}, 100) == "system: be brief\nuser: hi\n"
    assert route_prefix(chat, {"x-session-id": "s1"}, 100) == "session:s1"
    # the Responses API: the same conversation keys the same as its chat form, calls included
    responses = {"instructions": "be brief", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                     "text": "hi"}]}]}
    assert route_prefix(responses, {}, 100) == route_prefix(chat, {}, 100)
    assert route_prefix({"instructions": "be brief", "input": "hi"}, {}, 100) == route_prefix(chat, {}, 100)
    turn = {"input": [{"role": "user", "content": "hi"}, {"type": "function_call", "name": "f", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "c", "output": "7"}]}
    assert route_prefix(turn, {}, 100) == "user: hi\nfunction_call: f{}\nfunction_call_output: 7\n"
    assert route_prefix(None, {}, 100) is None and route_prefix({"n": 1}, {}, 100) is None
    # a salted request reuses only its salt's blocks: the salt is part of where its prefix lives
    assert route_prefix({"prompt": "abcdef", "cache_salt": "t1"}, {}, 3) == "salt:t1\nabc"
    assert route_prefix({"prompt": "abcdef", "cache_salt": ""}, {}, 3) == "abc"  # the replica answers 400
    assert route_prefix({"prompt": "abcdef", "cache_salt": "t1"}, {"x-session-id": "s1"}, 3) == "session:s1"


def test_engine_load_is_read_from_the_replicas_metrics() -> None:
    exposition = """# HELP tokenmill:num_requests_running x
tokenmill:num_requests_running{model_name="m"} 3.0
tokenmill:num_requests_waiting{model_name="m"} 2.0
tokenmill:prefix_cache_hits_total{model_name="m"} 160.0
tokenmill:prefix_cache_queries_total{model_name="m"} 320.0
tokenmill:num_requests_waiting_other 99
garbage line
"""
    load = parse_engine_load(exposition)
    assert (load.num_running, load.num_waiting, load.prefix_cache_hits, load.prefix_cache_queries) == (3, 2, 160, 320)


def test_backoff_grows_exponentially_with_jitter_under_the_cap() -> None:
    config, rng = RetryConfig(backoff_base_s=0.1, backoff_max_s=0.5), random.Random(0)
    for num_failures, ceiling in [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.5), (9, 0.5)]:
        waits = [backoff_s(num_failures, config, rng) for _ in range(50)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits) and len(set(waits)) > 1


def test_cli_builds_the_config() -> None:
    args = build_parser().parse_args(["gateway", "--replicas", "2", "--model", "m", "--backend", "http://h:1",
                                      "--policy", "round_robin", "--warm", "1", "--max", "5",
                                      "--serve-args", "--dtype float32 --threads 1"])
    config = build_config(args)
    assert config.initial_replicas == 2 and config.backends == ("http://h:1",) and config.policy == "round_robin"
    assert config.local is not None and config.local.serve_args == ("--dtype", "float32", "--threads", "1")
    assert config.autoscale is not None
    assert (config.autoscale.min_replicas, config.autoscale.max_replicas, config.autoscale.warm_replicas) == (2, 5, 1)
    fixed = build_config(build_parser().parse_args(["gateway", "--replicas", "1", "--model", "m"]))
    assert fixed.autoscale is None


def test_config_refuses_a_gateway_without_replicas() -> None:
    with pytest.raises(TokenmillError, match="needs replicas"):
        GatewayConfig()
    with pytest.raises(TokenmillError, match="http"):
        GatewayConfig(backends=("localhost:8000",))


@pytest.mark.parametrize(("log_level", "expected"), [("info", logging.WARNING), ("warning", logging.WARNING),
                                                     ("debug", logging.DEBUG)])
def test_http_client_request_lines_show_only_at_debug(log_level: str, expected: int,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for name in HTTP_CLIENT_LOGGERS:  # restored after the test
        monkeypatch.setattr(logging.getLogger(name), "level", logging.NOTSET)
    quiet_http_client_logs(log_level)
    assert [logging.getLogger(name).level for name in HTTP_CLIENT_LOGGERS] == [expected, expected]


def test_requests_name_the_stored_response_they_need_and_homes_forget_the_oldest() -> None:
    assert referenced_response("POST", "/v1/responses", {"previous_response_id": "resp_1", "input": "x"}) == "resp_1"
    assert referenced_response("GET", "/v1/responses/resp_2", None) == "resp_2"
    assert referenced_response("DELETE", "/v1/responses/resp_3?x=1", None) == "resp_3"
    assert referenced_response("POST", "/v1/responses/resp_4/cancel", None) == "resp_4"  # background responses
    assert referenced_response("GET", "/v1/responses/resp_5/input_items", None) == "resp_5"
    assert referenced_response("GET", "/v1/conversations/conv_1/items?limit=2", None) == "conv_1"  # conversations
    assert referenced_response("POST", "/v1/responses", {"conversation": "conv_2", "input": "x"}) == "conv_2"
    assert referenced_response("POST", "/v1/responses", {"conversation": {"id": "conv_3"}, "input": "x"}) == "conv_3"
    assert referenced_response("POST", "/v1/responses", {"input": "x"}) is None
    assert referenced_response("POST", "/v1/chat/completions", {"previous_response_id": "resp_1"}) is None
    homes = ResponseHomes(capacity=2)
    homes.note("a", "r1")
    homes.note("b", "r2")
    assert homes.home_of("a") == "r1"  # now the most recently used
    homes.note("c", "r3")
    assert (homes.home_of("a"), homes.home_of("b"), homes.home_of("c"), homes.home_of(None)) == ("r1", None, "r3", None)
