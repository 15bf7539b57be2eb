"""Speculative-decoding flags on generate/serve and SpeculativeConfig's checks."""

from __future__ import annotations

import pytest

from tokenmill.cli.main import build_parser, main
from tokenmill.cli.serve import speculative_config, speculative_kwargs
from tokenmill.config import SpeculativeConfig
from tokenmill.errors import TokenmillError


def test_flags_parse_on_generate_and_serve() -> None:
    parser = build_parser()
    args = parser.parse_args(["generate", "m", "hi", "--speculative", "ngram", "--num-speculative-tokens", "6",
                              "--ngram-min", "2", "--ngram-max", "5"])
    assert speculative_kwargs(args) == {"speculative": "ngram", "draft_model": None, "draft_quantization": None,
                                        "draft_vocab": None, "num_speculative_tokens": 6, "ngram_min": 2,
                                        "ngram_max": 5, "suffix_cache_tokens": 65536}
    args = parser.parse_args(["serve", "m", "--speculative", "suffix", "--suffix-cache-tokens", "4096"])
    assert speculative_config(args) == SpeculativeConfig("suffix", suffix_cache_tokens=4096)
    args = parser.parse_args(["serve", "m", "--speculative", "draft", "--draft-model", "d"])
    assert (args.speculative, args.draft_model, args.num_speculative_tokens) == ("draft", "d", 0)  # the method's
    assert args.draft_quantization is None  # the target's
    args = parser.parse_args(["serve", "m", "--speculative", "draft", "--draft-model", "d",
                              "--draft-quantization", "q4"])
    assert speculative_config(args) == SpeculativeConfig("draft", draft_model="d", draft_quantization="q4")
    args = parser.parse_args(["generate", "m", "hi", "--speculative", "draft", "--draft-model", "d",
                              "--draft-vocab", "65536"])
    assert speculative_config(args).draft_vocab == 65536
    assert parser.parse_args(["serve"]).speculative is None  # off unless asked


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"method": "draft"}, "needs a draft model"),
    ({"method": "ngram-draft"}, "'ngram-draft' needs a draft model"),
    ({"method": "suffix-draft"}, "'suffix-draft' needs a draft model"),
    ({"method": "eagle"}, "not supported"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 33}, "num_speculative_tokens"),
    ({"method": "ngram", "ngram_min": 3, "ngram_max": 2}, "ngram_min"),
    ({"method": "draft", "draft_model": "d", "draft_quantization": "q3"}, "draft quantization 'q3'"),
    ({"method": "draft", "draft_model": "d", "draft_vocab": 0}, "draft_vocab"),
    ({"method": "suffix", "suffix_cache_tokens": -1}, "suffix_cache_tokens"),
])
def test_config_rejects_bad_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(TokenmillError, match=message):
        SpeculativeConfig(**kwargs)  # type: ignore[arg-type]


def test_the_default_k_is_the_methods() -> None:
    assert SpeculativeConfig("ngram").num_speculative_tokens == 7
    assert SpeculativeConfig("draft", draft_model="d").num_speculative_tokens == 3
    assert SpeculativeConfig("ngram-draft", draft_model="d").num_speculative_tokens == 5
    assert SpeculativeConfig("ngram", 2).num_speculative_tokens == 2
    assert SpeculativeConfig("suffix").num_speculative_tokens == 7
    assert SpeculativeConfig("suffix-draft", draft_model="d").num_speculative_tokens == 5


def test_draft_without_a_model_is_a_one_line_cli_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "smollm2-135m", "hi", "--speculative", "draft"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: speculative method 'draft' needs a draft model: pass --draft-model NAME"]
