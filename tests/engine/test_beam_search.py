"""Beam search (engine/beam_search.py) against Hugging Face transformers' `generate(num_beams=...)`: the same
beams, token for token, and the same scores, over widths, length penalties, the three early-stopping modes and
a stop token that ends beams mid-search; then the offline API's shape (n, logprobs, text, batching)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.server.conftest import flattened_copy
from tokenmill import LLM
from tokenmill.engine.beam_search import BeamSearch, BeamSearchParams
from tokenmill.engine.request import FinishReason, TokenLogprob
from tokenmill.errors import RequestValidationError

PROMPT_LEN = 11
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma3"])
def pair(request: pytest.FixtureRequest, tiny_hf_dir: Callable[[str], Path],
         tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, Any]:
    from transformers import AutoModelForCausalLM

    # flatter logits than the stock tiny model's, so the beams differ and stop tokens compete
    path = flattened_copy(tiny_hf_dir(request.param), tmp_path_factory.mktemp("beams") / request.param)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=128, block_size=16, max_model_len=256,
              quantization="none")
    return llm, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(vocab_size: int, seed: int) -> list[int]:
    return torch.randint(3, vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping"),
                         [(1, 1.0, False), (3, 1.0, False), (4, 2.0, "never"), (2, 0.0, True), (4, -1.0, False),
                          (3, 1.0, True)])
def test_beams_and_scores_match_transformers(pair: tuple[LLM, Any], width: int, length_penalty: float,
                                             early_stopping: bool | str) -> None:
    llm, hf = pair
    prompt = _prompt(llm.core.arch.vocab_size, seed=3)
    greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, pad_token_id=0,
                         eos_token_id=None)[0, PROMPT_LEN:].tolist()
    stop = greedy[1]  # a token the model likes here: some beams end on it, some do not
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, num_beams=width, num_return_sequences=width,
                      do_sample=False, length_penalty=length_penalty, early_stopping=early_stopping,
                      eos_token_id=[stop], pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ref_beams = [row[PROMPT_LEN:].tolist() for row in ref.sequences]
    ref_beams = [beam[:beam.index(stop) + 1] if stop in beam else beam for beam in ref_beams]  # HF pads after it
    params = BeamSearchParams(width, MAX_TOKENS, length_penalty, early_stopping,  # type: ignore[arg-type]
                              ignore_eos=True, stop_token_ids=(stop,))
    (ours,) = llm.beam_search([prompt], params, logprobs=1)
    assert [out.token_ids for out in ours.outputs] == ref_beams
    if width > 1:  # one beam is transformers' greedy search, which reports no sequence scores
        scores = [out.cumulative_logprob / len(out.token_ids) ** length_penalty  # type: ignore[operator]
                  for out in ours.outputs]
        assert scores == pytest.approx(ref.sequences_scores.tolist(), abs=1e-3)
    for out in ours.outputs:
        assert out.finish_reason is (FinishReason.STOP if out.token_ids[-1] == stop else FinishReason.LENGTH)


def test_n_logprobs_text_and_batching(pair: tuple[LLM, Any]) -> None:
    llm, _ = pair
    prompts = [_prompt(llm.core.arch.vocab_size, seed) for seed in (5, 6)]
    params = BeamSearchParams(4, 6, ignore_eos=True)
    together = llm.beam_search(prompts, params, n=2, logprobs=3)
    alone = [llm.beam_search([p], params)[0] for p in prompts]
    for both, one in zip(together, alone, strict=True):
        assert [o.token_ids for o in both.outputs] == [o.token_ids for o in one.outputs[:2]]
        best = both.outputs[0]
        stream = llm.tokenizer.new_decode_stream(skip_special_tokens=True)
        assert best.text == "".join(stream.step(t) for t in best.token_ids) and best.logprobs is not None
        assert all(len(lp.top) == 3 and lp.top[lp.rank - 1][0] == lp.token_id for lp in best.logprobs if lp.rank <= 3)
        assert one.outputs[0].logprobs is None


def _top(*pairs: tuple[int, float]) -> TokenLogprob:
    return TokenLogprob(pairs[0][0], pairs[0][1], 1, list(pairs))


def test_a_beam_ending_on_a_stop_token_shows_no_stop_text_and_early_stopping_ends_at_width() -> None:
    search = BeamSearch(BeamSearchParams(2, 5, early_stopping=True), eos_token_ids=[9])
    assert search.num_candidates == 4 and search.step_params().logprobs == 4
    search.advance([_top((9, -0.1), (1, -0.5), (2, -1.0), (3, -3.0))])
    assert [r.token_ids for r in search.results] == [(9,)] and [b.token_ids for b in search.beams] == [(1,), (2,)]
    search.advance([_top((9, -0.2), (4, -2.0), (5, -2.1), (6, -3.0)), _top((9, -0.1), (7, -2.0), (8, -3), (0, -4))])
    assert [r.token_ids for r in search.results] == [(9,), (1, 9)] and search.is_done  # two results: width reached
    best = search.best(2)
    assert best[1].finish_reason is FinishReason.STOP and best[1].score == pytest.approx(-0.7 / 2)


def test_too_wide_a_beam_is_a_clear_error() -> None:
    with pytest.raises(RequestValidationError, match="smaller width") as caught:
        BeamSearch(BeamSearchParams(11, 5), eos_token_ids=[0])
    assert caught.value.param == "n"
    with pytest.raises(RequestValidationError, match="max_tokens"):
        BeamSearch(BeamSearchParams(2, 0), eos_token_ids=[0])


@pytest.mark.parametrize(("early_stopping", "ends"), [(False, True), ("never", False)])
def test_the_search_ends_when_no_beam_can_beat_the_results(early_stopping: bool | str, ends: bool) -> None:
    # W = 2, stop token 9, length penalty 1: after step 2 the results are -0.1 / 1 and -0.25 / 2, and the best
    # live beam's sum is -2.8: at its length (2) it cannot win (-1.4); at max_tokens (50, "never") it could
    search = BeamSearch(BeamSearchParams(2, 50, early_stopping=early_stopping), eos_token_ids=[9])  # type: ignore[arg-type]
    search.advance([_top((9, -0.1), (1, -0.2), (2, -0.3), (3, -3.0))])
    search.advance([_top((9, -0.05), (4, -3.0), (5, -3.1), (6, -4.0)), _top((9, -0.1), (7, -2.5), (8, -3.5), (0, -4))])
    assert [r.score for r in search.results] == pytest.approx([-0.1, -0.125])
    assert [b.token_ids for b in search.beams] == [(2, 7), (1, 4)]
    assert search.is_done is ends


def test_a_search_near_the_context_ends_at_it_as_a_sampled_answer_does(pair: tuple[LLM, Any]) -> None:
    llm, _ = pair
    room = llm.engine.limits.max_model_len
    prompt = _prompt(llm.core.arch.vocab_size, seed=8)[:1] * (room - 6)  # room for 6 tokens
    (beams,) = llm.beam_search([prompt], BeamSearchParams(2, 16, ignore_eos=True))
    assert [len(o.token_ids) for o in beams.outputs] == [6, 6]
    with pytest.raises(RequestValidationError, match="no room"):
        llm.beam_search([prompt[:3], prompt + [5] * 6], BeamSearchParams(2, 4))
    assert not llm.engine.has_unfinished  # refused before any request ran
