"""Grammars inside the engine, on the tiny random model (263-token byte-level BPE vocabulary): its
unconstrained samples are garbage, so every output that parses proves the mask did the work."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.server.conftest import flattened_copy
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.request import FinishReason, Request, SamplingParams
from tokenmill.engine.structured import GrammarError, StructuredOutputParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "inner": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
                  "required": ["n"], "additionalProperties": False},
    },
    "required": ["name", "ok", "kind", "inner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tiny_hf_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Flattened logits (the server tests' copy): seeds then sample different text.
    return flattened_copy(tiny_hf_dir("llama"), tmp_path_factory.mktemp("structured_engine") / "tiny")


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> LLMEngine:
    config = EngineConfig(ModelConfig(str(model_dir), dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, num_blocks=512))
    return LLMEngine.from_config(config)


def _run(engine: LLMEngine, jobs: dict[str, SamplingParams], prompt: str = "hello there",
         counts: dict[str, int] | None = None) -> dict[str, tuple[str, object]]:
    for request_id, params in jobs.items():
        engine.add_request(request_id, engine.encode(prompt), params)
    done: dict[str, tuple[str, object]] = {}
    while engine.has_unfinished:
        step = engine.step()
        if counts is not None:
            counts["drafted"] = counts.get("drafted", 0) + step.stats.spec_num_draft_tokens
            counts["accepted"] = counts.get("accepted", 0) + step.stats.spec_num_accepted_tokens
            counts["forced"] = counts.get("forced", 0) + step.stats.spec_num_forced_tokens
        for output in step.outputs:
            if output.finished:
                done[output.request_id] = (output.outputs[0].text, output.outputs[0].finish_reason)
    return done


def test_json_schema_outputs_always_validate(engine: LLMEngine) -> None:
    structured = StructuredOutputParams.json(SCHEMA)
    jobs = {f"s{seed}": SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured=structured)
            for seed in range(24)}
    done = _run(engine, jobs)
    assert len(done) == 24
    for text, reason in done.values():
        assert reason is FinishReason.STOP, text  # the grammar completed and allowed only EOS
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({text for text, _ in done.values()}) > 1  # sampled, not one forced string


def test_unconstrained_output_is_not_json_and_is_unchanged_by_grammar_neighbours(engine: LLMEngine) -> None:
    plain = SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True)
    alone = _run(engine, {"plain": plain})["plain"][0]
    with pytest.raises(ValueError):
        json.loads(alone)
    structured = StructuredOutputParams.json(SCHEMA)
    mixed = _run(engine, {"p2": plain, **{f"g{i}": SamplingParams(max_tokens=60, seed=i, structured=structured)
                                          for i in range(4)}})
    assert mixed["p2"][0] == alone


def test_choice_regex_and_json_object(engine: LLMEngine) -> None:
    choices = ["yes", "no", "maybe not"]
    jobs = {f"c{i}": SamplingParams(max_tokens=20, seed=i, structured=StructuredOutputParams.choice(choices))
            for i in range(12)}
    jobs |= {f"r{i}": SamplingParams(max_tokens=30, seed=i, structured=StructuredOutputParams.regex(r"[a-c]{2,4}-\d\d"))
             for i in range(12)}
    jobs |= {f"o{i}": SamplingParams(max_tokens=200, seed=i, top_k=20, structured=StructuredOutputParams.json_object())
             for i in range(4)}
    done = _run(engine, jobs)
    assert {done[f"c{i}"][0] for i in range(12)} <= set(choices)
    for i in range(12):
        assert re.fullmatch(r"[a-c]{2,4}-\d\d", done[f"r{i}"][0]), done[f"r{i}"]
    for i in range(4):
        text, reason = done[f"o{i}"]
        if reason is FinishReason.STOP:  # a free JSON object may still be open at max_tokens
            assert isinstance(json.loads(text), dict)
        else:
            assert text.startswith("{")


def test_greedy_and_penalties_stay_inside_the_grammar(engine: LLMEngine) -> None:
    structured = StructuredOutputParams.json(SCHEMA)
    jobs = {"greedy": SamplingParams(max_tokens=120, temperature=0.0, structured=structured),
            "pen": SamplingParams(max_tokens=120, seed=3, repetition_penalty=1.5, presence_penalty=1.0,
                                  top_p=0.9, min_p=0.05, logprobs=2, structured=structured)}
    for text, _ in _run(engine, jobs).values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_bad_schema_is_refused_before_queueing(engine: LLMEngine) -> None:
    with pytest.raises(GrammarError, match="cannot be compiled"):
        engine.add_request("bad", engine.encode("x"), SamplingParams(
            structured=StructuredOutputParams.json({"type": "object", "properties": {"a": {"type": "nonsense"}}})))
    with pytest.raises(GrammarError, match="regex cannot be compiled"):
        engine.add_request("bad2", engine.encode("x"), SamplingParams(structured=StructuredOutputParams.regex("(")))
    assert not engine.has_unfinished


def test_compiles_are_cached_by_spec(engine: LLMEngine) -> None:
    a = engine.structured.compile(StructuredOutputParams.json(SCHEMA))
    b = engine.structured.compile(StructuredOutputParams.json(json.dumps(SCHEMA, indent=2)))
    assert a is b


def test_speculative_proposals_outside_the_grammar_are_rejected(engine: LLMEngine, model_dir: Path) -> None:
    """n-gram proposals copied from a prompt full of near-JSON: verification masks every row with the
    grammar state after the proposals before it, so greedy output equals the non-speculative one."""
    config = EngineConfig(ModelConfig(str(model_dir), dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, num_blocks=512),
                          speculative=SpeculativeConfig(method="ngram", adaptive=False, ngram_min=1))
    spec = LLMEngine.from_config(config)
    prompt = '{"name": "ab", "ok": tru, "kind": "cat", "inner": {"n": 5}} {"name": "ab", "ok": tru, "kind": ' * 2
    structured = StructuredOutputParams.json(SCHEMA)
    jobs = {"greedy": SamplingParams(max_tokens=120, temperature=0.0, structured=structured),
            **{f"s{i}": SamplingParams(max_tokens=120, seed=i, structured=structured) for i in range(6)}}
    counts: dict[str, int] = {}
    with_spec = _run(spec, jobs, prompt, counts)
    assert counts["drafted"] > 50 and 0 < counts["accepted"] < counts["drafted"], counts
    plain = _run(engine, {"greedy": jobs["greedy"]}, prompt)
    assert with_spec["greedy"] == plain["greedy"]
    for text, _ in with_spec.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_masks_built_during_the_forward_sample_the_same_tokens(engine: LLMEngine) -> None:
    """The runner hands each step's rows to the worker before the forward; the masks it builds are
    the ones used (counted), and sampling with them equals sampling with masks built afterwards."""
    structured = StructuredOutputParams.json(SCHEMA)
    jobs = {**{f"j{i}": SamplingParams(max_tokens=120, seed=i, structured=structured) for i in range(6)},
            "plain": SamplingParams(max_tokens=30, seed=9, ignore_eos=True),
            "choice": SamplingParams(max_tokens=10, seed=1, structured=StructuredOutputParams.choice(["ab", "cd"]))}
    grammars = engine.structured
    assert grammars.overlap
    before = grammars.num_overlapped
    overlapped = _run(engine, jobs)
    assert grammars.num_overlapped - before > 20
    grammars.overlap = False
    try:
        before = grammars.num_overlapped
        assert _run(engine, jobs) == overlapped
        assert grammars.num_overlapped == before
    finally:
        grammars.overlap = True
    for i in range(6):
        jsonschema.validate(json.loads(overlapped[f"j{i}"][0]), SCHEMA)


def test_a_mask_prepared_for_other_rows_is_not_used(engine: LLMEngine) -> None:
    from tokenmill.engine.request import Request

    grammars = engine.structured
    structured = StructuredOutputParams.choice(["ab"])
    a = Request("prep-a", [1, 2], SamplingParams(structured=structured), (0,))
    b = Request("prep-b", [1, 2], SamplingParams(structured=StructuredOutputParams.choice(["cd"])), (0,))
    width = engine.core.arch.vocab_size
    grammars.prepare([a, b])
    swapped = grammars(torch.zeros(2, width), [b, a])  # rows swapped: must not reuse the prepared masks
    expected = torch.zeros(2, width)
    grammars.overlap = False
    try:
        grammars(expected, [b, a])
    finally:
        grammars.overlap = True
    assert torch.equal(swapped, expected) and not torch.equal(swapped[0], swapped[1])
    grammars.forget("prep-a")
    grammars.forget("prep-b")


def test_ignore_eos_after_a_complete_grammar_pads_with_stop_tokens(engine: LLMEngine) -> None:
    """ignore_eos (the bench's exact output lengths): once the object is complete only stop tokens
    may follow; they are skipped in the text, which stays valid JSON, and the grammar stays on."""
    structured = StructuredOutputParams.json(SCHEMA)
    jobs = {f"e{seed}": SamplingParams(max_tokens=100, seed=seed, ignore_eos=True, structured=structured)
            for seed in range(3)}
    for text, reason in _run(engine, jobs).values():
        assert reason is FinishReason.LENGTH
        jsonschema.validate(json.loads(text), SCHEMA)


def test_a_grammars_forced_tokens_are_what_it_allows_next(engine: LLMEngine) -> None:
    """At the start of SCHEMA's object the grammar forces `{"name":"` (compact JSON, required keys in
    order); inside the free-form name it forces nothing; a request without a grammar has none."""
    structured = StructuredOutputParams.json(SCHEMA)
    ids = engine.tokenizer.encode
    request = Request("f", ids("hello"), SamplingParams(max_tokens=8, structured=structured))
    forced = engine.structured.forced_tokens(request)
    assert forced and '{"name":"'.startswith(engine.tokenizer.decode(forced))
    request.token_ids.extend(ids('{"name":"'))
    assert engine.structured.forced_tokens(request) == []
    request.token_ids.extend(ids('ab","ok":true'))
    assert engine.tokenizer.decode(engine.structured.forced_tokens(request)).startswith(',"kind":"')
    assert engine.structured.forced_tokens(Request("g", [1, 2], SamplingParams(max_tokens=8))) == []


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_forced_tokens_are_proposed_and_accepted_and_the_output_is_unchanged(
        engine: LLMEngine, model_dir: Path, method: str) -> None:
    """Lookups of 8 tokens find nothing here, so every draft is a grammar's forced run: the keys and
    punctuation of SCHEMA. The model picks the grammar's tokenization of them (accepted), and greedy and
    seeded outputs are the engine's without speculation."""
    config = EngineConfig(ModelConfig(str(model_dir), dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, num_blocks=512),
                          speculative=SpeculativeConfig(method=method, adaptive=False, ngram_min=8, ngram_max=8))
    spec = LLMEngine.from_config(config)
    structured = StructuredOutputParams.json(SCHEMA)
    jobs = {"greedy": SamplingParams(max_tokens=120, temperature=0.0, structured=structured),
            **{f"s{i}": SamplingParams(max_tokens=120, seed=i, structured=structured) for i in range(3)}}
    counts: dict[str, int] = {}
    with_spec = _run(spec, jobs, "hello there", counts)
    assert with_spec == _run(engine, jobs, "hello there")
    assert counts["forced"] == counts["drafted"] >= 4 * 8  # keys and punctuation of four objects
    assert counts["accepted"] >= 0.9 * counts["drafted"], counts


