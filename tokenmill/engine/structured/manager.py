"""Grammars inside the engine: compile (cached by spec), one matcher per request, batched masks.

`StructuredOutputs` is the sampler's logits processor. For the rows of requests whose params carry
`structured`, it brings the request's matcher up to date with the output tokens, fills one bitmask
row per such row and sets disallowed logits to -inf before penalties' successors (temperature,
top-k/p, min-p, sampling) see them. Rows of other requests are not touched (no cost beyond one
attribute check per row).

The matcher lives in a side table keyed by request id and is advanced lazily from
`request.output_token_ids`: tokens only ever get appended (preemption recomputes KV, never drops
generated tokens), so the state is never lost and nothing needs a hook where tokens are appended.
n > 1 children have their own ids, hence their own matchers.

Speculative verification (`extra` rows): row j of a request scores the token after its first j
proposals, so the matcher accepts those j proposals tentatively, fills the row and rolls back. A
proposal the grammar refuses is masked out of the row before it, so verification rejects it there
(greedy: it is not the argmax; sampled: p(d) = 0); later rows are then never reached.

Forced tokens (`forced_tokens`): where the grammar allows one continuation only (a schema's keys and
punctuation), the speculator proposes it; verification then accepts it like any proposal.

Overlap (`prepare`): a step's masks need only the tokens of earlier steps, so the runner hands the
rows to `prepare` before the forward and a worker thread advances the matchers, fills the bitmask
and unpacks it while the forward runs; `__call__` joins it and only writes -inf. The worker owns the
matchers between `prepare` and the join; every other entry point joins first, so they are never
touched from two threads. A prepared mask is used only for the exact rows and token counts it was
made for (else it is recomputed on the step's thread), so overlap never changes what is sampled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tokenmill.engine.request import Request
from tokenmill.engine.structured.backend import GrammarBackend, GrammarMatcher, Vocabulary, build_backend
from tokenmill.engine.structured.params import StructuredOutputParams
from tokenmill.models.loading.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_BACKEND = "llguidance"
DEFAULT_CACHE_SIZE = 256


@dataclass(slots=True)
class _State:
    matcher: GrammarMatcher
    num_consumed: int = 0  # output tokens the matcher has accepted
    broken: bool = False  # a token the grammar refused got in (cannot happen under the mask; logged)
    stats: dict[str, float] = field(default_factory=dict)


class StructuredOutputs:
    """Compile cache + per-request matchers for one model's vocabulary. Thread-safe compile (the
    server validates on its event loop while the engine thread samples)."""

    def __init__(self, tokenizer: Tokenizer, logits_size: int, stop_token_ids: Sequence[int],
                 backend: str = DEFAULT_BACKEND, cache_size: int = DEFAULT_CACHE_SIZE, overlap: bool = True) -> None:
        self._tokenizer = tokenizer
        self._logits_size = max(logits_size, tokenizer.vocab_size)
        self._stop_token_ids = tuple(stop_token_ids)
        self._backend_name = backend
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[StructuredOutputParams, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._states: dict[str, _State] = {}
        self.overlap = overlap
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[tuple[tuple[str, int], ...], Future[_Masks]] | None = None
        # Benchmarks read these: all grammar work (matcher advance, mask fill, unpack, apply), and the
        # part of it the step waited for (the rest ran on the worker during the forward).
        self.mask_time_s = 0.0
        self.exposed_time_s = 0.0
        self.num_overlapped = 0  # steps whose masks were ready from the worker

    @property
    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:  # built on first use: the vocabulary scan takes 60-250 ms
                tokens = [""] * self._tokenizer.vocab_size
                for text, token_id in self._tokenizer.backend.get_vocab(with_added_tokens=True).items():
                    if token_id < len(tokens):
                        tokens[token_id] = text
                vocab = Vocabulary(self._tokenizer.backend.to_str(), tokens, self._logits_size, self._stop_token_ids)
                self._backend = build_backend(self._backend_name, vocab)
            return self._backend

    def compile(self, params: StructuredOutputParams) -> Any:
        """The compiled grammar for `params` (LRU-cached by spec); GrammarError if it cannot compile."""
        with self._lock:
            hit = self._cache.get(params)
            if hit is not None:
                self._cache.move_to_end(params)
                return hit
        compiled = self.backend.compile(params)
        with self._lock:
            self._cache[params] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def forget(self, request_id: str) -> None:
        self._join()
        self._states.pop(request_id, None)

    def forced_tokens(self, request: Request) -> list[int]:
        """The tokens the request's grammar forces after its output so far (speculative decoding
        proposes them: spec/speculator.py); [] without a grammar, once it is complete or broken."""
        structured = request.params.structured
        if structured is None:
            return []
        self._join()
        state = self._state(request, structured)
        if state.broken or state.matcher.is_terminated:
            return []
        return state.matcher.forced_tokens()

    def count_valid(self, request: Request, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the request's grammar allows after its output so far (all of
        them without a grammar, none once it is broken), counting up to a stop token at most (a
        matcher may check by accepting and rolling back, which a stop does not survive: `_masks`)."""
        structured = request.params.structured
        if structured is None:
            return len(tokens)
        self._join()
        state = self._state(request, structured)
        stop = _first_stop(tokens, request.eos_token_ids)
        return 0 if state.broken or not stop else state.matcher.count_valid(tokens[:stop])

    def reset(self) -> None:
        """Drop every request's matcher (the engine dropped its requests); compiled grammars stay."""
        self._join()
        self._states.clear()

    def _state(self, request: Request, params: StructuredOutputParams) -> _State:
        state = self._states.get(request.request_id)
        if state is None:
            state = _State(self.backend.new_matcher(self.compile(params)))
            self._states[request.request_id] = state
        if state.num_consumed < request.num_output_tokens:
            for token in request.output_token_ids[state.num_consumed:]:
                if state.matcher.is_terminated and token in request.eos_token_ids:
                    continue  # ignore_eos: a complete grammar allows only stop tokens, and they keep coming
                if not state.broken and not state.matcher.accept(token):
                    state.broken = True
                    log.warning("request %s: token %d is outside its grammar; it is no longer constrained",
                                request.request_id, token)
            state.num_consumed = request.num_output_tokens
        return state

    def prepare(self, requests: Sequence[Request]) -> None:
        """Start this step's masks on the worker thread; the runner calls it just before the forward
        with the rows it will sample, in row order (not for speculative verification steps).

        The mask for step t depends only on the tokens up to step t - 1, which the scheduler has
        appended by now, so it is computed while the forward runs and `__call__` only joins it and
        writes -inf into the logits. llguidance fills the masks in Rust on its own threads without the
        GIL; the worker's Python (advancing matchers, one call per row) interleaves with the forward's."""
        self._join()
        if not self.overlap or not any(r.params.structured is not None for r in requests):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        rows = list(requests)
        self._pending = (_key(rows), self._pool.submit(self._masks, rows, None, self._logits_size))

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request],
                 extra: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """Mask `logits` [rows, vocab] in place for the rows whose request has a grammar.
        `extra[row]`: proposals to treat as accepted before that row (speculative verification)."""
        started = time.perf_counter()
        masks = None
        if self._pending is not None:
            key, future = self._pending
            self._pending = None
            masks = future.result()  # joined first in any case: the worker owns the matchers until then
            if extra is not None or key != _key(requests):
                masks = None  # prepared for other rows (cannot happen from the runner): recompute
            else:
                self.num_overlapped += 1
        if masks is None:
            if not any(r.params.structured is not None for r in requests):
                return logits
            masks = self._masks(requests, extra, logits.shape[1])
        applying = time.perf_counter()
        if masks.rows:
            self.backend.apply_prepared(logits, masks.prepared, masks.rows)
        done = time.perf_counter()
        self.mask_time_s += masks.elapsed_s + (done - applying)
        self.exposed_time_s += done - started
        return logits

    def _join(self) -> None:
        """Wait for a mask the step never used (its forward failed): the matchers are ours again."""
        if self._pending is not None:
            _, future = self._pending
            self._pending = None
            try:
                future.result()
            except Exception:  # it failed on the worker; the next step recomputes
                log.exception("grammar masks failed on the worker thread")

    def _masks(self, requests: Sequence[Request], extra: Sequence[Sequence[int]] | None, width: int) -> _Masks:
        """Advance the matchers to the rows' output tokens and build the masks of their grammar rows."""
        started = time.perf_counter()
        backend = self.backend
        bitmask = backend.allocate_bitmask(len(requests))
        fills: list[tuple[GrammarMatcher, int]] = []
        filled: list[int] = []
        for row, request in enumerate(requests):
            structured = request.params.structured
            if structured is None:
                continue
            state = self._state(request, structured)
            if state.broken:
                continue
            if extra is None:
                if state.matcher.is_terminated:
                    _allow_only(bitmask, row, request.eos_token_ids)
                    filled.append(row)
                else:
                    fills.append((state.matcher, row))  # one batched fill below
                continue
            # Verification: a request owns several rows, each after a different number of its
            # proposals, so each row is filled at once and the proposals rolled back. A proposal the
            # grammar refuses is masked out of the row before it, so rows after it are never reached.
            # A proposed stop token is never accepted tentatively: the library cannot roll back over
            # it (the matcher then refused the request's real tokens). A row after one is only reached
            # if the stop was accepted, which ends the request unless ignore_eos, and a stopped grammar
            # allows only stops: that row's mask. The row before the stop masks it as it masks any token.
            more = extra[row]
            stop = _first_stop(more, request.eos_token_ids)
            valid = state.matcher.count_valid(more[:stop]) if stop else 0
            for token in more[:valid]:
                state.matcher.accept(token)
            if valid == stop:
                if stop < len(more) or state.matcher.is_terminated:
                    _allow_only(bitmask, row, request.eos_token_ids)
                else:
                    state.matcher.fill_bitmask(bitmask, row)
                filled.append(row)
            state.matcher.rollback(valid)
        if fills:
            backend.fill_bitmasks(fills, bitmask)
            filled += [row for _, row in fills]
        filled.sort()
        prepared = backend.prepare_apply(bitmask, filled, width) if filled else None
        return _Masks(filled, prepared, time.perf_counter() - started)


@dataclass(slots=True)
class _Masks:
    """One step's masks: the rows that have one and the backend's prepared form of them."""

    rows: list[int]
    prepared: Any
    elapsed_s: float  # time it took to compute (on the worker, or on the step's thread when not prepared)


def _key(requests: Sequence[Request]) -> tuple[tuple[str, int], ...]:
    """Which step a mask was made for: each row's request and how many tokens it had."""
    return tuple((r.request_id, r.num_output_tokens) for r in requests)


def _first_stop(tokens: Sequence[int], stop_ids: Sequence[int]) -> int:
    """The index of the first stop token in `tokens` (len(tokens) if none): proposals are checked against
    a grammar only up to it, since a matcher cannot roll back over an accepted stop."""
    return next((i for i, token in enumerate(tokens) if token in stop_ids), len(tokens))


def _allow_only(bitmask: torch.Tensor, row: int, token_ids: Sequence[int]) -> None:
    """The grammar is complete (nothing may follow): only the request's stop tokens."""
    words = bitmask.numpy()[row].view(np.uint32)  # numpy: no torch op (and thread-pool wait) per word
    words[:] = 0
    for token in token_ids:
        word, bit = divmod(token, 32)
        if word < len(words):
            words[word] |= np.uint32(1 << bit)
