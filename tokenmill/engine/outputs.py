"""User-facing results: text, token ids, logprobs and timings of one completion."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.request import FinishReason, RequestTimes, SpecRequestStats, TokenLogprob


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # cumulative
    token_ids: list[int]  # cumulative
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    text_delta: str = ""  # new text since the previous output of this request
    num_new_tokens: int = 0

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass(slots=True)
class RequestMetrics:
    """Seconds of the request's timeline: queue → prefill (to first token) → decode."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    num_cached_tokens: int = 0
    spec_mean_accepted_length: float | None = None  # tokens per verified draft; None without speculation
    accepted_prediction_tokens: int = 0  # tokens of SamplingParams.prediction the output took
    rejected_prediction_tokens: int = 0  # tokens of it verification scored and refused

    @classmethod
    def from_times(cls, t: RequestTimes, num_cached_tokens: int,
                   spec: SpecRequestStats | None = None) -> RequestMetrics:
        if spec is None:
            return cls(t.arrival, t.first_scheduled, t.first_token, t.finished, num_cached_tokens)
        return cls(t.arrival, t.first_scheduled, t.first_token, t.finished, num_cached_tokens,
                   spec.mean_accepted_length, spec.num_prediction_accepted, spec.num_prediction_rejected)

    @property
    def queue_s(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def prefill_s(self) -> float | None:
        if self.first_token is None or self.first_scheduled is None:
            return None
        return self.first_token - self.first_scheduled

    @property
    def decode_s(self) -> float | None:
        if self.finished is None or self.first_token is None:
            return None
        return self.finished - self.first_token


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob | None] | None = None  # [None, lp(token 1), ...] when asked for


class PromptLogprobsCarry:
    """A request's prompt logprobs come with its first output only (streams send them once); callers that
    keep only finished outputs (LLM.generate, tokenmill batch) pass every output through `carry`, which
    puts them on the finishing one."""

    def __init__(self) -> None:
        self._kept: dict[str, list[TokenLogprob | None]] = {}

    def carry(self, output: RequestOutput) -> RequestOutput:
        if output.prompt_logprobs is not None:
            self._kept[output.request_id] = output.prompt_logprobs
        if output.finished:
            output.prompt_logprobs = self._kept.pop(output.request_id, None)
        return output
