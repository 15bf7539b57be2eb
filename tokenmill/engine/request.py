"""The request as the engine sees it, its sampling knobs, and what the engine hands back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.structured.params import StructuredOutputParams
from tokenmill.errors import RequestValidationError

if TYPE_CHECKING:
    import torch


# Asynchronous scheduling (engine/pipeline.py): the token of a step still running, appended to
# token_ids when the next step is scheduled and replaced by the real token when the step's result
# arrives. No vocabulary id is negative, so it can never pass for a token.
PLACEHOLDER = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"


MAX_LOGPROBS = 20  # top-n logprobs a request may ask for per token (the API's bound too: server/protocol.py)


@dataclass(slots=True)
class SamplingParams:
    """OpenAI/vLLM sampling knobs. `temperature == 0` means greedy."""

    max_tokens: int | None = 16  # None: up to the context limit
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the sampled one)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (disables prefix-cache hits)
    skip_special_tokens: bool = True
    structured: StructuredOutputParams | None = None  # a grammar the output must match (engine/structured)
    logit_bias: dict[int, float] | None = None  # added to the token's logit before sampling (OpenAI: -100..100;
    # -100 bans a token, +100 all but forces it); logprobs stay those of the raw model, as with penalties
    # Predicted outputs (OpenAI's `prediction`): tokens the output is expected to contain, proposed to the
    # speculator (engine/spec/prediction.py; one for predictions alone where no method is set, unless steps
    # overlap); never changes the output
    prediction: list[int] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: only these may be sampled (the rest masked)
    # vLLM's bad_words as token sequences: a sequence's last token is banned where the output ends with the rest
    bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.temperature >= 0.0, "temperature must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= -1, "top_k must be -1, 0 (disabled) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty must be > 0"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (self.n >= 1, "n must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be >= 0"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens must be <= max_tokens"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, f"logprobs must be in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (not self.logit_bias or all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
             "logit_bias values must be in [-100, 100]"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty"),
            (not self.bad_words_token_ids or all(self.bad_words_token_ids), "bad words must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise RequestValidationError(message)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of a sampled token under the model's raw distribution, with the top-n."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass(slots=True)
class RequestTimes:
    """Wall-clock timeline of one request (time.monotonic seconds)."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass(slots=True)
class SpecRequestStats:
    """One request's speculation so far: drafts verified, tokens proposed, tokens accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Of those, the ones a prediction (SamplingParams.prediction) proposed: accepted, and scored but rejected
    num_prediction_accepted: int = 0
    num_prediction_rejected: int = 0
    recent_acceptance: float = 1.0  # moving average of accepted / proposed per draft (the controller's input)

    # Moving average of whether a drafting attempt kept any guess (a draft gate may drop the first):
    # the share of draft forwards that reach verification at all.
    recent_kept: float = 1.0
    # The target's top-1 probability at each token it emitted since the speculation controller last
    # read them (only while it asks for them: ModelRunner.track_confidence; the controller drains it).
    target_confidences: list[float] = field(default_factory=list)

    def note_acceptance(self, fraction: float) -> None:
        """One more verified draft's accepted fraction into recent_acceptance."""
        self.recent_acceptance = 0.7 * self.recent_acceptance + 0.3 * fraction

    def note_kept(self, kept: bool) -> None:
        """One more drafting attempt into recent_kept."""
        self.recent_kept = 0.7 * self.recent_kept + (0.3 if kept else 0.0)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verified draft: accepted ones plus the one the target always adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(slots=True)
class Request:
    """Engine-side state. `num_computed_tokens` moves towards `num_tokens` within the token budget."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower runs first, as in vLLM (within a service class)
    arrival_time: float = field(default_factory=time.monotonic)
    service_class: ServiceClass = ServiceClass.STANDARD
    cache_salt: str | None = None  # prefix and output caches are shared only among requests of one salt
    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)  # hash chain over full blocks of token_ids
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # for prompt tokens 1.. (0 has none)
    # Speculative decoding: tokens a proposer guessed to follow token_ids, verified by the next step
    # (the scheduler consumes and clears them), and this request's running totals.
    spec_token_ids: list[int] = field(default_factory=list)
    # The distributions the proposer drew spec_token_ids from, [k, vocab] (a draft sampling for a sampled
    # request); None: point masses (a lookup, a greedy draft). Consumed with spec_token_ids.
    spec_draft_probs: torch.Tensor | None = None
    spec_from_prediction: bool = False  # spec_token_ids came from the request's prediction
    spec_stats: SpecRequestStats = field(default_factory=lambda: SpecRequestStats())
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.times = RequestTimes(arrival=self.arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def has_pending_token(self) -> bool:
        """Its last token is a step's still running (asynchronous scheduling): known on the device, not yet here."""
        return bool(self.token_ids) and self.token_ids[-1] == PLACEHOLDER


@dataclass(slots=True)
class EngineOutput:
    """What one engine step produced for one request: a delta of new tokens."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    times: RequestTimes | None = None  # the request's timeline (shared, updated in place)
    prompt_logprobs: list[TokenLogprob] | None = None  # with the first token, when asked for
    spec: SpecRequestStats | None = None  # the request's speculation so far (shared, updated in place)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
