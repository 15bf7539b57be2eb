"""The one fan-out and the one set of request checks every front end uses (engine/inputs.py)."""

from __future__ import annotations

import pytest

from tokenmill.engine.inputs import EncodedPrompt, RequestLimits, fan_out
from tokenmill.engine.request import SamplingParams
from tokenmill.errors import RequestValidationError

LIMITS = RequestLimits(max_model_len=64, vocab_size=100)
PROMPT = EncodedPrompt("hi", [1, 2, 3])


def test_fan_out_is_prompt_major_with_seed_plus_sample() -> None:
    children = fan_out(2, PROMPT, SamplingParams(n=3, seed=10, temperature=0.7))
    assert [c.index for c in children] == [6, 7, 8]  # prompt 2 of n = 3: choices 6..8
    assert [c.params.seed for c in children] == [10, 11, 12]
    assert all(c.params.n == 1 and c.params.temperature == 0.7 and c.prompt is PROMPT for c in children)
    assert [c.params.seed for c in fan_out(0, PROMPT, SamplingParams(n=2))] == [None, None]
    single = SamplingParams(seed=5)
    assert fan_out(0, PROMPT, single)[0].params is single


def test_max_tokens_resolves_to_the_room_left_or_is_refused_beyond_it() -> None:
    assert LIMITS.resolve_max_tokens(60, None) == 4
    assert LIMITS.resolve_max_tokens(60, 4) == 4
    with pytest.raises(RequestValidationError) as caught:
        LIMITS.resolve_max_tokens(60, 5)
    assert caught.value.param == "max_tokens"
    assert str(caught.value) == ("prompt (60 tokens) + max_tokens (5) = 65 exceeds the model's context of 64 tokens "
                                 "by 1: shorten the prompt or lower max_tokens")


@pytest.mark.parametrize(("prompt", "params", "param", "message"), [
    ([], SamplingParams(), "prompt", "the prompt is empty: send at least one token"),
    (list(range(64)), SamplingParams(), "prompt",
     "the prompt has 64 tokens but the model's context is 64 and at least one token must be generated: "
     "shorten the prompt by 1 tokens"),
    ([1, 100], SamplingParams(), "prompt", "prompt holds token id 100, outside the vocabulary [0, 100)"),
    ([1], SamplingParams(stop_token_ids=[-1]), "stop_token_ids",
     "stop_token_ids holds token id -1, outside the vocabulary [0, 100)"),
    ([1], SamplingParams(logit_bias={5: 1.0, 100: -3.0}), "logit_bias",
     "logit_bias holds token id 100, outside the vocabulary [0, 100)"),
])
def test_check_request_names_the_field_at_fault(prompt: list[int], params: SamplingParams, param: str,
                                                message: str) -> None:
    with pytest.raises(RequestValidationError) as caught:
        LIMITS.check_request(prompt, params)
    assert (caught.value.param, str(caught.value)) == (param, message)


def test_check_request_lets_a_long_max_tokens_end_at_the_context() -> None:
    LIMITS.check_request(list(range(63)), SamplingParams(max_tokens=1000))  # the offline API's behaviour


def test_logit_bias_values_stay_in_the_openai_range() -> None:
    SamplingParams(logit_bias={1: -100.0, 2: 100.0})
    with pytest.raises(RequestValidationError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={1: 100.5})
