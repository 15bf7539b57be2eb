"""`tokenmill batch INPUT.jsonl -o OUTPUT.jsonl`: an OpenAI Batch API file, run in-process."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tokenmill.cli.serve import (
    add_kv_cache_argument,
    add_quantization_argument,
    add_speculative_arguments,
    given,
    speculative_kwargs,
)
from tokenmill.config import compile_mode
from tokenmill.errors import TokenmillError
from tokenmill.models.catalog import DEFAULT_MODEL


def add_batch_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "batch", help="run an OpenAI Batch API .jsonl file at full throughput (resumable)",
        description="Answers every line of INPUT (custom_id, method, url, body) into OUTPUT, one result line "
                    "per request as it finishes. Re-running skips the custom_ids already in OUTPUT.")
    parser.add_argument("input", type=Path, metavar="INPUT.jsonl")
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="OUTPUT.jsonl")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or path (default {DEFAULT_MODEL})")
    parser.add_argument("--served-model-name", default=None, help="the `model` field of the results")
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="engine requests in flight at once (bounds memory; default 256)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_engine_arguments(parser)
    parser.set_defaults(handler=run_batch_command)


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    engine.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    engine.add_argument("--device", default="auto")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=None, help="sequences per engine step")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget per engine step")
    engine.add_argument("--num-kv-blocks", type=int, default=None)
    add_kv_cache_argument(engine)
    add_quantization_argument(engine)
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--shared-prefix-wait-tokens", type=int, default=None,
                        help="see `tokenmill serve --help` (default: the engine's)")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--threads", type=int, default=None,
                        help="compute threads (default: one per CPU, capped by a container's CPU quota)")
    # Speculation pays at low concurrency (--max-in-flight) and on answers that repeat: `suffix` for
    # extraction jobs of one shape, and a JSON schema's forced tokens with any method (docs/speculative.md).
    add_speculative_arguments(engine)


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Only what the user set: LLM's own defaults stay the single source for the rest."""
    kwargs = given(max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                   num_threads=args.threads, shared_prefix_wait_tokens=args.shared_prefix_wait_tokens)
    return {"dtype": args.dtype, "device": args.device, "seed": args.seed, "kv_cache_dtype": args.kv_cache_dtype,
            "quantization": args.quantization, "amx_bf16": args.amx_bf16,
            "enforce_eager": args.enforce_eager, "compile": compile_mode(args.compile),
            "async_scheduling": args.async_scheduling,
            "enable_prefix_caching": not args.no_prefix_caching, **speculative_kwargs(args), **kwargs}


def run_batch_command(args: argparse.Namespace) -> int:
    from tokenmill.batch.runner import DEFAULT_MAX_IN_FLIGHT, run_batch
    from tokenmill.llm import LLM

    if not args.input.is_file():
        raise TokenmillError(f"input file {args.input} does not exist")
    if args.input.resolve() == args.output.resolve():
        raise TokenmillError("the output file must differ from the input file")
    max_in_flight = DEFAULT_MAX_IN_FLIGHT if args.max_in_flight is None else args.max_in_flight
    if max_in_flight < 1:
        raise TokenmillError("--max-in-flight must be at least 1")
    llm = LLM(args.model, **_engine_kwargs(args))
    model_name = args.served_model_name or llm.loaded.source.name
    summary = run_batch(llm, args.input, args.output, model_name=model_name, max_in_flight=max_in_flight,
                        progress=not args.no_progress)
    print(f"batch: {summary.num_succeeded} succeeded, {summary.num_failed} failed, {summary.num_skipped} "
          f"skipped; {summary.num_generated_tokens} tokens in {summary.elapsed_s:.1f} s "
          f"({summary.tokens_per_s:.0f} tok/s) -> {args.output}", file=sys.stderr)
    return 0
