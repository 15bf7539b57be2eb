"""Constrained decoding overhead: decode time per output token with and without a JSON schema.

One engine (one model load). For each --batch size the same prompts run three ways, interleaved
round by round so machine noise hits all of them: unconstrained, JSON schema with the masks built
during the forward (the default: `StructuredOutputs.prepare`), and JSON schema with the masks
built after it (`overlap=False`, the peer that shows what the overlap buys). Measured: decode time
per output token (prefill steps excluded: a step with prompt tokens is not counted), the ratio
JSON / plain (the issue's target: <= 1.1x at batch 1 and 32), the grammar's own time per output
token (matcher advance + mask fill + unpack + apply) and the part of it the step waited for;
schema compile time cold (a fresh schema each time, backend built) and cached.

Every run samples (temperature 1, seeds). Plain requests ignore EOS; the JSON answer to the
prompt is longer than the default --max-tokens, so JSON requests also run to max_tokens and the
batch stays full (the number that completed their object earlier is printed).

    flock /tmp/tokenmill-bench.lock python benchmarks/structured.py
"""

from __future__ import annotations

import argparse
import json
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
MODES = ("plain", "json", "json_sync")


def _run(engine: Any, prompts: list[str], max_tokens: int, structured: Any) -> dict[str, float]:
    """Decode seconds and output tokens of one batch (steps that computed prompt tokens excluded)."""
    from tokenmill.engine.request import SamplingParams

    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured=structured,
                                ignore_eos=structured is None)
        engine.add_request(f"r{time.monotonic_ns()}-{i}", engine.encode(prompt), params)
    decode_s, tokens, early = 0.0, 0, 0
    while engine.has_unfinished:
        started = time.perf_counter()
        step = engine.step()
        elapsed = time.perf_counter() - started
        if step.stats.num_prompt_tokens == 0:
            decode_s += elapsed
            tokens += step.stats.num_generation_tokens
        early += sum(1 for o in step.outputs if o.finished and len(o.outputs[0].token_ids) < max_tokens)
    return {"decode_s": decode_s, "tokens": tokens, "early": early}


def _compile_times(grammars: Any, repeats: int = 5) -> dict[str, float]:
    from tokenmill.engine.structured import StructuredOutputParams

    cold, cached = [], []
    for i in range(repeats):  # a fresh schema each time: a cache miss with the backend already built
        schema = json.loads(json.dumps(SCHEMA).replace('"zip"', f'"zip{i}"'))
        params = StructuredOutputParams.json(schema)
        t = time.perf_counter()
        grammars.compile(params)
        cold.append(time.perf_counter() - t)
        t = time.perf_counter()
        grammars.compile(StructuredOutputParams.json(schema))
        cached.append(time.perf_counter() - t)
    return {"compile_cold_ms": statistics.median(cold) * 1e3, "compile_cached_us": statistics.median(cached) * 1e6}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="llguidance")
    args = p.parse_args()

    from tokenmill.config import EngineConfig, ModelConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.structured import StructuredOutputParams
    from tokenmill.engine.structured.manager import StructuredOutputs

    engine = LLMEngine.from_config(EngineConfig(ModelConfig(args.model, quantization="none")))
    grammars = StructuredOutputs(engine.tokenizer, engine.core.arch.vocab_size, engine.eos_token_ids,
                                 backend=args.backend)
    engine.structured = grammars
    engine.core.runner.sampler.logits_processor = grammars
    t = time.perf_counter()
    _ = grammars.backend
    vocab_s = time.perf_counter() - t
    structured = StructuredOutputParams.json(SCHEMA)
    t = time.perf_counter()
    grammars.compile(structured)
    first_s = time.perf_counter() - t
    compiles = _compile_times(grammars)
    print(f"{args.model}, backend {args.backend}: vocabulary {vocab_s * 1e3:.0f} ms; schema compile first "
          f"{first_s * 1e3:.2f} ms, cold {compiles['compile_cold_ms']:.2f} ms, cached "
          f"{compiles['compile_cached_us']:.1f} us")
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Describe a software engineer as a JSON object with name, age, address "
                                     "(street, city, zip) and skills."}])
    results: dict[str, Any] = {"model": args.model, "backend": args.backend, "max_tokens": args.max_tokens,
                               "rounds": args.rounds, "vocab_ms": vocab_s * 1e3, "compile_first_ms": first_s * 1e3,
                               **compiles, "batches": {}}
    _run(engine, [prompt] * 2, 8, structured)  # warm-up
    for batch in args.batch:
        per_token: dict[str, list[float]] = {m: [] for m in MODES}
        grammar_us: dict[str, list[float]] = {m: [] for m in MODES}
        exposed_us: dict[str, list[float]] = {m: [] for m in MODES}
        early = {m: 0 for m in MODES}
        for _ in range(args.rounds):
            for mode in MODES:
                grammars.overlap = mode != "json_sync"
                before = (grammars.mask_time_s, grammars.exposed_time_s)
                run = _run(engine, [prompt] * batch, args.max_tokens, None if mode == "plain" else structured)
                n = max(run["tokens"], 1)
                per_token[mode].append(run["decode_s"] / n)
                grammar_us[mode].append((grammars.mask_time_s - before[0]) / n * 1e6)
                exposed_us[mode].append((grammars.exposed_time_s - before[1]) / n * 1e6)
                early[mode] += int(run["early"])
        grammars.overlap = True
        row: dict[str, Any] = {}
        for mode in MODES:
            row[mode] = {"us_per_token": statistics.median(per_token[mode]) * 1e6,
                         "grammar_us_per_token": statistics.median(grammar_us[mode]),
                         "exposed_us_per_token": statistics.median(exposed_us[mode]),
                         "finished_early": early[mode], "all_us_per_token": [x * 1e6 for x in per_token[mode]]}
        # Ratio per round (each round's three runs are back to back), then the median.
        row["ratio"] = statistics.median(j / p for j, p in zip(per_token["json"], per_token["plain"], strict=True))
        row["ratio_sync"] = statistics.median(
            j / p for j, p in zip(per_token["json_sync"], per_token["plain"], strict=True))
        results["batches"][str(batch)] = row
        print(f"batch {batch:3d}: per output token plain {row['plain']['us_per_token']:7.0f} us, json "
              f"{row['json']['us_per_token']:7.0f} us (ratio {row['ratio']:.3f}x, target <= 1.1x), json without "
              f"overlap {row['json_sync']['us_per_token']:7.0f} us ({row['ratio_sync']:.3f}x); grammar "
              f"{row['json']['grammar_us_per_token']:.0f} us/token of which the step waited "
              f"{row['json']['exposed_us_per_token']:.0f} us (without overlap "
              f"{row['json_sync']['exposed_us_per_token']:.0f} us); finished early "
              f"{early['json']}/{batch * args.rounds}")
    results["environment"] = common.environment()
    print("saved", common.save_json("structured", args.model, results))


if __name__ == "__main__":
    main()
