"""vLLM's allowed_token_ids and bad_words: only allowed tokens are sampled; a bad word's last token is
banned where the output ends with its other tokens, also in rows verifying proposals, so speculation
gives the same tokens as plain decoding under the same masks."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.engine.test_speculative import spec_core
from tests.engine.tiny import assert_all_free, greedy, make_core, random_prompts, run_to_completion, tiny_model
from tokenmill.engine.request import SamplingParams
from tokenmill.errors import RequestValidationError

PROMPTS = random_prompts([6, 11, 15], seed=8)


def _contains(tokens: list[int], word: list[int]) -> bool:
    return any(tokens[i:i + len(word)] == word for i in range(len(tokens) - len(word) + 1))


def test_only_allowed_tokens_are_sampled_greedy_and_seeded() -> None:
    core = make_core(tiny_model("llama"))
    allowed = [3, 17, 40, 41, 99]
    params = [replace(greedy(16), allowed_token_ids=allowed),
              SamplingParams(max_tokens=16, temperature=1.0, seed=5, allowed_token_ids=allowed),
              replace(greedy(16), allowed_token_ids=[7])]
    outputs = run_to_completion(core, PROMPTS, params)
    assert all(set(o) <= set(allowed) for o in outputs[:2]) and outputs[2] == [7] * 16
    assert_all_free(core)


def test_a_bad_words_last_token_is_banned_after_its_head() -> None:
    model = tiny_model("qwen2")
    [plain] = run_to_completion(make_core(model), PROMPTS[:1], greedy(24))
    word = plain[5:7]  # a two-token "word" the model writes
    banned = replace(greedy(24), bad_words_token_ids=[word])
    [out] = run_to_completion(make_core(model), PROMPTS[:1], banned)
    assert out[:6] == plain[:6] and out[6] != plain[6] and not _contains(out, word)
    single = replace(greedy(24), bad_words_token_ids=[[plain[0]]])  # a one-token word: never sampled
    [out] = run_to_completion(make_core(model), PROMPTS[:1], single)
    assert plain[0] not in out


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_gives_the_same_tokens_under_the_masks(method: str) -> None:
    """The rows verifying proposals mask as the plain rows do (with the proposals as output so far): a
    prediction of the unmasked answer and the draft's guesses are refused where a mask forbids them."""
    model = tiny_model("llama")
    plain = run_to_completion(make_core(model), PROMPTS, greedy(24))
    # words at different offsets, so some lie inside one step's proposals (their heads not yet output)
    params = [replace(greedy(24), bad_words_token_ids=[p[2 + i:4 + i], p[10:13]], prediction=p)
              for i, p in enumerate(plain)]
    params[2] = replace(params[2], allowed_token_ids=sorted(set(plain[2]))[:-1], bad_words_token_ids=None)
    expected = run_to_completion(make_core(model), PROMPTS, [replace(p, prediction=None) for p in params])
    core = spec_core(model, method, "llama" if method == "draft" else None, k=4)
    assert run_to_completion(core, PROMPTS, params) == expected
    assert expected != plain
    assert_all_free(core)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RequestValidationError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[])
    with pytest.raises(RequestValidationError, match="bad words must not be empty"):
        SamplingParams(bad_words_token_ids=[[1], []])
    core = make_core(tiny_model("llama"))
    with pytest.raises(RequestValidationError, match="allowed_token_ids holds token id"):
        core.add_request("r", PROMPTS[0], SamplingParams(allowed_token_ids=[10**6]), ())
