"""Next-token agreement and KL divergence: the top-k logprobs at every position of local passages
(held-out prose and stdlib code, half each). Alone, a model reports how often its top-1 is the
token that is actually there; against a reference, how often the two top-1s agree and the
mean KL(reference ‖ candidate) over positions (`metrics.topk_kl`: from top-k lists, a lower bound).
"""

from __future__ import annotations

from typing import ClassVar

from tokenmill.eval.client import Backend, EvalError, PositionLogprobs
from tokenmill.eval.metrics import Metric, top1, topk_kl
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

PASSAGE_CHARS = 600
TOP_K = 20  # the most an OpenAI-compatible server returns


@register
class NextToken(Task):
    name = "next-token"
    description = "top-k logprobs per position: top-1 accuracy alone; top-1 agreement and KL against a reference"
    default_items = 12
    top_k: ClassVar[int] = TOP_K
    metrics = (PairedMetric(Metric("top1_acc", ratio("top1_correct", "positions")), "top1_rate"),)
    pair_metrics = (
        Metric("top1_agreement", ratio("agree", "aligned")),
        Metric("kl_mean", ratio("kl", "aligned"), higher_is_better=False, unit="nats"),
    )

    def run(self, backend: Backend, config: TaskConfig, progress: ProgressBar) -> list[ItemResult]:
        count = config.items(self.default_items)
        texts = [(f"heldout-{i}", t) for i, t in enumerate(passages(corpus("heldout"), (count + 1) // 2,
                                                                     PASSAGE_CHARS))]
        texts += [(f"code-{i}", t) for i, t in enumerate(passages(corpus("code"), count // 2, PASSAGE_CHARS))]
        scored = score_texts(backend, [backend.tokenize(text) for _, text in texts], self.top_k, progress)
        items = []
        for (item_id, _), positions in zip(texts, scored, strict=True):
            correct = sum(1 for p in positions if top1(p.top) == p.token)
            items.append(ItemResult(item_id, {"top1_correct": float(correct), "positions": float(len(positions)),
                                              "top1_rate": correct / max(len(positions), 1)}, raw=positions))
        return items

    def pair(self, reference: ItemResult, candidate: ItemResult) -> dict[str, float]:
        ref: list[PositionLogprobs] = reference.raw
        cand: list[PositionLogprobs] = candidate.raw
        if ref and cand and isinstance(ref[0].token, int) != isinstance(cand[0].token, int):
            raise EvalError("one side reports token ids and the other only token text (a server without "
                            "return_tokens_as_token_ids): compare two servers of the same kind")
        # Positions line up only when both tokenized the passage the same way.
        if [p.token for p in ref] != [p.token for p in cand]:
            return {"agree": 0.0, "kl": 0.0, "aligned": 0.0}
        agree = sum(1 for r, c in zip(ref, cand, strict=True) if top1(r.top) == top1(c.top))
        kl = sum(topk_kl(r.top, c.top) for r, c in zip(ref, cand, strict=True))
        return {"agree": float(agree), "kl": kl, "aligned": float(len(ref))}
