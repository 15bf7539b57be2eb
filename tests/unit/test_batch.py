"""`tokenmill batch` over a tiny random model: one result line per custom_id, resume after a kill."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tokenmill.batch.requests import BatchLineError, BatchRequest, Endpoint, build_request
from tokenmill.batch.runner import completed_keys, run_batch
from tokenmill.engine.request import SamplingParams
from tokenmill.llm import LLM

REPO_ROOT = Path(__file__).resolve().parents[2]
Line = dict[str, Any]


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dir: Callable[[str], Path]) -> Path:
    return tiny_hf_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=128)


def _completion(custom_id: str, prompt: Any, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": {"model": "tiny", "prompt": prompt, "temperature": 0, **body}})


def _chat(custom_id: str, content: str, **body: Any) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny", "messages": [{"role": "user", "content": content}],
                                "temperature": 0, **body}})


def _write_input(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _read_output(path: Path) -> list[Line]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _by_custom_id(lines: list[Line]) -> dict[str, Line]:
    return {line["custom_id"]: line for line in lines if line["custom_id"] is not None}


MIXED = [
    _completion("plain", "hello world", max_tokens=5),
    _chat("chat", "hi there", max_tokens=4),
    _completion("n2", ["one", "two"], n=2, max_tokens=3, temperature=0.8, seed=7),
    _completion("ids", [5, 6, 7], max_tokens=2),
    "{not json",
    json.dumps({"custom_id": "url", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}),
    _completion("param", "x", temperature=-1),
    _completion("type", "x", max_tokens="ten"),
    _completion("long", "x", max_tokens=10_000),
    _completion("vocab", [1, 2, 99_999]),
    json.dumps({"custom_id": "nobody", "method": "POST", "url": "/v1/completions"}),
    _completion("plain", "a repeated custom_id is answered once"),
    "",
]


def test_good_and_bad_lines_give_one_result_line_each(llm: LLM, tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    summary = run_batch(llm, _write_input(tmp_path / "in.jsonl", MIXED), output, model_name="tiny", progress=False)
    lines = _read_output(output)
    assert Counter(line["custom_id"] for line in lines) == Counter(
        ["plain", "chat", "n2", "ids", None, "url", "param", "type", "long", "vocab", "nobody"])
    assert (summary.num_succeeded, summary.num_failed, summary.num_skipped) == (4, 7, 1)
    by_id = _by_custom_id(lines)
    for custom_id in ("plain", "chat", "n2", "ids"):
        assert by_id[custom_id]["response"]["status_code"] == 200 and by_id[custom_id]["error"] is None
    for custom_id in ("url", "param", "type", "long", "vocab", "nobody"):
        response = by_id[custom_id]["response"]
        assert response["status_code"] in (400, 404)
        assert response["body"]["error"]["message"] == by_id[custom_id]["error"]["message"]
    assert by_id["url"]["response"]["status_code"] == 404
    assert "10001" in by_id["long"]["error"]["message"]  # says how many tokens were asked for


def test_result_bodies_follow_the_openai_objects(llm: LLM, tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    run_batch(llm, _write_input(tmp_path / "in.jsonl", MIXED[:4]), output, model_name="tiny", progress=False)
    by_id = _by_custom_id(_read_output(output))
    plain = by_id["plain"]["response"]["body"]
    assert plain["object"] == "text_completion" and plain["model"] == "tiny"
    assert plain["usage"]["completion_tokens"] == 5 or plain["choices"][0]["finish_reason"] == "stop"
    chat = by_id["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    n2 = by_id["n2"]["response"]["body"]
    assert [c["index"] for c in n2["choices"]] == [0, 1, 2, 3]  # 2 prompts × n=2, prompt-major
    assert n2["usage"]["total_tokens"] == n2["usage"]["prompt_tokens"] + n2["usage"]["completion_tokens"]


def test_greedy_results_match_the_offline_api(llm: LLM, tmp_path: Path) -> None:
    output = tmp_path / "out.jsonl"
    run_batch(llm, _write_input(tmp_path / "in.jsonl", [_completion("p", "the quick fox", max_tokens=6)]),
              output, model_name="tiny", progress=False)
    (line,) = _read_output(output)
    expected = llm.generate("the quick fox", SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text
    assert line["response"]["body"]["choices"][0]["text"] == expected


def test_rerun_after_a_torn_last_line_answers_each_line_exactly_once(llm: LLM, tmp_path: Path) -> None:
    lines = [_completion(f"r{i}", f"prompt number {i}", max_tokens=4) for i in range(8)] + ["bad json"]
    input_path = _write_input(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    run_batch(llm, input_path, output, model_name="tiny", progress=False)
    finished = output.read_text().splitlines(keepends=True)
    # What a kill leaves: three whole lines and the first half of a fourth.
    output.write_text("".join(finished[:3]) + finished[3][: len(finished[3]) // 2])
    summary = run_batch(llm, input_path, output, model_name="tiny", progress=False)
    assert summary.num_skipped == 3
    resumed = _read_output(output)
    keys = Counter(line["custom_id"] or line["id"] for line in resumed)
    assert keys == Counter([f"r{i}" for i in range(8)] + ["batch_req_line_9"])
    # A third run has nothing left to do: error lines without a custom_id count as done too.
    assert run_batch(llm, input_path, output, model_name="tiny", progress=False).num_skipped == 9
    assert len(_read_output(output)) == 9


def test_completed_keys_ignores_a_missing_output(tmp_path: Path) -> None:
    assert completed_keys(tmp_path / "absent.jsonl") == set()


def test_killed_job_resumes_without_loss_or_duplicates(model_dir: Path, llm: LLM, tmp_path: Path) -> None:
    num_lines = 40
    lines = [_completion(f"k{i}", f"line {i}", max_tokens=24, ignore_eos=True) for i in range(num_lines)]
    input_path = _write_input(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    job = subprocess.Popen(
        [sys.executable, "-m", "tokenmill", "batch", str(input_path), "-o", str(output), "--model", str(model_dir),
         "--dtype", "float32", "--device", "cpu", "--num-kv-blocks", "64", "--max-in-flight", "1", "--no-progress"],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _wait_for_lines(output, 2, job)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    num_before = len(output.read_text().splitlines())
    assert num_before < num_lines, "the job finished before it could be killed: make it longer"
    run_batch(llm, input_path, output, model_name="tiny", progress=False)
    assert Counter(line["custom_id"] for line in _read_output(output)) == Counter(f"k{i}" for i in range(num_lines))


def _wait_for_lines(path: Path, count: int, job: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().count("\n") >= count:
            return
        if job.poll() is not None:
            stderr = job.stderr.read().decode() if job.stderr else ""
            pytest.fail(f"the batch job exited with {job.returncode} early: {stderr}")
        time.sleep(0.05)
    pytest.fail(f"no {count} output lines within {timeout_s} s")


# ------------------------------------------------------------------------ body → engine requests


def _build(llm: LLM, body: dict[str, Any], endpoint: Endpoint = Endpoint.COMPLETIONS) -> BatchRequest:
    body = {"prompt": "hello"} | body if endpoint is Endpoint.COMPLETIONS else \
        {"messages": [{"role": "user", "content": "hi"}]} | body
    return build_request("id", endpoint, body, llm.tokenizer, llm.engine.limits)


def test_chat_runs_to_the_context_by_default_and_takes_max_completion_tokens(llm: LLM) -> None:
    chat = _build(llm, {}, Endpoint.CHAT)
    room = llm.engine.limits.max_model_len - len(chat.prompts[0].token_ids)
    assert chat.children[0].params.max_tokens == room
    assert _build(llm, {}).children[0].params.max_tokens == 16
    assert _build(llm, {"max_tokens": 9, "max_completion_tokens": 5}, Endpoint.CHAT).children[0].params.max_tokens == 5


def test_sampling_fields_are_type_checked(llm: LLM) -> None:
    request = _build(llm, {"temperature": 0, "top_k": 5, "stop": "\n", "seed": 3, "n": 2})
    params = [child.params for child in request.children]
    assert [(p.temperature, p.top_k, p.stop, p.seed, p.n) for p in params] == [(0.0, 5, ["\n"], 3, 1),
                                                                              (0.0, 5, ["\n"], 4, 1)]
    bad_bodies: list[dict[str, Any]] = [
        {"n": 1.5}, {"temperature": "hot"}, {"seed": True}, {"stop": [1]}, {"top_p": 0}, {"n": 65},
        {"seed": 2**64}, {"top_k": 10**30}, {"temperature": float("nan")}, {"repetition_penalty": float("inf")},
        {"logprobs": 21}, {"prompt_logprobs": -1}, {"stop_token_ids": [10**6]}, {"suffix": "x"},
    ]
    for body in bad_bodies:
        with pytest.raises(BatchLineError) as caught:
            _build(llm, body)
        assert caught.value.param == next(iter(body)), body


def test_a_speculative_batch_answers_as_the_plain_one(model_dir: Path, tmp_path: Path) -> None:
    """`tokenmill batch --speculative suffix`: the flags reach the engine's config, and greedy results
    are the plain run's, line for line."""
    from tokenmill.cli.batch import _engine_kwargs
    from tokenmill.cli.main import build_parser, main

    lines = [_completion(f"s{i}", "the the the the", max_tokens=16, ignore_eos=True) for i in range(6)]
    input_path = _write_input(tmp_path / "in.jsonl", lines)
    common = ["batch", str(input_path), "--model", str(model_dir), "--dtype", "float32", "--device", "cpu",
              "--num-kv-blocks", "64", "--max-in-flight", "2", "--no-progress"]
    texts = {}
    for name, extra in (("plain", []), ("suffix", ["--speculative", "suffix", "--suffix-cache-tokens", "512"])):
        output = tmp_path / f"{name}.jsonl"
        assert main([*common, "-o", str(output), *extra]) == 0
        texts[name] = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"]
                       for line in _read_output(output)}
    assert texts["suffix"] == texts["plain"] and len(texts["plain"]) == 6
    # Predicted outputs: each line's plain answer as its prediction; the answers stay, usage counts them
    predicted = [_completion(f"s{i}", "the the the the", max_tokens=16, ignore_eos=True,
                             prediction={"type": "content", "content": texts["plain"][f"s{i}"]}) for i in range(6)]
    output = tmp_path / "predicted.jsonl"
    source = str(_write_input(tmp_path / "predicted_in.jsonl", predicted))
    assert main([common[0], source, *common[2:], "-o", str(output), "--speculative", "ngram"]) == 0
    bodies = {line["custom_id"]: line["response"]["body"] for line in _read_output(output)}
    assert {k: b["choices"][0]["text"] for k, b in bodies.items()} == texts["plain"]
    assert all(b["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] >= 8 for b in bodies.values())
    assert "completion_tokens_details" not in _read_output(tmp_path / "plain.jsonl")[0]["response"]["body"]["usage"]
    kwargs = _engine_kwargs(build_parser().parse_args([*common, "-o", "x", "--speculative", "suffix"]))
    assert kwargs["speculative"] == "suffix" and kwargs["suffix_cache_tokens"] == 65536


@pytest.mark.parametrize("field", [{"previous_response_id": "resp_1"}, {"background": True},
                                   {"use_beam_search": True}, {"conversation": "conv_1"}])
def test_a_responses_line_cannot_continue_a_stored_response_nor_run_in_background(llm: LLM,
                                                                                 field: dict[str, Any]) -> None:
    with pytest.raises(BatchLineError) as caught:
        _build(llm, {"input": "x", **field}, Endpoint.RESPONSES)
    assert caught.value.param == next(iter(field))
    assert _build(llm, {"input": "x", "max_output_tokens": 3}, Endpoint.RESPONSES).children[0].params.max_tokens == 3


def test_the_shared_prefix_wait_reaches_the_engine_only_when_set(model_dir: Path) -> None:
    from tokenmill.cli.batch import _engine_kwargs
    from tokenmill.cli.main import build_parser

    common = ["batch", "in.jsonl", "--model", str(model_dir), "-o", "x", "--dtype", "float32", "--device", "cpu",
              "--num-kv-blocks", "32"]
    kwargs = _engine_kwargs(build_parser().parse_args([*common, "--shared-prefix-wait-tokens", "0"]))
    assert LLM(str(model_dir), **kwargs).config.scheduler.shared_prefix_wait_tokens == 0
    assert "shared_prefix_wait_tokens" not in _engine_kwargs(build_parser().parse_args(common))  # LLM's default
