"""`tokenmill serve [MODEL]`: the OpenAI-compatible server (default model, 127.0.0.1:8000)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from tokenmill.cli.service_classes import add_service_class_arguments, api_key_classes, service_class_config
from tokenmill.models.catalog import DEFAULT_MODEL

if TYPE_CHECKING:
    from tokenmill.config import SpeculativeConfig

API_KEY_ENV = "TOKENMILL_API_KEY"


def add_serve_parser(subparsers: Any) -> None:
    from tokenmill.config import CACHE_ISOLATIONS

    parser = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help=f"catalog name, .gguf file or Hugging Face directory (default {DEFAULT_MODEL})")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="the `model` clients send (default: its name)")
    parser.add_argument("--api-key", default=None, help=f"require this bearer token on /v1/* (or set {API_KEY_ENV})")
    parser.add_argument("--cache-isolation", default="shared", choices=list(CACHE_ISOLATIONS),
                        help="api-key: each API key (--api-key, --api-key-class) gets its own prefix cache and "
                             "suffix-speculation outputs, as if its requests all sent their own cache_salt")
    _add_engine_arguments(parser)
    _add_server_arguments(parser)
    add_service_class_arguments(parser)
    parser.set_defaults(handler=run_serve)


def _add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="KV cache blocks (default: by memory)")
    add_kv_cache_argument(parser)
    parser.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    parser.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"])
    parser.add_argument("--shared-prefix-wait-tokens", type=int, default=None,
                        help="a waiting request whose next uncached prompt tokens (this many or more) a running "
                             "request is computing waits a step for them to be cached instead of computing them "
                             "again (bursts sharing a system prompt, n > 1); 0: off; default 32 "
                             "(docs/performance.md)")
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads (default: one per CPU, capped by a container's CPU quota)")
    parser.add_argument("--no-adapt-threads", dest="adapt_threads", action="store_false",
                        help="keep --threads even while other processes take some of the CPUs (default: run fewer)")
    parser.add_argument("--seed", type=int, default=0)
    add_kernel_arguments(parser)
    add_speculative_arguments(parser)


def add_speculative_arguments(parser: Any) -> None:
    from tokenmill.config import SPECULATIVE_METHODS
    from tokenmill.kernels import QUANTIZATIONS

    parser.add_argument("--speculative", default=None, choices=list(SPECULATIVE_METHODS),
                        help="speculative decoding: ngram = prompt lookup, suffix = prompt lookup and a cache of "
                             "recent outputs (agents, JSON, tool calls), draft = a smaller model (--draft-model), "
                             "ngram-draft = lookup where the context repeats, the draft elsewhere, suffix-draft = "
                             "the same with suffix's lookup")
    parser.add_argument("--draft-model", default=None,
                        help="draft model sharing the target's tokenizer (catalog name or path)")
    parser.add_argument("--draft-quantization", default=None, choices=list(QUANTIZATIONS),
                        help="the draft's weight format (default: q4, or none when --quantization is none)")
    parser.add_argument("--draft-vocab", type=int, default=None,
                        help="the draft's lm_head keeps only the first N token ids (the frequent ones in a BPE "
                             "vocabulary): a cheaper draft forward; default: the whole vocabulary")
    parser.add_argument("--num-speculative-tokens", type=int, default=0,
                        help="most tokens proposed per request per step (default: ngram and suffix 7, draft 3, "
                             "ngram-draft and suffix-draft 5)")
    parser.add_argument("--ngram-min", type=int, default=1, help="shortest suffix the n-gram lookup matches")
    parser.add_argument("--ngram-max", type=int, default=4, help="longest suffix the n-gram lookup matches")
    parser.add_argument("--suffix-cache-tokens", type=int, default=65536,
                        help="suffix, suffix-draft: output tokens of recent requests the lookup cache keeps")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="vLLM's form, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
                             "\"prompt_lookup_max\": 4}' (instead of the flags above)")


def speculative_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The speculative flags (or vLLM's --speculative-config) as LLM(...) / SpeculativeConfig keyword arguments."""
    from tokenmill.cli.vllm_speculative import speculative_config_kwargs
    from tokenmill.errors import TokenmillError

    kwargs = {"speculative": args.speculative, "draft_model": args.draft_model,
              "draft_quantization": args.draft_quantization, "draft_vocab": args.draft_vocab,
              "num_speculative_tokens": args.num_speculative_tokens, "ngram_min": args.ngram_min,
              "ngram_max": args.ngram_max, "suffix_cache_tokens": args.suffix_cache_tokens}
    if args.speculative_config is not None:
        if args.speculative is not None or args.draft_model is not None:
            raise TokenmillError("pass either --speculative-config or --speculative / --draft-model, not both")
        kwargs.update(speculative_config_kwargs(args.speculative_config))
    return kwargs


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """SpeculativeConfig from the flags."""
    from tokenmill.config import SpeculativeConfig

    kwargs = speculative_kwargs(args)
    return SpeculativeConfig(kwargs.pop("speculative"), **kwargs)


def add_kv_cache_argument(parser: Any) -> None:
    from tokenmill.layers import KV_CACHE_DTYPES

    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="keys and values: auto = the model dtype; int8 holds 1.9x the tokens of bf16 "
                             "(3.9x fp32) in the same memory, with a scale per token and kv head")


