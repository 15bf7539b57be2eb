"""`tokenmill bench` flags → BenchConfig: workload defaults, overrides, arrivals and vLLM's --goodput."""

from __future__ import annotations

import math

import pytest

from tokenmill import cli
from tokenmill.bench.bench import BenchConfig
from tokenmill.cli.bench import config_from_args


def config(*flags: str) -> BenchConfig:
    return config_from_args(cli.build_parser().parse_args(["bench", "run", "--target", "http://x", *flags]))


def test_workload_defaults_and_overrides() -> None:
    chatbot = config()
    assert (chatbot.workload, chatbot.arrival, chatbot.arrival_options.rate) == ("chatbot", "poisson", 1.0)
    assert (chatbot.slo.ttft_s, chatbot.slo.tpot_s, chatbot.ignore_eos) == (2.0, 0.2, True)
    dataproc = config("--workload", "dataproc", "--output-len", "7", "--think-time", "0.1", "--no-ignore-eos")
    assert dataproc.arrival == "burst" and math.isinf(dataproc.arrival_options.rate)
    assert (dataproc.params.output_len, dataproc.params.think_time_s, dataproc.params.num_sessions) == (7, 0.1, 64)
    assert dataproc.ignore_eos is False and dataproc.slo.is_empty


def test_a_rate_means_poisson_or_gamma() -> None:
    assert config("--workload", "dataproc", "--rate", "3").arrival == "poisson"
    gamma = config("--rate", "3", "--burstiness", "0.5")
    assert (gamma.arrival, gamma.arrival_options.burstiness) == ("gamma", 0.5)
    sweep = config("--rates", "1,2,inf")
    assert sweep.rates[:2] == (1.0, 2.0) and math.isinf(sweep.rates[2])
    assert [a.describe()["rate"] for a in map(sweep.arrival_for, sweep.sweep())] == [1.0, 2.0, None]


def test_goodput_takes_vllms_syntax_in_milliseconds() -> None:
    slo = config("--goodput", "ttft:500", "e2el:2000", "--slo-percentile", "95").slo
    assert (slo.ttft_s, slo.tpot_s, slo.e2e_s, slo.percentile) == (0.5, None, 2.0, 95)
    assert config("--no-slo").slo.is_empty


@pytest.mark.parametrize("flags", [["--goodput", "latency:5"], ["--workload", "nope"], ["--max-concurrency", "0"],
                                   ["--arrival", "trace"], ["--turns", "0"]])
def test_bad_flags_are_one_line_errors(flags: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "run", "--target", "http://127.0.0.1:9", *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
