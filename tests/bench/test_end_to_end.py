"""Each archetype, briefly, against a real `tokenmill serve` of a tiny model, through the CLI; then
the result file's contents. The tiny model's context is 256 byte-level tokens: sizes stay small."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tokenmill import cli

# (workload, sessions, turns, extra flags)
ARCHETYPES = [
    ("chatbot", 3, 2, ["--input-len", "12", "--output-len", "6", "--system-len", "8", "--think-time", "0.05",
                       "--rate", "20"]),
    ("agent", 2, 2, ["--input-len", "8", "--output-len", "4", "--system-len", "8", "--rate", "20"]),
    ("dataproc", 6, 1, ["--input-len", "16", "--output-len", "8", "--max-concurrency", "3",
                        "--usd-per-hour", "0.5"]),
]


def bench(argv: list[str], out: Path) -> dict[str, Any]:
    assert cli.main(["bench", *argv, "--output-dir", str(out)]) == 0
    [path] = out.glob("*.json")
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def check_run(run: dict[str, Any], num_requests: int, output_len: int) -> None:
    metrics = run["metrics"]
    assert (metrics["num_requests"], metrics["num_completed"], metrics["errors"]) == (num_requests, num_requests, {})
    assert metrics["total_output_tokens"] == num_requests * output_len  # ignore_eos: exact lengths
    assert metrics["output_throughput"] == pytest.approx(metrics["total_output_tokens"] / metrics["duration_s"])
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert metrics[key]["count"] > 0 and metrics[key]["p50"] <= metrics[key]["p99"] <= metrics[key]["max"]
    requests = run["requests"]
    assert len(requests) == num_requests
    for request in requests:
        assert request["error_kind"] is None and request["output_tokens_source"] == "usage"
        assert 0 < request["ttft_s"] <= request["e2e_s"] and request["prompt_tokens"] > 0
    assert run["server_metrics"]["method"] == "exact"  # tokenmill sends each request's phase times
    phases = run["server_metrics"]["phases_s"]
    assert {"queue", "prefill", "decode", "ttft", "e2e"} <= set(phases)
    assert all(phases[p]["count"] == num_requests for p in ("queue", "prefill", "decode"))
    for request in requests:  # the server's view of a request lies inside the client's
        server_s = request["server_s"]
        assert 0 <= server_s["queue_s"] <= server_s["ttft_s"] <= server_s["e2e_s"] <= request["e2e_s"]


@pytest.mark.parametrize(("workload", "sessions", "turns", "flags"), ARCHETYPES, ids=[a[0] for a in ARCHETYPES])
def test_archetype_against_tokenmill_serve(served_url: str, tmp_path: Path, workload: str, sessions: int,
                                           turns: int, flags: list[str]) -> None:
    output_len = int(flags[flags.index("--output-len") + 1])
    doc = bench(["run", "--target", served_url, "--workload", workload, "--num-sessions", str(sessions),
                 "--turns", str(turns), *flags, "--no-plots"], tmp_path)
    assert doc["schema"] == "tokenmill-bench/1" and doc["workload"]["name"] == workload
    assert doc["tokenizer"] == "server" and doc["ignore_eos"] is True
    [run] = doc["runs"]
    assert run["target"] == {"url": served_url, "model": "tiny"}
    check_run(run, sessions * turns, output_len)
    metrics = run["metrics"]
    if workload == "chatbot":
        assert doc["slo"]["ttft_s"] == 2.0 and metrics["goodput"] is not None
        assert {c["metric"] for c in metrics["slo_checks"]} == {"ttft", "tpot"}
        assert run["arrival"] == {"process": "poisson", "rate": 20.0, "burstiness": 1.0}
    if workload == "agent":  # every later turn re-sends the conversation so far: the prefix cache hits
        assert run["server_metrics"]["prefix_cache_hit_rate"] > 0.3
        assert [r["turn_index"] for r in run["requests"]] == [0, 1, 0, 1]
    if workload == "dataproc":
        assert doc["workload"]["api"] == "completions" and metrics["max_concurrency"] <= 3
        assert metrics["usd_per_million_output_tokens"] == pytest.approx(
            0.5 / (metrics["output_throughput"] * 3600) * 1e6)


def test_sweep_and_compare_with_plots(served_url: str, tmp_path: Path) -> None:
    common = ["--workload", "dataproc", "--num-sessions", "3", "--input-len", "8", "--output-len", "4"]
    doc = bench(["compare", "--target", served_url, "--target", served_url + "/v1", *common, "--rates", "50,inf"],
                tmp_path)
    assert [run["arrival"].get("rate") for run in doc["runs"]] == [50.0, 50.0, None, None]
    for run in doc["runs"]:
        check_run(run, 3, 4)
    assert [row["rate"] for row in doc["ratios"]] == [50.0, None]
    assert doc["ratios"][0]["ratios"]["output_throughput"] > 0
    pngs = sorted(p.name.split("_", 2)[-1] for p in tmp_path.glob("*.png"))
    assert pngs == ["cdf.png", "sweep.png", *(f"timeline{i}.png" for i in range(4))]


def test_unreachable_target_is_a_one_line_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert cli.main(["bench", "run", "--target", "http://127.0.0.1:9", "--output-dir", str(tmp_path)]) == 1
    assert "cannot list the models of http://127.0.0.1:9" in capsys.readouterr().err