def test_forced_runs_between_draft_guesses_keep_the_output(engine: LLMEngine, model_dir: Path) -> None:
    """A draft model proposes where the grammar forces nothing and sits out where it does, catching up
    over the forced tokens when it next drafts; unseeded sampled requests mix in (a forced run is a point
    mass, never the draft's q of an earlier step)."""
    config = EngineConfig(ModelConfig(str(model_dir), dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, num_blocks=512),
                          speculative=SpeculativeConfig(method="draft", adaptive=False, draft_model=str(model_dir),
                                                        draft_quantization="none"))
    spec = LLMEngine.from_config(config)
    structured = StructuredOutputParams.json(SCHEMA)
    greedy = {f"g{i}": SamplingParams(max_tokens=120, temperature=0.0, structured=structured) for i in range(2)}
    sampled = {f"s{i}": SamplingParams(max_tokens=120, temperature=1.0, structured=structured) for i in range(3)}
    counts: dict[str, int] = {}
    with_spec = _run(spec, {**greedy, **sampled}, "hello there", counts)
    assert {k: with_spec[k] for k in greedy} == _run(engine, greedy, "hello there")
    assert counts["forced"] >= 2 * 8 and counts["drafted"] > counts["forced"]
    for text, _ in with_spec.values():
        jsonschema.validate(json.loads(text), SCHEMA)


