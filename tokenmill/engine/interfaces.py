"""The narrow dataclasses between the scheduler and the model runner, in both directions.

    Scheduler.schedule() ──SchedulerOutput──▶ ModelRunner.execute() ──RunnerOutput──▶ Scheduler.update()

Neither side imports the other: both import this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenmill.engine.request import Request, TokenLogprob

if TYPE_CHECKING:
    import torch


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute tokens [num_computed_tokens, + num_new_tokens)."""

    request: Request
    num_computed_tokens: int  # before this step; the first query token's position
    num_new_tokens: int  # includes the speculative tokens
    block_ids: list[int]
    # Proposed tokens scored after the known ones, as ordinary query tokens of this step: the
    # query is token_ids[num_computed_tokens:] + spec_token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: torch.Tensor | None = None  # q of each proposal [len(spec_token_ids), vocab]; None: point masses

    @property
    def needs_sample(self) -> bool:
        """The chunk reaches the last known token (and every proposal), so its logits give the next token."""
        return self.num_computed_tokens + self.num_new_tokens == self.request.num_tokens + len(self.spec_token_ids)

    @property
    def num_sample_rows(self) -> int:
        """Logit rows to sample from: the last known token's and one per proposed token."""
        return 1 + len(self.spec_token_ids) if self.needs_sample else 0


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the first `num_rows` rows of KV block `src` into block `dst` (every layer), before the step's
    forward: a request continuing a cached partial block (engine/kv_cache.py)."""

    src: int
    dst: int
    num_rows: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_preempted: int = 0
    block_copies: list[BlockCopy] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SampledTokens:
    """The tokens a step produced for one request, in order, each with its logprob entry (None
    when the request asked for none). One token per step without speculation."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    # The target's top-1 probability at each token's row, when the runner tracks it (a draft proposer's
    # controller plans requests that are off from it: engine/spec/controller.py); None otherwise.
    confidences: list[float] | None = None


@dataclass(slots=True)
class RunnerOutput:
    """The model runner's answer to one SchedulerOutput, keyed by request id."""

    sampled: dict[str, SampledTokens] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
