"""Greedy-continuation identity: fixed prompts, 32 greedy tokens each, compared token id by token id,
against a stored golden file (alone) or against a reference model (compare). A tokenizer change,
a kernel that rounds differently or a speculative decoder that is not exact shows up here first.

Golden files live in `tokenmill/eval/golden/<model>.json` (write one with `tokenmill eval run
--tasks greedy --write-golden`); an entry counts only if its prompt hash and length still match.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any

from tokenmill.eval.client import Backend, EvalError, GenerateOptions
from tokenmill.eval.metrics import Metric, common_prefix
from tokenmill.eval.tasks.base import ItemResult, PairedMetric, ProgressBar, Task, TaskConfig, mean, register
from tokenmill.eval.texts import corpus, passages

MAX_TOKENS = 32
PROMPT_CHARS = 300
GOLDEN_DIR = Path(__file__).resolve().parent.parent / "golden"


def golden_path(model: str, golden_dir: Path | None = None) -> Path:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(model).name if "/" in model else model)
    return (golden_dir or GOLDEN_DIR) / f"{stem}.json"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def prompts(count: int) -> list[tuple[str, str]]:
    half = (count + 1) // 2
    items = [(f"prose-{i}", t) for i, t in enumerate(passages(corpus("docstrings"), half, PROMPT_CHARS, min_chars=100))]
    items += [(f"code-{i}", t) for i, t in enumerate(passages(corpus("code"), count - half, PROMPT_CHARS,
                                                              min_chars=100))]
    return items


def write_golden(path: Path, model: str, items: list[ItemResult], made_with: dict[str, Any] | None = None) -> Path:
    """One line per prompt, so a diff of two golden files shows which prompts changed."""
    head = {"task": "greedy", "model": model, "max_tokens": MAX_TOKENS, "made_with": made_with or {}}
    lines = []
    for item in items:
        entry = {"prompt_sha256": item.detail["prompt_sha256"], "token_ids": item.raw}
        lines.append(f"  {json.dumps(item.item_id)}: {json.dumps(entry)}")
    text = json.dumps(head, indent=1)[:-2] + ',\n "items": {\n' + ",\n".join(lines) + "\n }\n}\n"
    json.loads(text)  # the hand-made layout must stay valid JSON
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _load_golden(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise EvalError(f"golden file {path} is unreadable: {error}") from error
    return data if data.get("max_tokens") == MAX_TOKENS else None


@register
class Greedy(Task):
    name = "greedy"
    description = "32 greedy tokens per prompt, token ids compared with a golden file or a reference"
    default_items = 8
    metrics = (PairedMetric(Metric("golden_identity", mean("identical")), "identical", binary=True),
               PairedMetric(Metric("golden_prefix_match", mean("prefix_frac")), "prefix_frac"))
    pair_metrics = (Metric("identity", mean("identical")), Metric("prefix_match", mean("prefix_frac")))

    def __init__(self) -> None:
        self.golden_file: Path | None = None
        self.golden_found = 0

    def run(self, backend: Backend, config: TaskConfig, progress: ProgressBar) -> list[ItemResult]:
        items = prompts(config.items(self.default_items))
        self.golden_found = 0
        progress.start(len(items))
        room = backend.max_length() - MAX_TOKENS - 1
        prompt_ids = [[backend.prefix_token(), *backend.tokenize(text)[-room:]] for _, text in items]
        outputs = backend.generate(prompt_ids, GenerateOptions(MAX_TOKENS), progress.advance)
        model = str(backend.describe().get("model") or backend.name)
        self.golden_file = golden_path(model, config.golden_dir)
        golden = _load_golden(self.golden_file)
        entries: dict[str, Any] = golden["items"] if golden else {}
        results = []
        for (item_id, text), out in zip(items, outputs, strict=True):
            if out.token_ids is None:
                raise EvalError(f"{backend.name} reports no token ids (the greedy task compares ids): a tokenmill or "
                                "vLLM server returns them with return_tokens_as_token_ids")
            entry = entries.get(item_id)
            values: dict[str, float] = {}
            if entry is not None and entry.get("prompt_sha256") == _sha(text):
                self.golden_found += 1
                want: list[int] = entry["token_ids"]
                values = {"identical": float(out.token_ids == want),
                          "prefix_frac": common_prefix(out.token_ids, want) / max(len(want), 1)}
            results.append(ItemResult(item_id, values, {"prompt_sha256": _sha(text), "text": out.text},
                                      raw=out.token_ids))
        if self.golden_found < len(results):  # a golden file for other prompts (or none): no golden score
            for r in results:
                r.values = {"identical": math.nan, "prefix_frac": math.nan}
        return results

    def pair(self, reference: ItemResult, candidate: ItemResult) -> dict[str, float]:
        ref: list[int] = reference.raw
        cand: list[int] = candidate.raw
        return {"identical": float(ref == cand), "prefix_frac": common_prefix(ref, cand) / max(len(ref), 1)}

    def summarize(self, items: list[ItemResult]) -> dict[str, Any]:
        return {"golden_file": str(self.golden_file) if self.golden_file else None, "golden_items": self.golden_found}
