"""vLLM's `--speculative-config JSON` read into tokenmill's speculative flags, so a vLLM command line moves
over as it is: `{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}` or
`{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 3}`. A key or method tokenmill has no
equivalent for is a one-line error naming it, never ignored."""

from __future__ import annotations

import json
from typing import Any

from tokenmill.errors import TokenmillError

# vLLM key → tokenmill's SpeculativeConfig / LLM keyword
_KEYS = {"num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_max": "ngram_max",
         "prompt_lookup_min": "ngram_min", "model": "draft_model"}
# vLLM method → tokenmill's; "draft_model" is vLLM's name for a separate draft model
_METHODS = {"ngram": "ngram", "suffix": "suffix", "draft_model": "draft", "draft": "draft"}
# Keys whose vLLM defaults are what tokenmill does anyway (one device, the target's own settings)
_NEUTRAL = {"draft_tensor_parallel_size": 1, "disable_by_batch_size": None}


def speculative_config_kwargs(text: str) -> dict[str, Any]:
    """The keyword arguments (`speculative`, `num_speculative_tokens`, ...) a vLLM speculative config asks for."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TokenmillError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise TokenmillError("--speculative-config must be a JSON object, e.g. '{\"method\": \"ngram\"}'")
    method = config.pop("method", None)
    if method is None:
        method = "draft_model" if "model" in config else None
    if method not in _METHODS:
        raise TokenmillError(f"--speculative-config method {method!r} is not supported: use one of "
                             f"{', '.join(sorted(_METHODS))} (or --speculative for tokenmill's own methods)")
    out: dict[str, Any] = {"speculative": _METHODS[method]}
    for key, value in config.items():
        if key in _KEYS:
            if key == "model" and not isinstance(value, str):
                raise TokenmillError(f"--speculative-config model must be a string, got {value!r}")
            if key != "model" and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise TokenmillError(f"--speculative-config {key} must be a positive integer, got {value!r}")
            out[_KEYS[key]] = value
        elif key in _NEUTRAL and value == _NEUTRAL[key]:
            continue
        else:
            raise TokenmillError(f"--speculative-config key {key!r} has no tokenmill equivalent: supported keys "
                                 f"are method, {', '.join(_KEYS)}")
    if out["speculative"] == "draft" and "draft_model" not in out:
        raise TokenmillError("--speculative-config with a draft model needs \"model\": the draft's name or path")
    return out