def test_verifying_proposals_that_end_the_grammar_leaves_its_state_intact(engine: LLMEngine) -> None:
    """A proposal run that completes the object and proposes the stop token after it: the grammar
    library cannot roll back over an accepted stop, so a verification that accepted it tentatively left
    the matcher refusing the request's real next token (found on Qwen2.5 with suffix lookups: "token
    'playing' is outside its grammar; it is no longer constrained"). Rows after a proposed stop allow
    only stops (reached only under ignore_eos, once the stop was accepted)."""
    structured = StructuredOutputParams.json(SCHEMA)
    ids = engine.tokenizer.encode
    eos = engine.eos_token_ids[0]
    request = Request("v", ids("hi"), SamplingParams(max_tokens=64, structured=structured),
                      eos_token_ids=tuple(engine.eos_token_ids))
    head, tail = ids('{"name":"ab","ok":true,"kind":"cat","inner":{"n":'), ids('5}}')
    request.token_ids.extend(head)
    proposals = [*tail, eos]
    extra = [proposals[:j] for j in range(len(proposals) + 1)]
    rows = [request] * len(extra)
    logits = torch.zeros(len(rows), engine.core.arch.vocab_size)
    engine.structured(logits, rows, extra)
    after_stop = logits[-1]
    assert torch.isinf(after_stop).sum() == after_stop.numel() - len(set(engine.eos_token_ids))
    assert logits[len(tail)][eos] == 0  # the completed object allows the stop
    assert engine.structured.count_valid(request, [*tail, eos, *tail]) == len(tail)  # counts up to the stop
    request.token_ids.extend(tail)  # verification accepted the tail, the model then stopped: the real tokens
    state = engine.structured._state(request, structured)
    assert not state.broken and state.matcher.is_terminated  # the object is complete: only stops follow


