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


def _from_vllm(config: str, *extra: str) -> SpeculativeConfig:
    return speculative_config(build_parser().parse_args(["serve", "m", "--speculative-config", config, *extra]))


def test_vllm_speculative_config_reads_as_the_flags() -> None:
    assert _from_vllm('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, '
                      '"prompt_lookup_min": 2}') == SpeculativeConfig("ngram", 5, ngram_min=2, ngram_max=4)
    assert _from_vllm('{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3}') == SpeculativeConfig(
        "draft", 3, draft_model="qwen2.5-coder-0.5b")
    assert _from_vllm('{"method": "draft_model", "model": "d", "draft_tensor_parallel_size": 1}') == \
        SpeculativeConfig("draft", draft_model="d")
    assert _from_vllm('{"method": "suffix"}', "--suffix-cache-tokens", "512") == SpeculativeConfig(
        "suffix", suffix_cache_tokens=512)
    generate = build_parser().parse_args(["generate", "m", "hi", "--speculative-config", '{"method": "ngram"}'])
    assert speculative_kwargs(generate)["speculative"] == "ngram"


@pytest.mark.parametrize(("config", "extra", "message"), [
    ('{"method": "eagle", "model": "x"}', (), "method 'eagle' is not supported"),
    ('{"method": "ngram", "prompt_lookup_mid": 3}', (), "key 'prompt_lookup_mid' has no tokenmill equivalent"),
    ('{"method": "ngram", "draft_tensor_parallel_size": 2}', (), "'draft_tensor_parallel_size' has no"),
    ('{"method": "draft_model"}', (), "needs \"model\""),
    ('{"method": "ngram"', (), "not valid JSON"),
    ('["ngram"]', (), "must be a JSON object"),
    ('{"method": "ngram"}', ("--speculative", "ngram"), "either --speculative-config or --speculative"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', (), "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 5.0}', (), "num_speculative_tokens must be a positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 40}', (), "num_speculative_tokens must be in 1..32"),
    ('{"model": 3}', (), "model must be a string"),
])
def test_vllm_speculative_config_refuses_what_has_no_equivalent(config: str, extra: tuple[str, ...],
                                                                 message: str) -> None:
    with pytest.raises(TokenmillError, match=message):
        _from_vllm(config, *extra)


def test_a_bad_speculative_config_is_one_line_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "m", "hi", "--speculative-config", '{"method": "medusa"}']) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "method 'medusa' is not supported" in err[0]
