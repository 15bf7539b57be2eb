"""The `mixed` workload (bench/mixed.py): chat sessions and a batch burst against one real `tokenmill
serve` of the tiny model at once, through the CLI; the result file; the classes the server ran."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import pytest

from tokenmill import cli
from tokenmill.bench.errors import BenchError
from tokenmill.bench.mixed import MixedConfig, PhaseResult, _ratio
from tokenmill.bench.runner import RunSpec, _payload
from tokenmill.bench.sessions import Api, Conversation, Session, Turn


def _class_tokens(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    found = re.findall(r'tokenmill:service_class_generation_tokens_total\{[^}]*service_class="(\w+)"[^}]*\} (\S+)',
                       text)
    return {name: float(value) for name, value in found}


def test_mixed_runs_both_classes_alone_and_together(served_url: str, tmp_path: Path) -> None:
    before = _class_tokens(served_url)
    argv = ["bench", "run", "--target", served_url, "--workload", "mixed", "--num-sessions", "3", "--turns", "2",
            "--input-len", "10", "--output-len", "6", "--system-len", "8", "--think-time", "0.05", "--rate", "20",
            "--batch-requests", "5", "--batch-input-len", "12", "--batch-output-len", "20", "--chat-start", "0.1",
            "--output-dir", str(tmp_path)]
    assert cli.main(argv) == 0
    doc: dict[str, Any] = json.loads(next(tmp_path.glob("mixed_*.json")).read_text())
    assert doc["schema"] == "tokenmill-bench-mixed/1"
    assert [p["phase"] for p in doc["phases"]] == ["chat_alone", "batch_alone", "mixed"]
    alone_chat, alone_batch, mixed = doc["phases"]
    assert alone_chat["batch"] is None and alone_batch["chat"] is None
    for phase in (alone_chat, mixed):
        chat = phase["chat"]["metrics"]
        assert (chat["num_requests"], chat["num_completed"], chat["errors"]) == (6, 6, {})
        assert chat["total_output_tokens"] == 36 and chat["goodput"] is not None
    for phase in (alone_batch, mixed):
        batch = phase["batch"]["metrics"]
        assert (batch["num_completed"], batch["total_output_tokens"]) == (5, 100)
    assert mixed["total_output_tokens"] == 136
    assert mixed["total_output_throughput"] == pytest.approx(136 / mixed["duration_s"])
    ratios = doc["ratios"]
    assert ratios["chat_tpot_p99"] == pytest.approx(mixed["chat"]["metrics"]["tpot_s"]["p99"]
                                                    / alone_chat["chat"]["metrics"]["tpot_s"]["p99"])
    assert ratios["total_output_throughput_vs_batch_alone"] == pytest.approx(
        mixed["total_output_throughput"] / alone_batch["batch"]["metrics"]["output_throughput"])
    # The chat sessions start 0.1 s into the mixed phase, on the burst's clock.
    assert min(r["start_s"] for r in mixed["chat"]["requests"]) >= 0.1
    assert next(tmp_path.glob("mixed_*.png")).stat().st_size > 0
    # The tiers reached the server: priority → interactive, flex → batch (+ the warm-up's 4 standard tokens).
    after = _class_tokens(served_url)
    assert after["interactive"] - before.get("interactive", 0) == 72
    assert after["batch"] - before.get("batch", 0) == 200


def test_batch_alone_waits_the_gap_only_after_chat(served_url: str, tmp_path: Path) -> None:
    """The burst alone starts --batch-alone-gap seconds after the chat phase ended (the server would
    still keep batch-only steps short for a recent chat), and at once when no chat ran before it."""
    def phases(order: str) -> list[dict[str, Any]]:
        out = tmp_path / order.replace(",", "-")
        argv = ["bench", "run", "--target", served_url, "--workload", "mixed", "--num-sessions", "2", "--turns", "1",
                "--input-len", "8", "--output-len", "3", "--system-len", "4", "--rate", "50", "--batch-requests", "2",
                "--batch-input-len", "8", "--batch-output-len", "4", "--phases", order, "--batch-alone-gap", "1.5",
                "--no-plots", "--output-dir", str(out)]
        assert cli.main(argv) == 0
        found: list[dict[str, Any]] = json.loads(next(out.glob("mixed_*.json")).read_text())["phases"]
        return found

    chat, batch = phases("chat_alone,batch_alone")
    assert batch["started_unix"] - (chat["started_unix"] + chat["duration_s"]) >= 1.5
    batch, chat = phases("batch_alone,chat_alone")
    assert chat["started_unix"] - (batch["started_unix"] + batch["duration_s"]) < 1.0


def test_every_request_of_a_class_carries_its_tier() -> None:
    session = Session((Turn("hello", 1, 4),))
    spec = RunSpec(Api.COMPLETIONS, [session], [0.0], extra_body={"service_tier": "flex"})
    conversation = Conversation(session)
    conversation.ask(session.turns[0])
    assert _payload(spec, conversation, 4) == {"prompt": "hello", "service_tier": "flex", "max_tokens": 4,
                                               "temperature": 0.0, "ignore_eos": True}


def test_config_checks_phases_and_ratio_guards() -> None:
    with pytest.raises(BenchError, match="phases must be some of"):
        MixedConfig(phases=("both",))
    with pytest.raises(BenchError, match="chat_start_s"):
        MixedConfig(chat_start_s=-1)
    with pytest.raises(BenchError, match="batch_alone_gap_s"):
        MixedConfig(batch_alone_gap_s=-1)
    assert _ratio(1.0, 0.0) is None and _ratio(None, 1.0) is None and _ratio(3.0, 2.0) == 1.5
    assert PhaseResult("mixed", 2.0, None, None, 0.0).total_output_throughput == 0.0


def test_mixed_needs_one_target(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "compare", "--target", "http://127.0.0.1:1", "--target", "http://127.0.0.1:2",
            "--workload", "mixed", "--output-dir", str(tmp_path)]
    assert cli.main(argv) == 1
    assert "the mixed workload runs against one target" in capsys.readouterr().err


def test_rounds_of_a_phase_pool_records_and_durations() -> None:
    from tokenmill.bench.metrics import compute_metrics
    from tokenmill.bench.mixed import ClassRun, pool_phases
    from tokenmill.bench.records import RequestRecord

    def run(ttft_s: float, tokens: int, span_s: float) -> ClassRun:
        record = RequestRecord(0, 0, start_s=0.0, ttft_s=ttft_s, e2e_s=span_s, prompt_tokens=4, output_tokens=tokens)
        return ClassRun([record], compute_metrics([record], span_s))

    rounds = [PhaseResult("mixed", 10.0, run(0.1, 10, 2.0), run(0.5, 100, 10.0), 0.0),
              PhaseResult("mixed", 30.0, run(0.3, 10, 2.0), run(0.5, 200, 30.0), 1.0)]
    pooled = pool_phases(rounds, None)
    assert pooled.duration_s == 40.0 and pooled.total_output_tokens == 320
    assert pooled.batch is not None and pooled.batch.metrics.output_throughput == 300 / 40
    assert pooled.chat is not None and pooled.chat.metrics.ttft.count == 2 and pooled.chat.metrics.ttft.max == 0.3
