"""The engine core's one handle on speculation: before schedule(), leave proposals on requests."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

import torch

from tokenmill.config import DEFAULT_SPECULATIVE_TOKENS, ModelConfig, SpeculativeConfig
from tokenmill.engine.model_runner import ModelRunner
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.spec import draft as _draft  # noqa: F401 - registers "draft"
from tokenmill.engine.spec import hybrid as _hybrid  # noqa: F401 - registers "ngram-draft" (+ suffix-draft)
from tokenmill.engine.spec import ngram as _ngram  # noqa: F401 - registers "ngram"
from tokenmill.engine.spec import suffix as _suffix  # noqa: F401 - registers "suffix"
from tokenmill.engine.spec.base import PROPOSERS, Proposer
from tokenmill.engine.spec.controller import SpecController
from tokenmill.engine.spec.prediction import Predictions
from tokenmill.errors import TokenmillError
from tokenmill.models.arch import ArchConfig

# The bucket of a proposal the request's grammar forces (structured outputs): certain unless the model
# picks another tokenization of the same bytes, so its prior is near 1.
FORCED_BUCKET = 1 << 20
FORCED_PRIOR = 0.98
# The bucket of a proposal from the request's own prediction (predicted outputs, spec/prediction.py): the
# caller's expected answer, mostly copied where it is right, so its prior is high; its rate is learned.
PREDICTION_BUCKET = FORCED_BUCKET + 1
PREDICTION_PRIOR = 0.9


class GrammarView(Protocol):
    """What the speculator asks of the requests' grammars (structured outputs)."""

    def forced_tokens(self, request: Request) -> list[int]:
        """The tokens the request's grammar forces next ([] where none)."""

    def count_valid(self, request: Request, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the request's grammar allows next."""


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_model_len: int) -> None:
        self.config = config
        self.proposer = proposer
        self.controller = SpecController(config, self._bucket_prior)
        self.max_model_len = max_model_len
        self._decode_tokens = 0  # tokens the last step needed for its decoding requests and proposals
        self._propose_s = 0.0  # time the last propose() spent in the proposer (draft forwards)
        self.last_gated = 0  # guesses the last propose()'s gate dropped
        self.last_forced = 0  # tokens the last propose() took from grammars (forced_tokens)
        # Where a request's grammar forces its next tokens, they are its proposal, whatever the method
        # (SGLang's jump-forward, verified like any guess); the engine core sets it. None: never.
        self.grammar: GrammarView | None = None
        # Elsewhere, a request's prediction (SamplingParams.prediction) where it is aligned with the output.
        self.predictions = Predictions()

    def _bucket_prior(self, bucket: int) -> float | None:
        if bucket == FORCED_BUCKET:
            return FORCED_PRIOR
        return PREDICTION_PRIOR if bucket == PREDICTION_BUCKET else self.proposer.bucket_prior(bucket)

    def propose(self, running: Iterable[Request]) -> None:
        """Proposals for every running request about to decode (its next step scores one token)."""
        running = list(running)
        self.proposer.retain(r.request_id for r in running)
        self.predictions.retain({r.request_id for r in running})
        decoding = [r for r in running
                    if r.status is RequestStatus.RUNNING and r.num_computed_tokens == r.num_tokens - 1]
        self._decode_tokens = len(decoding)
        self._propose_s = 0.0
        self.last_gated = self.last_forced = 0
        for request in decoding:  # a request the budget skipped last step keeps no stale guesses
            request.spec_token_ids, request.spec_draft_probs, request.spec_from_prediction = [], None, False
        if not decoding:
            return
        forced = self._forced(decoding)
        buckets = self.proposer.buckets(decoding)
        predicted = self._predicted(decoding, forced)  # takes from `forced` the requests it serves
        looked_up = self._lookups_past_forced(decoding, buckets, forced)  # likewise, of those left
        own = forced | predicted  # the request's own tokens: point masses, no draft forward
        buckets = [PREDICTION_BUCKET if r.request_id in predicted else FORCED_BUCKET if r.request_id in forced else b
                   for r, b in zip(decoding, buckets, strict=True)]
        catch_up = [0 if r.request_id in own else c
                    for r, c in zip(decoding, self.proposer.catch_up_tokens(decoding), strict=True)]
        plan = self.controller.plan(decoding, buckets, catch_up)
        ks = [min(k, self._room(r)) for r, k in zip(decoding, plan, strict=True)]
        chosen = [(r, k, b) for r, k, b in zip(decoding, ks, buckets, strict=True) if k > 0]
        if not chosen:
            return
        asked = [(r, k) for r, k, _ in chosen if r.request_id not in own and r.request_id not in looked_up]
        gate = self.controller.gate(len(decoding)) if self.config.adaptive and self.proposer.takes_gate else None
        started = time.monotonic()
        guesses = iter(self.proposer.propose([r for r, _ in asked], [k for _, k in asked], gate) if asked else [])
        proposals = [own[r.request_id] if r.request_id in own else
                     looked_up[r.request_id] if r.request_id in looked_up else next(guesses) for r, _, _ in chosen]
        self.last_forced = sum(min(k, len(forced[r.request_id])) for r, k, _ in chosen if r.request_id in forced)
        self._propose_s = time.monotonic() - started
        self.last_gated = gate.dropped if gate is not None else 0
        # The proposer's last_* describe its last propose(): this step's only if it was asked.
        draft_probs: Mapping[str, torch.Tensor] = self.proposer.last_draft_probs if asked else {}
        for seconds in self.proposer.last_decode_forward_s if asked else ():
            self.controller.observe_draft(seconds)
        for extra, seconds in self.proposer.last_catch_ups if asked else ():
            self.controller.observe_catch_up(extra, seconds)
        for (request, k, bucket), tokens in zip(chosen, proposals, strict=True):
            request.spec_token_ids = tokens[:k]
            request.spec_from_prediction = request.request_id in predicted
            q = None if request.request_id in own else draft_probs.get(request.request_id)  # own: point masses
            request.spec_draft_probs = q[:len(request.spec_token_ids)] if q is not None and tokens else None
            self._decode_tokens += len(request.spec_token_ids)
            if gate is not None and bucket is None:  # how often drafting for it gets past the gate (κ)
                request.spec_stats.note_kept(bool(tokens))

    def _forced(self, decoding: list[Request]) -> dict[str, list[int]]:
        """Per request whose grammar forces its next tokens, those tokens."""
        if self.grammar is None:
            return {}
        out = {}
        for request in decoding:
            if request.params.structured is not None and (tokens := self.grammar.forced_tokens(request)):
                out[request.request_id] = tokens
        return out

    def _predicted(self, decoding: list[Request], forced: dict[str, list[int]]) -> dict[str, list[int]]:
        """Per request with a prediction aligned with its output, what the prediction says comes next. Where
        the request's grammar forces tokens too, the prediction wins only where it holds them
        (_holds_forced, as a lookup does in _lookups_past_forced), and the request leaves `forced`."""
        out = {}
        k = self.config.num_speculative_tokens
        for request in decoding:
            rid, prediction = request.request_id, request.params.prediction
            if not prediction:
                continue
            guess = self.predictions.guess(rid, prediction, request.output_token_ids, k)
            if guess and rid in forced:
                if not self._holds_forced(request, guess, forced[rid]):
                    continue
                del forced[rid]
            if guess:
                out[rid] = guess
        return out

    def _lookups_past_forced(self, decoding: list[Request], buckets: list[int | None],
                             forced: dict[str, list[int]]) -> dict[str, list[int]]:
        """Of the requests with forced tokens and a lookup match (a cheap proposer: no gate, int
        bucket), those whose lookup guess the grammar allows for at least as many tokens as it forces:
        it then holds the forced bytes, tokenized as the model wrote them before (a lookup copies the
        model's own tokens, where the grammar library picks its own split, which the model may not
        share: `",` `"age` against `","` `age`), and goes on where the grammar stops forcing (`","age":3`
        past `","age":`). The guess is their proposal, under its own bucket, and they leave `forced`."""
        if not forced or self.grammar is None or self.proposer.takes_gate:
            return {}
        candidates = [r for r, b in zip(decoding, buckets, strict=True) if b and r.request_id in forced]
        if not candidates:
            return {}
        k = self.config.num_speculative_tokens
        out = {}
        for request, guess in zip(candidates, self.proposer.propose(candidates, [k] * len(candidates)), strict=True):
            if self._holds_forced(request, guess, forced[request.request_id]):
                out[request.request_id] = guess
                del forced[request.request_id]
        return out

    def _holds_forced(self, request: Request, guess: list[int], forced: list[int]) -> bool:
        """Whether `guess` may replace the grammar's forced tokens: the grammar allows it for as many tokens
        as it forces, or for all K a step can verify where it forces more."""
        need = min(len(forced), self.config.num_speculative_tokens)
        return self.grammar is not None and len(guess) >= need and self.grammar.count_valid(request, guess) >= need

    def _room(self, request: Request) -> int:
        """Proposals that could still be used: the step emits up to k + 1 tokens."""
        room = self.max_model_len - request.num_tokens - 1
        if request.params.max_tokens is not None:
            room = min(room, request.params.max_tokens - request.num_output_tokens - 1)
        return max(room, 0)

    def observe(self, num_tokens: int, step_time_s: float) -> None:
        """Feed the controller's cost fit with decode-only steps: a prefill chunk's tokens cost far
        less each than decode rows, and would bend the fit. The draft forwards' time is taken out
        (the controller prices them apart, observe_draft): T(n) is the time of scoring n rows."""
        if num_tokens == self._decode_tokens:
            self.controller.observe(num_tokens, step_time_s - self._propose_s)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self.predictions.forget(request_id)
        self.controller.forget(request_id)

    def reset(self) -> None:
        """Forget every request (the engine dropped them all)."""
        self.proposer.retain(())
        self.predictions.retain(set())
        self.controller = SpecController(self.config, self._bucket_prior)

    @property
    def is_on(self) -> bool:
        return self.controller.is_on

    @property
    def wants_target_confidence(self) -> bool:
        """Whether the controller plans from the target's top-1 probabilities (ModelRunner.track_confidence):
        a draft model's, which cannot re-measure a request while it sits out (controller.py)."""
        return self.config.adaptive and self.proposer.takes_gate

    def share_kv_budget(self, num_blocks: int, target_bytes_per_block: int) -> int:
        """Target blocks when `num_blocks` of the target's alone filled the byte budget and the proposer
        keeps a block of its own per target block (a draft model): both pools fit the same budget."""
        extra = self.proposer.kv_bytes_per_block
        if extra == 0:
            return num_blocks
        return max(1, num_blocks * target_bytes_per_block // (target_bytes_per_block + extra))

    def allocate_kv(self, num_blocks: int, max_model_len: int) -> None:
        """Once the engine has sized the target's cache: the proposer's pool, and the final context."""
        self.max_model_len = max_model_len
        self.proposer.set_max_model_len(max_model_len)
        self.proposer.allocate_kv(num_blocks)


DraftWeights = tuple[ArchConfig, Mapping[str, torch.Tensor]]


def build_speculator(config: SpeculativeConfig, model_config: ModelConfig, target_arch: ArchConfig,
                     block_size: int, num_blocks: int | None, max_model_len: int,
                     draft: DraftWeights | None = None, *, enable_prefix_caching: bool = True,
                     max_num_seqs: int | None = None) -> Speculator | None:
    """The speculator `config` asks for (None when speculation is off). A draft model is loaded from
    config.draft_model unless its weights are given (tests pass tiny models in); the draft caches
    prefixes when the target does, and keeps persistent block tables of `max_num_seqs` rows. `num_blocks` None:
    the draft's weights load now and its KV pool waits for `Speculator.allocate_kv`, so the engine
    can probe memory after both models' weights are in (the core's order)."""
    if config.method is None:
        return None
    proposer: Proposer
    if config.method in ("ngram", "suffix"):
        return Speculator(config, _lookup_proposer(config, config.method), max_model_len)
    arch, tensors = draft if draft is not None else load_draft(config)
    if arch.vocab_size != target_arch.vocab_size:
        raise TokenmillError(f"draft model '{config.draft_model}' has a vocabulary of {arch.vocab_size} "
                             f"tokens but the target has {target_arch.vocab_size}: a draft must share the "
                             "target's tokenizer")
    draft_config = replace(model_config, model=config.draft_model or "draft",
                           quantization=config.draft_weights(model_config.quantization))
    runner = ModelRunner(draft_config, arch, tensors, max_model_len, block_size, None,  # KV: the proposer's
                         max_num_seqs=max_num_seqs)
    if config.draft_vocab is not None and config.draft_vocab < runner.model.lm_head.out_features:
        runner.model.lm_head = runner.model.lm_head.first_rows(config.draft_vocab)
    proposer = PROPOSERS["draft"](runner, num_blocks, block_size, max_model_len,  # type: ignore[call-arg]
                                  enable_prefix_caching=enable_prefix_caching, sample=config.draft_sampling)
    if config.method in ("ngram-draft", "suffix-draft"):  # lookup where it finds a match, the draft elsewhere
        lookup = _lookup_proposer(config, "ngram" if config.method == "ngram-draft" else "suffix")
        proposer = PROPOSERS["ngram-draft"](lookup, proposer)  # type: ignore[call-arg]
    return Speculator(config, proposer, max_model_len)


def predictions_only_speculator(max_model_len: int, k: int = DEFAULT_SPECULATIVE_TOKENS["ngram"]) -> Speculator:
    """A speculator for an engine started without a method: requests' predictions only (spec/prediction.py),
    up to k a step (ngram's K by default: a copied span is what a prediction is), priced by the same
    controller."""
    from tokenmill.engine.spec.prediction import PredictionsOnly

    return Speculator(SpeculativeConfig(None, k), PredictionsOnly(), max_model_len)


def _lookup_proposer(config: SpeculativeConfig, method: str) -> Proposer:
    """Prompt lookup alone ("ngram") or with the cache of recent outputs ("suffix")."""
    cache = (config.suffix_cache_tokens,) if method == "suffix" else ()
    return PROPOSERS[method](config.ngram_min, config.ngram_max, *cache)  # type: ignore[call-arg]


def load_draft(config: SpeculativeConfig) -> DraftWeights:
    from tokenmill.models.loading.weights import load_checkpoint
    from tokenmill.models.resolve import resolve_model

    assert config.draft_model is not None  # SpeculativeConfig requires it for "draft"
    source = resolve_model(config.draft_model)
    checkpoint = load_checkpoint(source.path, source.format)
    return checkpoint.arch, checkpoint.tensors