def add_kernel_arguments(parser: Any) -> None:
    from tokenmill.kernels import ATTENTION_BACKENDS, GEMM_BACKENDS

    parser.add_argument("--gemm-backend", default="auto", choices=GEMM_BACKENDS,
                        help="CPU matmuls: auto = native for 1-4 rows, oneDNN for large weights, else aten")
    parser.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                        help="decode attention: auto = the native CPU kernel where it builds, the Triton "
                             "kernel on CUDA, else SDPA")
    add_quantization_argument(parser)


def add_quantization_argument(parser: Any) -> None:
    from tokenmill.kernels import DEFAULT_QUANTIZATION, QUANTIZATIONS

    parser.add_argument("--quantization", default=DEFAULT_QUANTIZATION, choices=QUANTIZATIONS,
                        help="weights: auto (the default) = a GGUF's own 8/4-bit blocks with native integer "
                             "kernels (faster; docs/quantization.md has its accuracy gate); none = dequantized to "
                             "--dtype (the reference path); q8/q4 = quantize every matrix at load")
    parser.add_argument("--amx-bf16", action="store_true",
                        help="AMX hosts: quantized GEMMs of 64+ rows (prefill, wide batches) on bf16 tiles, 2-4x "
                             "faster with bf16 rounding (tokens then depend on batch composition; below the "
                             "release gate on Qwen2.5-Coder-1.5B; docs/quantization.md)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: no CUDA graphs; every decode step launches its kernels from Python")
    parser.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"],
                        help="on: schedule and build step N+1 while step N runs on a device thread (faster "
                             "steps where the host's work is a visible share of one); auto: off for now "
                             "(docs/performance.md, \"Asynchronous scheduling\")")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="CPU: torch.compile the decoder stack's glue around the native GEMM and attention "
                             "ops (steps the native decode stack does not take); default: where it measured "
                             "faster, which on CPU is nowhere yet (docs/performance.md)")


def _add_server_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-queue-requests", type=int, default=256,
                        help="requests waiting for their first token before new ones get 429")
    parser.add_argument("--max-queue-tokens", type=int, default=1 << 20, help="prompt tokens of those requests")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="SIGTERM: seconds to finish in-flight work")
    parser.add_argument("--log-requests", default="off", choices=["off", "meta", "ids", "ids+text"],
                        help="one JSON log line per finished request: timings (meta), + token ids, + text")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-json", action="store_true", help="every log record as one JSON line")
    parser.add_argument("--profile-steps", type=int, default=0,
                        help="profile N engine steps (phase times, then a torch trace and the engine thread's "
                             "Python stacks, folded for flame graphs) into --profile-dir")
    parser.add_argument("--profile-dir", default="tokenmill-profile", help="where --profile-steps writes its files")
    parser.add_argument("--responses-store-size", type=int, default=1000,
                        help="/v1/responses kept in memory for previous_response_id (least recently used "
                             "forgotten first; 0: none)")
    parser.add_argument("--responses-store-mb", type=int, default=256,
                        help="the most memory those responses may hold (their JSON, MiB)")


def run_serve(args: argparse.Namespace) -> int:
    from tokenmill.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ProfileConfig,
        SchedulerConfig,
        ServerConfig,
        compile_mode,
    )
    from tokenmill.server.request_log import configure_logging
    from tokenmill.server.serve import run_server

    configure_logging(args.log_level, json=args.log_json)
    model_name = _installed_model_name(args.model)
    engine_config = EngineConfig(
        ModelConfig(args.model, args.dtype, args.device, args.max_model_len, args.seed, args.gemm_backend,
                    args.attention_backend, args.quantization, args.amx_bf16, args.enforce_eager,
                    compile_mode(args.compile)),
        CacheConfig(num_blocks=args.num_kv_blocks, kv_cache_dtype=args.kv_cache_dtype),
        SchedulerConfig(args.max_num_batched_tokens, args.max_num_seqs, args.scheduling_policy,
                        service_classes=service_class_config(args), async_scheduling=args.async_scheduling,
                        **given(shared_prefix_wait_tokens=args.shared_prefix_wait_tokens)),
        num_threads=args.threads,
        speculative=speculative_config(args),
        profile=ProfileConfig(num_steps=args.profile_steps, output_dir=args.profile_dir),
        adapt_threads=args.adapt_threads,
    )
    server_config = ServerConfig(
        host=args.host, port=args.port, served_model_name=args.served_model_name or model_name,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None, max_queue_requests=args.max_queue_requests,
        max_queue_tokens=args.max_queue_tokens, drain_timeout_s=args.drain_timeout, log_requests=args.log_requests,
        interactive_queue_reserve=args.interactive_queue_reserve, api_key_classes=api_key_classes(args),
        cache_isolation=args.cache_isolation,
        batch_stream_interval_s=args.batch_stream_interval, responses_store_size=args.responses_store_size,
        responses_store_mb=args.responses_store_mb,
    )
    return run_server(engine_config, server_config)


def _installed_model_name(model: str) -> str:
    """Resolve the model before binding the port (fail fast); pull a catalog model not yet installed."""
    from tokenmill.errors import ModelNotInstalledError
    from tokenmill.models.pull import pull
    from tokenmill.models.resolve import resolve_model

    try:
        return resolve_model(model).name
    except ModelNotInstalledError:
        pull(model, progress=True)
        return resolve_model(model).name


def given(**values: Any) -> dict[str, Any]:
    """The options the user set (not None): the configs' and LLM's defaults stay the single source for the rest."""
    return {k: v for k, v in values.items() if v is not None}
