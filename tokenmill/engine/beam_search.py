"""Beam search: Hugging Face transformers' algorithm, so its beams are transformers' beams token for token,
driven over the engine one step at a time.

Each step scores every live beam as a prompt (the request's prompt, then the beam's tokens) with
`max_tokens=1` and the top-K logprobs of the raw distribution; prefix caching makes that a prefill of the
beam's last partial block, not of its whole prefix (vLLM's beam search runs the same way, above its engine).
The search itself (`BeamSearch`) only sees those top-K lists, so the offline API and the server share it.

One step, with W the beam width, g the tokens generated so far and K = (1 + number of stop tokens) * W
(at least 2W; transformers' `beams_to_keep`):

    candidates  = the K best (beam's sum of logprobs + token logprob) over every beam and token
    finished    = a candidate ending on a stop token, or reaching max_tokens
    results    += each finished candidate among the first W, scored  sum / (g + 1) ** length_penalty;
                  the W best results are kept
    next beams  = the first W unfinished candidates

The search ends when every candidate finished, when W results are in and `early_stopping` is True, or
when no beam can still beat the worst of W results (`early_stopping` False: its sum judged at the current
length; "never" with a positive length penalty: at max_tokens). The per-beam top-K is enough: a
candidate among the K best over all beams has fewer than K better candidates in its own beam.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from tokenmill.engine.outputs import CompletionOutput
from tokenmill.engine.request import MAX_LOGPROBS, FinishReason, SamplingParams, TokenLogprob
from tokenmill.errors import RequestValidationError
from tokenmill.models.loading.tokenizer import Tokenizer

EarlyStopping = bool | Literal["never"]


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0  # > 0 favours longer results, < 0 shorter
    early_stopping: EarlyStopping = False
    ignore_eos: bool = False  # the model's end-of-sequence tokens end no beam (stop_token_ids still do)
    stop_token_ids: tuple[int, ...] = ()

    def num_candidates(self, num_stop_ids: int) -> int:
        return max(2, 1 + num_stop_ids) * self.beam_width

    def validate(self) -> None:
        if self.beam_width < 1:
            raise RequestValidationError("the beam width must be at least 1", "n")
        if self.max_tokens < 1:
            raise RequestValidationError("beam search needs max_tokens of at least 1", "max_tokens")


@dataclass(frozen=True, slots=True)
class Beam:
    token_ids: tuple[int, ...]  # generated, a stop token included
    logprobs: tuple[TokenLogprob, ...]  # of each generated token, with its step's top candidates
    cum_logprob: float
    score: float  # a result's length-normalised sum; a live beam's sum
    finish_reason: FinishReason | None = None


class BeamSearch:
    def __init__(self, params: BeamSearchParams, eos_token_ids: Iterable[int], num_logprobs: int | None = None,
                 width_field: str = "n") -> None:
        """`num_logprobs`: the top logprobs the caller returns with each token (a step asks for at least as many);
        `width_field`: the request field an error about the width names."""
        params.validate()
        self.params = params
        self.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else
                                                            frozenset(eos_token_ids))
        self.num_candidates = params.num_candidates(len(self.stop_ids))
        if self.num_candidates > MAX_LOGPROBS:
            raise RequestValidationError(
                f"beam search scores {self.num_candidates} candidates a beam (width {params.beam_width} × "
                f"{self.num_candidates // params.beam_width} for {len(self.stop_ids)} stop tokens); at most "
                f"{MAX_LOGPROBS}: use a smaller width", width_field)
        self.num_top = min(MAX_LOGPROBS, max(self.num_candidates, num_logprobs or 0))
        self.beams: list[Beam] = [Beam((), (), 0.0, 0.0)]
        self.results: list[Beam] = []  # the best finished, best first, at most the width
        self.is_done = False
        self._improvable = True

    def advance(self, tops: Sequence[TokenLogprob]) -> None:
        """One step: `tops[i]` is the next-token distribution's top of `self.beams[i]` (>= num_candidates)."""
        assert not self.is_done and len(tops) == len(self.beams)
        p, width = self.params, self.params.beam_width
        num_generated = len(self.beams[0].token_ids) + 1
        ranked: list[tuple[float, Beam, int, float, TokenLogprob]] = []
        for beam, top in zip(self.beams, tops, strict=True):
            for token_id, logprob in top.top[:self.num_candidates]:
                ranked.append((beam.cum_logprob + logprob, beam, token_id, logprob, top))
        ranked.sort(key=lambda c: c[0], reverse=True)  # stable: ties keep beam order, then the top's order
        candidates = [self._extend(*c, num_generated) for c in ranked[:self.num_candidates]]
        was_full = len(self.results) == width
        if self._improvable and not (was_full and p.early_stopping is True):
            self.results += [c for c in candidates[:width] if c.finish_reason is not None]
            self.results = sorted(self.results, key=lambda b: b.score, reverse=True)[:width]
        self.beams = [c for c in candidates if c.finish_reason is None][:width]
        if self._improvable and len(self.results) == width and self.beams:
            length = p.max_tokens if p.early_stopping == "never" and p.length_penalty > 0 else num_generated
            self._improvable = self.beams[0].cum_logprob / length ** p.length_penalty > self.results[-1].score
        all_full = len(self.results) == width and p.early_stopping is True
        self.is_done = not self._improvable or all_full or not self.beams

    def step_params(self) -> SamplingParams:
        """What one beam's scoring request asks the engine: one token (any: it is not kept) and the top
        candidates of the raw distribution."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=self.num_top, ignore_eos=True)

    def best(self, n: int) -> list[Beam]:
        """The `n` best results, best first (live beams, scored at their length, where too few finished)."""
        assert self.is_done
        live = [self._finish(b, FinishReason.LENGTH) for b in self.beams]
        return sorted(self.results + live[:max(0, n - len(self.results))], key=lambda b: b.score, reverse=True)[:n]

    def _extend(self, cum: float, beam: Beam, token_id: int, logprob: float, top: TokenLogprob,
                num_generated: int) -> Beam:
        rank = next((i for i, (t, _) in enumerate(top.top) if t == token_id), len(top.top)) + 1
        extended = Beam((*beam.token_ids, token_id),
                        (*beam.logprobs, TokenLogprob(token_id, logprob, rank, top.top)), cum, cum)
        if token_id in self.stop_ids:
            return self._finish(extended, FinishReason.STOP)
        if num_generated >= self.params.max_tokens:
            return self._finish(extended, FinishReason.LENGTH)
        return extended

    def _finish(self, beam: Beam, reason: FinishReason) -> Beam:
        score = beam.cum_logprob / len(beam.token_ids) ** self.params.length_penalty
        return Beam(beam.token_ids, beam.logprobs, beam.cum_logprob, score, reason)


def beam_output(index: int, beam: Beam, tokenizer: Tokenizer, num_logprobs: int | None,
                skip_special_tokens: bool = True) -> CompletionOutput:
    """A result as a choice: its text without the stop token that ended it (as a sampled answer's), its
    tokens with it, and its logprobs (top `num_logprobs` of each step) when asked for."""
    ended_on_stop = beam.finish_reason is FinishReason.STOP
    shown = beam.token_ids[:-1] if ended_on_stop else beam.token_ids
    logprobs = None if num_logprobs is None else [
        TokenLogprob(lp.token_id, lp.logprob, lp.rank, lp.top[:num_logprobs]) for lp in beam.logprobs]
    # decoded as a sampled answer's stream is (a character whose bytes never completed shows no text)
    stream = tokenizer.new_decode_stream(skip_special_tokens)
    text = "".join(stream.step(token_id) for token_id in shown)
    return CompletionOutput(index, text, list(beam.token_ids), logprobs, beam.finish_reason,
                            beam.token_ids[-1] if ended_on_stop else None, text, len(beam.token_ids))
