"""lm-evaluation-harness's `local-completions` model against a live `tokenmill serve`: the shipped
multiple-choice items as an lm-eval YAML task over a local JSONL file score the same through lm-eval
as through `tokenmill eval` (same requests: echo + logprobs over token ids, remote tokenizer).
Skipped when lm-eval is not installed (`pip install "lm-eval[api]"`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.server.conftest import MODEL, LiveServer
from tokenmill.eval.http_backend import HttpBackend
from tokenmill.eval.runner import SuiteConfig, run_task
from tokenmill.eval.tasks.base import TaskConfig, get_task
from tokenmill.eval.tasks.multiple_choice import questions

NUM_ITEMS = 12

TASK_YAML = """task: tokenmill_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


def test_lm_eval_local_completions_scores_like_tokenmill_eval(live: LiveServer, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "mc.jsonl"
    with data.open("w") as f:
        for q in questions(NUM_ITEMS, 0):
            row = {"context": q.context, "choices": [c[1:] for c in q.choices], "answer": q.answer}
            f.write(json.dumps(row) + "\n")
    (tmp_path / "tokenmill_mc.yaml").write_text(TASK_YAML.format(data=data))
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=f"model={MODEL},base_url={live.url}/v1/completions,tokenizer_backend=remote,num_concurrent=2",
        tasks=["tokenmill_mc"], task_manager=TaskManager(include_path=str(tmp_path)), log_samples=True)
    ours = run_task(get_task("mc"), HttpBackend(live.url), SuiteConfig(task=TaskConfig(num_items=NUM_ITEMS)))
    theirs = {s["doc_id"]: [r[0][0] for r in s["resps"]] for s in results["samples"]["tokenmill_mc"]}
    for index, item in enumerate(ours.items):
        assert theirs[index] == pytest.approx(item.detail["logprobs"], abs=1e-4)  # every choice's Σ logprob
    assert results["results"]["tokenmill_mc"]["acc,none"] == pytest.approx(ours.metrics["acc"])
