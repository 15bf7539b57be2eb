"""Predicted outputs (OpenAI's `prediction`): text the caller expects the answer to contain, as guesses.

A code editor asking for a small change to a file knows most of the answer already: the file. OpenAI's
Predicted Outputs API takes it as `prediction` and speeds up the tokens that match; vLLM users have
asked for it since 2024 (vllm#10137, #12061; two PRs closed unmerged). Here the prediction's tokens are
one more source of proposals for the speculator, verified like any guess, so the output is exactly what
it would be without them.

Alignment. A cursor `pos` says where in the prediction the next output token is expected. Each output
token equal to prediction[pos] moves it one on (the answer is copying the prediction); any other token
loses the alignment, which is looked for again from the output's last tokens:

    the latest n = MAX_N..2 output tokens, found in the prediction ending at j  →  pos = j
    (the first such occurrence at or after the old position, else the first anywhere);
    failing that, the last output token within WINDOW tokens after the old position (a one-token edit).

So an edit in the middle of a file (a line replaced, inserted or deleted) costs the tokens of the edit
itself and a few after it; the copy resumes once 2+ tokens of the prediction's text reappear.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill.engine.request import Request
from tokenmill.engine.spec.base import ProposalGate, Proposer
from tokenmill.engine.spec.output_cache import key_of, ngram_keys

MAX_N = 4  # longest suffix of the output looked up when re-aligning
WINDOW = 16  # how far ahead of the old position a single matching token re-aligns


class PredictionCursor:
    """One request's prediction and where its output stands in it.

    Index: for n = 2..MAX_N, every n-gram's key (output_cache.ngram_keys: the 64-bit polynomial hash) at
    the position its continuation starts, sorted (stable, so equal keys keep their positions ascending):
    ~48 bytes a prediction token, where a dict of tuples took ~10x that (a 32k-token prediction is 1.5 MB).
    A key match is checked against the tokens themselves (a collision is only a missed re-alignment)."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.pos: int | None = 0  # the prediction index of the next expected output token; None: not aligned
        self.seen = 0  # output tokens consumed so far
        self.anchor = 0  # the last aligned position (where a re-alignment looks first)
        keys = ngram_keys(np.asarray(tokens, dtype=np.int64), MAX_N)
        self._sorted: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # n → (sorted keys, their positions)
        for n in range(2, MAX_N + 1):
            positions = np.argsort(keys[n - 1][n:], kind="stable") + n
            self._sorted[n] = (keys[n - 1][positions], positions)

    def advance(self, output: Sequence[int]) -> None:
        """Take in the output tokens past those already seen (output = the request's output so far)."""
        for i in range(self.seen, len(output)):
            token = output[i]
            if self.pos is not None and self.pos < len(self.tokens) and self.tokens[self.pos] == token:
                self.pos += 1
            else:
                self.pos = self._realign(output, i + 1)
            if self.pos is not None:
                self.anchor = self.pos
        self.seen = len(output)

    def guess(self, k: int) -> list[int]:
        """Up to k tokens the prediction says come next; [] where it is not aligned or is used up."""
        if self.pos is None:
            return []
        return self.tokens[self.pos:self.pos + k]

    def _realign(self, output: Sequence[int], end: int) -> int | None:
        for n in range(min(MAX_N, end), 1, -1):
            tail = list(output[end - n:end])
            keys, positions = self._sorted[n]
            key = key_of(tail)
            lo, hi = np.searchsorted(keys, key, "left"), np.searchsorted(keys, key, "right")
            found = [int(j) for j in positions[lo:hi] if self.tokens[int(j) - n:int(j)] == tail]
            if found:
                return next((j for j in found if j >= self.anchor), found[0])
        last = output[end - 1]
        window = self.tokens[self.anchor:self.anchor + WINDOW]
        return self.anchor + window.index(last) + 1 if last in window else None


class Predictions:
    """The cursors of the requests that carry a prediction (SamplingParams.prediction)."""

    def __init__(self) -> None:
        self._cursors: dict[str, PredictionCursor] = {}

    def guess(self, request_id: str, prediction: list[int], output: Sequence[int], k: int) -> list[int]:
        cursor = self._cursors.get(request_id)
        if cursor is None:
            cursor = self._cursors[request_id] = PredictionCursor(list(prediction))
        cursor.advance(output)
        return cursor.guess(k)

    def forget(self, request_id: str) -> None:
        self._cursors.pop(request_id, None)

    def retain(self, request_ids: set[str]) -> None:
        for rid in [r for r in self._cursors if r not in request_ids]:
            del self._cursors[rid]


class PredictionsOnly(Proposer):
    """The proposer of an engine started without --speculative: it guesses nothing itself, so only the
    requests' predictions (and their grammars' forced tokens) are proposed (EngineCore builds it on the
    first request that carries a prediction)."""

    def propose(self, requests: list[Request], num_tokens: list[int],
                gate: ProposalGate | None = None) -> list[list[int]]:
        return [[] for _ in requests]

    def buckets(self, requests: list[Request]) -> list[int | None]:
        return [0] * len(requests)
