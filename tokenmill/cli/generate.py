"""`tokenmill generate [MODEL] PROMPT`: stream a completion to the terminal."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from tokenmill.cli.serve import (
    add_kernel_arguments,
    add_kv_cache_argument,
    add_speculative_arguments,
    speculative_kwargs,
)
from tokenmill.config import compile_mode
from tokenmill.engine.request import SamplingParams
from tokenmill.models.catalog import DEFAULT_MODEL


def add_generate_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    parser.add_argument("args", nargs="+", metavar="[MODEL] PROMPT",
                        help=f"model name or path (default {DEFAULT_MODEL}) and the prompt")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads (default: one per CPU, capped by a container's CPU quota)")
    parser.add_argument("--quiet-stats", action="store_true", help="do not print timings to stderr")
    add_kv_cache_argument(parser)
    add_kernel_arguments(parser)
    add_speculative_arguments(parser)
    parser.set_defaults(handler=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from tokenmill.llm import LLM

    model, prompt = (DEFAULT_MODEL, args.args[0]) if len(args.args) == 1 else (args.args[0], " ".join(args.args[1:]))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos)
    llm = LLM(model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
              num_threads=args.threads, gemm_backend=args.gemm_backend, attention_backend=args.attention_backend,
              kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization,
              amx_bf16=args.amx_bf16, enforce_eager=args.enforce_eager, compile=compile_mode(args.compile),
              async_scheduling=args.async_scheduling,
              **speculative_kwargs(args))
    tokens: str | list[int] = prompt
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        text = llm.tokenizer.apply_chat_template([*messages, {"role": "user", "content": prompt}])
        tokens = llm.tokenizer.encode(text, add_special_tokens=False)
    _stream(llm, tokens, params, quiet=args.quiet_stats)
    return 0


def _stream(llm: Any, prompt: str | list[int], params: SamplingParams, quiet: bool) -> None:
    started = time.monotonic()
    first: float | None = None
    out = None
    for out in llm.stream(prompt, params):
        if first is None:
            first = time.monotonic()
        sys.stdout.write(out.text_delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if quiet or out is None or first is None:
        return
    elapsed = time.monotonic() - started
    n = len(out.token_ids)
    decode_rate = (n - 1) / (time.monotonic() - first) if n > 1 else 0.0
    reason = out.finish_reason.value if out.finish_reason else "?"
    print(f"[{n} tokens in {elapsed:.2f} s, first token {first - started:.2f} s, {decode_rate:.1f} tok/s, "
          f"finish: {reason}]", file=sys.stderr)
