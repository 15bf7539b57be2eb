"""Constrained decoding overhead: decode tokens/s with and without a JSON schema, side by side.

One engine (one model load); for each --batch size the same prompts run unconstrained and with a
nested-object JSON schema, alternating for --rounds rounds so machine noise hits both. Reported:
output tokens/s of each (median over rounds), their ratio, the grammar's own time per output
token (StructuredOutputs.mask_time_s: matcher advance + bitmask fill + apply), and schema compile
time cold and cached. Both runs sample (temperature 1, seeds), so token counts differ a little;
throughput is per generated token.

    flock /tmp/tokenmill-bench.lock python benchmarks/structured.py
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import common  # type: ignore[import-not-found]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string"}},
                    "required": ["street", "city", "zip"]},
        "skills": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "address", "skills"],
}


def _run(engine: Any, prompts: list[str], max_tokens: int, structured: Any) -> tuple[int, float]:
    from tokenmill.engine.request import SamplingParams

    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured=structured,
                                ignore_eos=structured is None)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", engine.encode(prompt), params)
    started, tokens = time.perf_counter(), 0
    while engine.has_unfinished:
        tokens += engine.step().stats.num_generation_tokens
    return tokens, time.perf_counter() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="llguidance")
    args = p.parse_args()

    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.structured import StructuredOutputParams
    from tokenmill.engine.structured.manager import StructuredOutputs

    engine = LLMEngine.from_config(EngineConfig(ModelConfig(args.model, quantization="none")))
    engine.structured = StructuredOutputs(engine.tokenizer, engine.core.arch.vocab_size, engine.eos_token_ids,
                                          backend=args.backend)
    engine.core.runner.sampler.logits_processor = engine.structured
    t = time.perf_counter()
    _ = engine.structured.backend
    vocab_s = time.perf_counter() - t
    structured = StructuredOutputParams.json(SCHEMA)
    t = time.perf_counter()
    engine.structured.compile(structured)
    cold_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.structured.compile(structured)
    cached_s = time.perf_counter() - t
    print(f"{args.model}, backend {args.backend}: vocabulary {vocab_s * 1e3:.0f} ms, schema compile cold "
          f"{cold_s * 1e3:.2f} ms, cached {cached_s * 1e6:.1f} us")
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a software engineer as a JSON object with name, age, address "
                                     "(street, city, zip) and skills."}])
    results: dict[str, Any] = {"model": args.model, "backend": args.backend, "vocab_ms": vocab_s * 1e3,
                               "compile_cold_ms": cold_s * 1e3, "compile_cached_us": cached_s * 1e6, "batches": {}}
    _run(engine, [prompt] * 2, 8, structured)  # warm-up
    for batch in args.batch:
        plain, constrained, mask_per_token = [], [], []
        for _ in range(args.rounds):
            n, s = _run(engine, [prompt] * batch, args.max_tokens, None)
            plain.append(n / s)
            before = engine.structured.mask_time_s
            n, s = _run(engine, [prompt] * batch, args.max_tokens, structured)
            constrained.append(n / s)
            mask_per_token.append((engine.structured.mask_time_s - before) / max(n, 1))
        row = {"plain_tok_s": statistics.median(plain), "json_tok_s": statistics.median(constrained),
               "mask_us_per_token": statistics.median(mask_per_token) * 1e6}
        row["slowdown"] = row["plain_tok_s"] / row["json_tok_s"]
        results["batches"][str(batch)] = row
        print(f"batch {batch:3d}: plain {row['plain_tok_s']:7.1f} tok/s, json schema {row['json_tok_s']:7.1f} tok/s, "
              f"slowdown {row['slowdown']:.2f}x, grammar {row['mask_us_per_token']:.0f} us per output token")
    results["environment"] = common.environment()
    print("saved", common.save_json("structured", args.model, results))


if __name__ == "__main__":
    main()
