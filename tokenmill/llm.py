"""In-process offline API, shaped like vLLM's `LLM`: load once, generate for many prompts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from tokenmill.config import (
    SHARED_PREFIX_WAIT_TOKENS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ProfileConfig,
    SchedulerConfig,
    SpeculativeConfig,
    compile_mode,
)
from tokenmill.engine.beam_search import BeamSearch, BeamSearchParams, beam_output
from tokenmill.engine.core import EngineCore
from tokenmill.engine.inputs import fan_out
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.outputs import CompletionOutput, PromptLogprobsCarry, RequestOutput
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.service_class import ServiceClass, parse_service_tier
from tokenmill.errors import RequestValidationError
from tokenmill.kernels import DEFAULT_QUANTIZATION
from tokenmill.models.catalog import DEFAULT_MODEL

Prompt = str | list[int]
Messages = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, dtype: str = "auto", device: str = "auto",
                 max_model_len: int | None = None, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_bytes: int | None = None, enable_prefix_caching: bool = True,
                 max_num_batched_tokens: int = 2048, max_num_seqs: int = 64, policy: str = "fcfs",
                 enable_chunked_prefill: bool = True, seed: int = 0, num_threads: int | None = None,
                 gemm_backend: str = "auto", attention_backend: str = "auto", kv_cache_dtype: str = "auto",
                 quantization: str = DEFAULT_QUANTIZATION, amx_bf16: bool = False, enforce_eager: bool = False,
                 compile: str | bool = "auto", async_scheduling: str = "auto",
                 shared_prefix_wait_tokens: int = SHARED_PREFIX_WAIT_TOKENS,
                 speculative: str | None = None,
                 draft_model: str | None = None, draft_quantization: str | None = None, draft_vocab: int | None = None,
                 num_speculative_tokens: int = 0, ngram_min: int = 1, ngram_max: int = 4,
                 suffix_cache_tokens: int = 65536,
                 profile: int | ProfileConfig | None = None, adapt_threads: bool = True) -> None:
        """`profile`: N steps (or a ProfileConfig) to profile, written to ./tokenmill-profile (docs/performance.md).
        `compile`: "auto", "on"/True, "off"/False: torch.compile of the decoder stack (models/compiled.py).
        `adapt_threads`: run fewer compute threads while other processes take some of the CPUs (engine/cpu_share.py).
        `async_scheduling`: "on" schedules step N + 1 while N runs (engine/pipeline.py); "auto" is off for now.
        `shared_prefix_wait_tokens`: SchedulerConfig's (in-batch prefix sharing; 0: off)."""
        self.config = EngineConfig(
            ModelConfig(model, dtype, device, max_model_len, seed, gemm_backend, attention_backend, quantization,
                        amx_bf16, enforce_eager, compile_mode(compile)),
            CacheConfig(block_size, num_kv_blocks, kv_cache_bytes, enable_prefix_caching=enable_prefix_caching,
                        kv_cache_dtype=kv_cache_dtype),
            SchedulerConfig(max_num_batched_tokens, max_num_seqs, policy, enable_chunked_prefill,
                            async_scheduling=async_scheduling, shared_prefix_wait_tokens=shared_prefix_wait_tokens),
            num_threads,
            SpeculativeConfig(speculative, num_speculative_tokens, ngram_min, ngram_max, draft_model,
                              draft_quantization, draft_vocab=draft_vocab,
                              suffix_cache_tokens=suffix_cache_tokens),
            _profile_config(profile),
            adapt_threads=adapt_threads,
        )
        self.engine = LLMEngine.from_config(self.config)
        self.loaded = self.engine.loaded
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @property
    def core(self) -> EngineCore:
        return self.engine.core

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams | None = None,
                 *, priority: Sequence[int] | None = None, use_tqdm: bool = False,
                 service_class: ServiceClass | str = ServiceClass.STANDARD,
                 cache_salt: str | None = None) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs in prompt order.

        `service_class`: interactive, standard or batch (or an OpenAI service_tier value) for all of them.
        `cache_salt`: they share cached prefix blocks and outputs only with requests of the same salt."""
        batch = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        klass = _as_service_class(service_class)
        order = [self._add(prompt, params, priority[i] if priority else 0, klass, cache_salt)
                 for i, prompt in enumerate(batch)]
        return self._run(order, params.n, use_tqdm)

    def chat(self, messages: Messages | Sequence[Messages], sampling_params: SamplingParams | None = None,
             *, use_tqdm: bool = False, service_class: ServiceClass | str = ServiceClass.STANDARD,
             cache_salt: str | None = None) -> list[RequestOutput]:
        conversations = _as_conversations(messages)
        prompts = [self.tokenizer.apply_chat_template(conv, add_generation_prompt=True) for conv in conversations]
        # The template already carries BOS where the model wants it.
        token_prompts = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm, service_class=service_class,
                             cache_salt=cache_salt)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, *, n: int | None = None,
                    logprobs: int | None = None, cache_salt: str | None = None) -> list[RequestOutput]:
        """Beam search (transformers' algorithm: engine/beam_search.py) for each prompt, all prompts' beams in one
        batch a step; each output holds the `n` best results (default: the beam width), best first."""
        encoded = [self.engine.encode(prompt) for prompt in _as_prompt_list(prompts)]
        room = self.engine.limits.max_model_len
        for prompt in encoded:  # all checked before any request runs
            if len(prompt.token_ids) >= room:
                raise RequestValidationError(f"a prompt of {len(prompt.token_ids)} tokens leaves no room for output "
                                             f"in the model's context of {room} tokens", "prompt")
        # each search ends at the context limit, as a sampled answer would
        searches = [BeamSearch(replace(params, max_tokens=min(params.max_tokens, room - len(prompt.token_ids))),
                               self.engine.eos_token_ids, logprobs) for prompt in encoded]
        while live := [(prompt, search) for prompt, search in zip(encoded, searches, strict=True)
                       if not search.is_done]:
            order = [[self._add(prompt.token_ids + list(beam.token_ids), search.step_params(), 0,
                                ServiceClass.STANDARD, cache_salt) for beam in search.beams]
                     for prompt, search in live]
            done = self._run([rid for rids in order for rid in rids], 1, False)
            for (_, search), rids in zip(live, order, strict=True):
                tops, done = done[:len(rids)], done[len(rids):]
                search.advance([out.outputs[0].logprobs[0] for out in tops if out.outputs[0].logprobs])
        return [RequestOutput(str(next(self._ids)), prompt.text, prompt.token_ids,
                              [beam_output(i, beam, self.tokenizer, logprobs)
                               for i, beam in enumerate(search.best(n or params.beam_width))], True)
                for prompt, search in zip(encoded, searches, strict=True)]

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               service_class: ServiceClass | str = ServiceClass.STANDARD,
               cache_salt: str | None = None) -> Iterator[CompletionOutput]:
        """Generate for one prompt, yielding each step's output (`text_delta` holds the new text)."""
        params = replace(sampling_params or SamplingParams(), n=1)
        request_id = self._add(prompt, params, 0, _as_service_class(service_class), cache_salt) + "-0"
        try:
            for output in self._outputs():
                if output.request_id == request_id:
                    yield output.outputs[0]
        finally:
            self.engine.abort(request_id)

    def _outputs(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished:
            yield from self.engine.step().outputs

    def _add(self, prompt: Prompt, params: SamplingParams, priority: int, service_class: ServiceClass,
             cache_salt: str | None = None) -> str:
        encoded = replace(self.engine.encode(prompt), cache_salt=cache_salt)
        request_id = str(next(self._ids))
        for child in fan_out(0, encoded, params):
            self.engine.add_request(f"{request_id}-{child.index}", encoded, child.params, index=child.index,
                                    priority=priority, service_class=service_class)
        return request_id

    def _run(self, order: list[str], n: int, use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        prompt_logprobs = PromptLogprobsCarry()
        bar = tqdm(total=len(order) * n, desc="generate", unit="req", disable=not use_tqdm)
        for output in map(prompt_logprobs.carry, self._outputs()):
            if output.finished:
                finished[output.request_id] = output
                bar.update(1)
        bar.close()
        return [_merge([finished[f"{rid}-{i}"] for i in range(n)], rid) for rid in order]


def _merge(children: list[RequestOutput], request_id: str) -> RequestOutput:
    first = children[0]
    completions: list[CompletionOutput] = [c.outputs[0] for c in children]
    return RequestOutput(request_id, first.prompt, first.prompt_token_ids, completions, True, first.metrics,
                         first.num_cached_tokens, first.prompt_logprobs)


def _as_service_class(value: ServiceClass | str) -> ServiceClass:
    return value if isinstance(value, ServiceClass) else parse_service_tier(value)


def _profile_config(profile: int | ProfileConfig | None) -> ProfileConfig:
    if profile is None:
        return ProfileConfig()
    return profile if isinstance(profile, ProfileConfig) else ProfileConfig(num_steps=profile)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [list(prompts)]  # type: ignore[arg-type]  # one prompt of token ids
    return list(prompts)  # type: ignore[arg-type]


def _as_conversations(messages: Messages | Sequence[Messages]) -> list[Messages]:
    if messages and isinstance(messages[0], dict):
        return [messages]  # type: ignore[list-item]  # one conversation
    return list(messages)  # type: ignore[arg-type]
