"""`tokenmill bench run|compare|list`: load-test any OpenAI-compatible endpoint (thin: parse, call, print).

    tokenmill bench run --target http://127.0.0.1:8000 --workload chatbot --rate 2
    tokenmill bench run --target URL --workload dataproc --rates 1,2,4,inf --max-concurrency 16
    tokenmill bench compare --target http://127.0.0.1:8000 --target http://127.0.0.1:8080 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Only the stdlib at import time: every `tokenmill` command builds this parser, and the bench's
# modules (numpy, httpx) are imported when a bench command actually runs.
if TYPE_CHECKING:
    from tokenmill.bench.bench import BenchConfig, Prepared, RunResult
    from tokenmill.bench.metrics import SLO

WORKLOAD_NAMES = ("chatbot", "agent", "dataproc", "mixed")  # help text only: the registry validates
ARRIVAL_NAMES = ("poisson", "gamma", "constant", "burst", "ramp", "diurnal", "trace")
PARAM_FLAGS = {"num_sessions": int, "turns": int, "input_len": int, "output_len": int, "system_len": int,
               "prefix_groups": int, "range_ratio": float, "think_time_s": float}
GOODPUT_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2e_s", "e2e": "e2e_s"}


def add_bench_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("bench", help="benchmark an OpenAI-compatible server (workloads, SLOs, plots)")
    commands = parser.add_subparsers(dest="bench_command", required=True, metavar="bench_command")
    run = commands.add_parser("run", help="run one workload against one target")
    run.add_argument("--target", required=True, help="server URL, e.g. http://127.0.0.1:8000")
    _add_mixed_arguments(run)
    compare = commands.add_parser("compare", help="the same workload against several targets, interleaved")
    compare.add_argument("--target", action="append", required=True, help="server URL (twice or more); "
                         "ratios are against the first")
    compare.add_argument("--rounds", type=int, default=1, help="alternating rounds (A B, B A, ...), pooled")
    for sub in (run, compare):
        _add_common_arguments(sub)
        sub.set_defaults(handler=run_bench)
    listing = commands.add_parser("list", help="workload archetypes and arrival processes")
    listing.set_defaults(handler=list_bench)


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="chatbot", help=", ".join(WORKLOAD_NAMES))
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset", default=None, help="JSONL/JSON prompts (prompt, messages or ShareGPT)")
    for name, kind in PARAM_FLAGS.items():
        parser.add_argument("--" + name.replace("_", "-").removesuffix("-s"), dest=name, type=kind, default=None,
                            help="override the workload's default")
    _add_arrival_arguments(parser)
    parser.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                        help="per-request SLOs as vLLM takes them: ttft:MS tpot:MS e2el:MS (default: the workload's)")
    parser.add_argument("--slo-percentile", type=int, default=99, help="percentile the run-level SLO check uses")
    parser.add_argument("--no-slo", action="store_true", help="no SLOs, no goodput")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let requests stop at EOS (output lengths then differ between targets)")
    parser.add_argument("--usd-per-hour", type=float, default=None, help="machine price, for $ per M output tokens")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument("--output-dir", default="bench_results", help="where the JSON and PNGs go")
    parser.add_argument("--no-plots", action="store_true")


def _add_arrival_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arrival", default=None, help=f"{', '.join(ARRIVAL_NAMES)}; default: the workload's "
                        "(poisson if --rate is given)")
    parser.add_argument("--rate", type=float, default=None, help="sessions per second (inf: all at once)")
    parser.add_argument("--rates", default=None, help="a sweep, comma-separated: 0.5,1,2,inf")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, < 1 burstier")
    parser.add_argument("--ramp-end-rate", type=float, default=None)
    parser.add_argument("--diurnal-amplitude", type=float, default=0.5)
    parser.add_argument("--diurnal-period", type=float, default=60.0, help="seconds")
    parser.add_argument("--trace", default=None, help="JSONL with a `timestamp` (s) per line, for --arrival trace")
    parser.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")


def _add_mixed_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("--workload mixed (the size flags above shape its chat part)")
    group.add_argument("--batch-requests", type=int, default=None, help="requests in the burst (default 48)")
    group.add_argument("--batch-input-len", type=int, default=None, help="prompt tokens of each (default 128)")
    group.add_argument("--batch-output-len", type=int, default=None, help="max_tokens of each (default 192)")
    group.add_argument("--batch-max-concurrency", type=int, default=None, help="client-side cap on the burst")
    group.add_argument("--chat-start", type=float, default=3.0, help="seconds after the burst the chat starts")
    group.add_argument("--chat-tier", default="priority", help="service_tier of chat requests ('' for none)")
    group.add_argument("--batch-tier", default="flex", help="service_tier of batch requests ('' for none)")
    group.add_argument("--phases", default="chat_alone,batch_alone,mixed",
                       help="which runs, in order: chat_alone, batch_alone, mixed (the alone runs are the peers)")
    group.add_argument("--batch-alone-gap", type=float, default=0.0, metavar="SECONDS",
                       help="wait this long without chat before batch_alone when chat ran before it (tokenmill "
                            "keeps batch steps short for 60 s after a chat; 65 measures the batch job alone)")


def mixed_config_from_args(args: argparse.Namespace) -> Any:
    from tokenmill.bench.mixed import MixedConfig
    from tokenmill.bench.workloads import Mixed
    from tokenmill.cli.serve import given

    config = config_from_args(args)  # the chat part: sizes, arrival, SLO, seed as for any workload
    batch = replace(Mixed().batch_params(), **given(num_sessions=args.batch_requests, input_len=args.batch_input_len,
                                                    output_len=args.batch_output_len))
    return MixedConfig(config.params, batch, config.arrival, config.arrival_options,
                       args.chat_start, args.chat_tier or None, args.batch_tier or None, args.batch_max_concurrency,
                       config.slo, tuple(p for p in args.phases.split(",") if p), config.seed, config.ignore_eos,
                       config.timeout_s, config.warmup, args.batch_alone_gap)


def run_mixed_command(args: argparse.Namespace) -> int:
    from tokenmill.bench.mixed import document, plot_mixed, print_mixed, run_mixed
    from tokenmill.bench.report import save_json

    config = mixed_config_from_args(args)
    result = asyncio.run(run_mixed(config, args.target, args.model, args.api_key))
    print_mixed(result)
    stem = Path(args.output_dir) / f"mixed_{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"results: {save_json(document(config, result, ['tokenmill', *sys.argv[1:]]), stem.with_suffix('.json'))}")
    if not args.no_plots:
        print(f"plot: {plot_mixed(result, stem.with_suffix('.png'))}")
    return 0


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    from tokenmill.bench.arrivals import ArrivalOptions
    from tokenmill.bench.bench import BenchConfig
    from tokenmill.bench.errors import BenchError
    from tokenmill.bench.workloads import WorkloadParams, get_workload

    workload = get_workload(args.workload)
    overrides = {name: getattr(args, name) for name in PARAM_FLAGS if getattr(args, name) is not None}
    params: WorkloadParams = replace(workload.default_params(), **overrides)
    default_arrival, default_options = workload.default_arrival()
    rates = tuple(float(r) for r in args.rates.split(",")) if args.rates else ()
    given_rate = args.rate is not None or bool(rates)
    arrival = args.arrival or (("poisson" if args.burstiness == 1 else "gamma") if given_rate else default_arrival)
    options = ArrivalOptions(rate=args.rate if args.rate is not None else default_options.rate,
                             burstiness=args.burstiness, ramp_end_rate=args.ramp_end_rate,
                             diurnal_amplitude=args.diurnal_amplitude, diurnal_period_s=args.diurnal_period,
                             trace_path=args.trace)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise BenchError("--max-concurrency must be ≥ 1 (leave it out for no cap)")
    return BenchConfig(args.workload, params, arrival, options, rates, args.max_concurrency, _slo(args, workload),
                       args.seed, args.ignore_eos, args.usd_per_hour, args.timeout, args.dataset, args.warmup)


def _slo(args: argparse.Namespace, workload: Any) -> SLO:
    from tokenmill.bench.errors import BenchError
    from tokenmill.bench.metrics import SLO

    if args.no_slo:
        return SLO()
    if args.goodput is None:
        return replace(workload.default_slo(), percentile=args.slo_percentile)
    bounds: dict[str, float] = {}
    for item in args.goodput:
        key, _, value = item.partition(":")
        if key not in GOODPUT_KEYS or not value:
            raise BenchError(f"--goodput takes KEY:MS with KEY one of ttft, tpot, e2el; got {item!r}")
        bounds[GOODPUT_KEYS[key]] = float(value) / 1e3
    return SLO(**bounds, percentile=args.slo_percentile)


def run_bench(args: argparse.Namespace) -> int:
    from tokenmill.bench.bench import compare_targets, run_benchmark
    from tokenmill.bench.report import document, print_ratios, print_results, save_json

    if args.workload == "mixed":
        if args.bench_command != "run":
            from tokenmill.bench.errors import BenchError

            raise BenchError("the mixed workload runs against one target: use `tokenmill bench run`")
        return run_mixed_command(args)
    config = config_from_args(args)
    if args.bench_command == "run":
        prepared, results = asyncio.run(run_benchmark(config, args.target, args.model, args.api_key))
    else:
        prepared, results = asyncio.run(compare_targets(config, args.target, args.rounds, args.model, args.api_key))
    doc = document(config, prepared, results, ["tokenmill", *sys.argv[1:]])
    print_results(results, title=f"{config.workload} ({prepared.tokenizer} tokenizer)")
    if "ratios" in doc:
        print_ratios(doc["ratios"])
    stem = Path(args.output_dir) / f"{config.workload}_{time.strftime('%Y%m%d-%H%M%S')}"
    print(f"results: {save_json(doc, stem.with_suffix('.json'))}")
    if not args.no_plots:
        for path in write_plots(prepared, results, stem, config):
            print(f"plot: {path}")
    return 0


def write_plots(prepared: Prepared, results: list[RunResult], stem: Path, config: BenchConfig) -> list[Path]:
    from tokenmill.bench.plots import plot_cdfs, plot_sweep, plot_timeline

    labels = [_label(r, len(prepared.targets) > 1, bool(config.rates)) for r in results]
    paths = [plot_cdfs(results, labels, stem.with_name(stem.name + "_cdf.png"), config.workload)]
    if config.rates:
        target_labels = [r.target.base_url for r in results]
        paths.append(plot_sweep(results, target_labels, stem.with_name(stem.name + "_sweep.png"), config.workload))
    for index, (result, label) in enumerate(zip(results, labels, strict=True)):
        paths.append(plot_timeline(result, stem.with_name(f"{stem.name}_timeline{index}.png"), label))
    return paths


def _label(result: RunResult, many_targets: bool, sweep: bool) -> str:
    rate = result.rate
    rate_text = "inf" if rate is None or math.isinf(rate) else f"{rate:g}/s"
    parts = ([result.target.base_url] if many_targets else []) + ([rate_text] if sweep else [])
    return " @ ".join(parts) or result.target.base_url


def list_bench(args: argparse.Namespace) -> int:
    from tokenmill.bench.arrivals import ARRIVALS
    from tokenmill.bench.workloads import WORKLOADS

    for workload in WORKLOADS.values():
        arrival, options = workload.default_arrival()
        print(f"{workload.name:9} {workload.description}")
        print(f"{'':9} api {workload.api.value}, arrival {arrival} (rate {options.rate:g}), {workload.default_slo()}")
        print(f"{'':9} {workload.default_params().as_dict()}")
    print("arrivals:", ", ".join(ARRIVALS))
    return 0