def test_a_prediction_the_grammar_allows_wins_over_its_forced_tokens(engine: LLMEngine, model_dir: Path) -> None:
    """Predicted outputs on a schema-constrained request: the prediction (the answer itself) holds the
    forced keys and runs on into the values, so it is proposed instead of the forced tokens, and the
    answer is unchanged."""
    config = EngineConfig(ModelConfig(str(model_dir), dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, num_blocks=512),
                          speculative=SpeculativeConfig(method="ngram", adaptive=False, ngram_min=8, ngram_max=8))
    spec = LLMEngine.from_config(config)
    params = SamplingParams(max_tokens=120, temperature=0.0, structured=StructuredOutputParams.json(SCHEMA))
    engine.add_request("plain", engine.encode("hello there"), params)
    answer: list[int] = []
    while engine.has_unfinished:
        for output in engine.step().outputs:
            answer = list(output.outputs[0].token_ids)
    spec.add_request("p", spec.encode("hello there"), replace(params, prediction=answer))
    counts = {"forced": 0}
    tokens, accepted = [], 0
    while spec.has_unfinished:
        step = spec.step()
        counts["forced"] += step.stats.spec_num_forced_tokens
        for output in step.outputs:
            tokens = list(output.outputs[0].token_ids)
            if output.finished and output.metrics is not None:
                accepted = output.metrics.accepted_prediction_tokens
    assert tokens == answer
    assert accepted >= len(answer) - 12 and counts["forced"] <= 8, (accepted, len(answer), counts)
