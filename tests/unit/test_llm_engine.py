"""LLMEngine, the one driver loop: aborts come back as finished outputs, and a step's gauges
already count the requests its stop strings ended (so an engine that idles after it reads zero)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request import FinishReason, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_hf_dir: Callable[[str], Path]) -> LLMEngine:
    config = EngineConfig(ModelConfig(str(tiny_hf_dir("llama")), dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, num_blocks=64))
    return LLMEngine.from_config(config)


def _run(engine: LLMEngine, request_id: str, params: SamplingParams) -> str:
    engine.add_request(request_id, engine.encode("hello there"), params)
    text = ""
    while engine.has_unfinished:
        for output in engine.step().outputs:
            text = output.outputs[0].text
    return text


def test_abort_returns_the_final_output_and_frees_everything(engine: LLMEngine) -> None:
    engine.add_request("a", engine.encode("hello there"), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.stats().num_running == 1 and engine.stats().kv_usage > 0
    output = engine.abort("a")
    assert output is not None and output.finished
    assert output.outputs[0].finish_reason is FinishReason.ABORT
    assert (engine.stats().num_running, engine.stats().kv_usage) == (0, 0.0)
    assert engine.abort("a") is None  # no longer in flight
    assert not engine.has_unfinished


def test_a_step_whose_stop_string_ends_the_last_request_reports_it_gone(engine: LLMEngine) -> None:
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    text = _run(engine, "free", greedy)
    stop = text[3:5]  # two characters, so the match needs a later step than the first token
    assert len(stop) == 2, text
    engine.add_request("stopped", engine.encode("hello there"), SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))
    while True:
        step = engine.step()
        if step.finished:
            break
    (output,) = step.finished
    assert (output.outputs[0].finish_reason, output.outputs[0].stop_reason) == (FinishReason.STOP, stop)
    assert output.outputs[0].text == text[:text.find(stop)]
    assert (step.stats.num_running, step.stats.kv_usage) == (0, 0.0)  # aborted within the step
    assert not engine.has_unfinished
