"""EngineCore plus OutputProcessor: the one driver loop that the offline `LLM`, the async engine
and `tokenmill batch` all run (vLLM V1's LLMEngine).

    add_request(id, prompt, params) ──▶ EngineCore.add_request + OutputProcessor.add
    step() ──▶ EngineCore.step() ──EngineOutput──▶ OutputProcessor ──RequestOutput──▶ caller
                     ▲                                    │ ended by a stop string
                     └────────────── abort ───────────────┘
    abort(id) ──▶ the request's last output, finished with reason abort

Not thread-safe: one thread owns it (the caller of `LLM`, or the async engine's engine thread).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tokenmill.config import EngineConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.inputs import EncodedPrompt, RequestLimits
from tokenmill.engine.loader import LoadedEngine, eos_ids, load_engine
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.profiling import StepProfiler
from tokenmill.engine.request import SamplingParams
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.stats import StepStats
from tokenmill.engine.structured.manager import StructuredOutputs
from tokenmill.models.loading.tokenizer import Tokenizer


@dataclass(slots=True)
class EngineStep:
    outputs: list[RequestOutput]  # this step's delta of every request that moved, in engine order
    stats: StepStats

    @property
    def finished(self) -> list[RequestOutput]:
        return [o for o in self.outputs if o.finished]


class LLMEngine:
    def __init__(self, loaded: LoadedEngine) -> None:
        self.loaded = loaded
        self.core: EngineCore = loaded.core
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.eos_token_ids = eos_ids(loaded)
        self.processor = OutputProcessor(self.tokenizer)
        # Grammars (structured outputs): compiled on first use, masks only rows that carry one.
        self.structured = StructuredOutputs(self.tokenizer, self.core.arch.vocab_size, self.eos_token_ids)
        self.core.runner.sampler.logits_processor = self.structured
        profile = self.core.config.profile
        self.profiler = StepProfiler(profile, self.core) if profile.enabled else None

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        return cls(load_engine(config))

    @property
    def limits(self) -> RequestLimits:
        return self.core.limits

    def encode(self, prompt: str | list[int]) -> EncodedPrompt:
        if isinstance(prompt, str):
            return EncodedPrompt(prompt, self.tokenizer.encode(prompt))
        return EncodedPrompt(None, list(prompt))

    def add_request(self, request_id: str, prompt: EncodedPrompt, params: SamplingParams, *, index: int = 0,
                    priority: int = 0, service_class: ServiceClass = ServiceClass.STANDARD) -> None:
        """Queue one engine request (`params.n == 1`; see `inputs.fan_out`); `index` is its choice index."""
        if params.structured is not None:
            self.structured.compile(params.structured)  # GrammarError before queueing; then a cache hit
        self.core.add_request(request_id, prompt.token_ids, params, self.eos_token_ids, priority,
                              service_class=service_class, cache_salt=prompt.cache_salt)
        self.processor.add(request_id, prompt.text, prompt.token_ids, params, index)

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now; its final output (reason abort), or None if it was not in flight."""
        out = self.core.abort(request_id)
        if out is None:
            return None
        processed = self.processor.process_outputs([out])
        return processed.outputs[0] if processed.outputs else None

    @property
    def has_unfinished(self) -> bool:
        return self.core.has_unfinished

    def step(self) -> EngineStep:
        if self.profiler is not None and not self.profiler.done:
            step = self.profiler.step(self._step)
            if not self.has_unfinished and self.profiler.result.records:
                self.profiler.finish()  # the work ran out before the window did: write what there is
            return step
        return self._step()

    def _step(self) -> EngineStep:
        result = self.core.step()
        with self.core.timer.phase("output"):
            processed = self.processor.process_outputs(result.outputs)
            if processed.reqs_to_abort:
                for request_id in processed.reqs_to_abort:
                    self.core.abort(request_id)  # its text already ended: free its blocks now
        if not processed.reqs_to_abort:
            return EngineStep(processed.outputs, result.stats)
        # The step's gauges predate these aborts; an engine that now idles must not report them running.
        now = self.core.stats()
        stats = replace(result.stats, num_running=now.num_running, num_waiting=now.num_waiting,
                        kv_usage=now.kv_usage)
        return EngineStep(processed.outputs, stats)

    def stats(self) -> StepStats:
        """The gauges now, outside a step (zero tokens): what a stats listener reads after aborts."""
        return self.core.stats()

    def reset(self) -> None:
        """Drop every request (after a failed step); weights and KV tensors stay."""
        self.core.reset()
        self.processor = OutputProcessor(self.tokenizer)
        self.structured.reset()
        self.core.runner.sampler.logits_processor = self.structured
