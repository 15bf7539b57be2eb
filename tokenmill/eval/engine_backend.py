"""The in-process engine (`tokenmill.llm.LLM`) as an eval backend: no HTTP, same requests.

Engine options come from the spec (`model=smollm2-135m,dtype=float32,quantization=q4`) and are
passed to `LLM` as keyword arguments. An option this `LLM` does not take is an error, except a
value that asks for the default (`quantization=none`, `kv_cache_dtype=auto`), which is dropped:
so one spec works on engines from before and after an option lands.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from tokenmill.eval.client import (
    Backend,
    EvalError,
    GenerateOptions,
    Generation,
    PositionLogprobs,
    Progress,
    Prompt,
)

CHUNK = 16  # prompts per LLM.generate call: one continuous batch, and a progress tick after each
_DEFAULT_VALUES = {"quantization": ("none", "", None), "kv_cache_dtype": ("auto", "none", "", None)}


def engine_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """`options` filtered against LLM's signature (see the module docstring)."""
    from tokenmill.llm import LLM

    accepted = set(inspect.signature(LLM.__init__).parameters) - {"self", "model"}
    kwargs: dict[str, Any] = {}
    for key, value in options.items():
        if key in accepted:
            kwargs[key] = value
        elif key in _DEFAULT_VALUES and value in _DEFAULT_VALUES[key]:
            continue  # the default this engine already runs
        else:
            raise EvalError(f"the in-process engine has no option {key!r} "
                            f"(it takes: {', '.join(sorted(accepted))})")
    return kwargs


class EngineBackend(Backend):
    def __init__(self, model: str, options: dict[str, Any] | None = None) -> None:
        from tokenmill.llm import LLM

        self.model = model
        self.options = dict(options or {})
        self.llm = LLM(model, **engine_kwargs(self.options))
        self.tokenizer = self.llm.tokenizer
        self.name = model

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prefix_token(self) -> int:
        token = self.tokenizer.bos_token_id
        if token is None:
            token = self.tokenizer.eos_token_id
        if token is None:
            raise EvalError(f"model {self.model} has neither a BOS nor an EOS token")
        return token

    def prompt_bos(self) -> int | None:
        return self.tokenizer.bos_token_id if self.tokenizer.add_bos_token else None

    def max_length(self) -> int:
        return int(self.llm.core.max_model_len) - 1

    def score(self, prompts: Sequence[list[int]], top_k: int,
              progress: Progress | None = None) -> list[list[PositionLogprobs]]:
        from tokenmill.engine.request import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k)
        results: list[list[PositionLogprobs]] = []
        for start in range(0, len(prompts), CHUNK):
            chunk = [list(p) for p in prompts[start:start + CHUNK]]
            for prompt, output in zip(chunk, self.llm.generate(chunk, params), strict=True):
                entries = output.prompt_logprobs or []
                positions = []
                for i in range(1, len(prompt)):
                    lp = entries[i]
                    if lp is None:
                        raise EvalError("the engine returned no logprob for a prompt token")
                    top: dict[int | str, float] = {t: v for t, v in lp.top[:top_k]}
                    top.setdefault(lp.token_id, lp.logprob)  # as the server's top dict has it
                    positions.append(PositionLogprobs(lp.token_id, lp.logprob, top))
                results.append(positions)
            if progress is not None:
                progress(len(chunk))
        return results

    def generate(self, prompts: Sequence[Prompt], options: GenerateOptions,
                 progress: Progress | None = None) -> list[Generation]:
        from tokenmill.engine.request import SamplingParams

        params = SamplingParams(max_tokens=options.max_tokens, temperature=options.temperature, seed=options.seed,
                                stop=list(options.stop))
        results: list[Generation] = []
        for start in range(0, len(prompts), CHUNK):
            chunk = list(prompts[start:start + CHUNK])
            for output in self.llm.generate(chunk, params):
                out = output.outputs[0]
                finish = None if out.finish_reason is None else out.finish_reason.value
                results.append(Generation(out.text, list(out.token_ids), [], finish))
            if progress is not None:
                progress(len(chunk))
        return results

    def describe(self) -> dict[str, Any]:
        return {"kind": "engine", "model": self.model, "options": self.options}
