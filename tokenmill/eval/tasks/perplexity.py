"""Perplexity and bits per byte of local text: `ppl-docstrings` (the bench's corpus) and
`ppl-heldout` (docstrings of a disjoint set of stdlib modules).

Each passage is scored as `[prefix] + tokens(passage)` (prefix: BOS, else EOS, as lm-evaluation-
harness's rolling loglikelihood does; in rolling windows if it is longer than one, see
`base.score_texts`), so every token of the passage is predicted exactly once.
"""

from __future__ import annotations

import math
from typing import ClassVar

from tokenmill.eval.client import Backend
from tokenmill.eval.metrics import LN2, Columns, Metric
from tokenmill.eval.tasks.base import (
    ItemResult,
    PairedMetric,
    ProgressBar,
    Task,
    TaskConfig,
    ratio,
    register,
    score_texts,
)
from tokenmill.eval.texts import corpus, passages

PASSAGE_CHARS = 1000


def _ppl(cols: Columns) -> float:
    mean_nll = ratio("nll", "tokens")(cols)
    return math.exp(mean_nll) if math.isfinite(mean_nll) else math.nan


def _bpb(cols: Columns) -> float:
    return ratio("nll", "bytes")(cols) / LN2


class _Perplexity(Task):
    corpus_name: ClassVar[str]
    default_items = 12
    metrics = (
        PairedMetric(Metric("ppl", _ppl, higher_is_better=False), "nll_per_byte", relative=True),
        PairedMetric(Metric("bits_per_byte", _bpb, higher_is_better=False, unit="bits"), "nll_per_byte",
                     relative=True),
    )

    def run(self, backend: Backend, config: TaskConfig, progress: ProgressBar) -> list[ItemResult]:
        texts = passages(corpus(self.corpus_name), config.items(self.default_items), PASSAGE_CHARS)
        scored = score_texts(backend, [backend.tokenize(text) for text in texts], 0, progress)
        items = []
        for i, (text, positions) in enumerate(zip(texts, scored, strict=True)):
            nll = -sum(p.logprob for p in positions)
            num_bytes = len(text.encode("utf-8"))
            items.append(ItemResult(f"{self.corpus_name}-{i}", {
                "nll": nll, "tokens": float(len(positions)), "bytes": float(num_bytes),
                "nll_per_byte": nll / num_bytes,
            }))
        return items


@register
class DocstringPerplexity(_Perplexity):
    name = "ppl-docstrings"
    description = "perplexity and bits/byte on stdlib docstrings (the bench's prose corpus)"
    corpus_name = "docstrings"


@register
class HeldoutPerplexity(_Perplexity):
    name = "ppl-heldout"
    description = "perplexity and bits/byte on held-out stdlib docstrings (modules disjoint from the bench's)"
    corpus_name = "heldout"
