"""Long prompts at batch 1: time to first token and decode time per token at each context length, with the
AVX-512 attention kernels (kernels/attention_avx512.h, prefill_avx512.h) against what an AVX2-only host runs
(AVX2 decode tiles, gather + SDPA prefill), in one process, alternating rounds; and llama.cpp's
`llama-bench` on the same GGUF (`-p N -n 0` for the prefill, `-n D -d N` for decoding at depth N) when
`--llama-bench` names it.

A round serves one request of N prompt tokens (its first token varies per round, so the prefix cache never
serves it) with EOS ignored: TTFT is the wall time until its first output token (the engine's token budget
chunks the prefill, as it does for users); TPOT is the median step of the `--decode-tokens` that follow.

    flock /tmp/tokenmill-bench.lock python benchmarks/long_context.py --contexts 1024 4096 \\
        --llama-bench .cache/llama.cpp/build-native-d90acb74ee85/bin/llama-bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from typing import Any

import common

PATHS = ("wide", "avx2")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b", choices=common.MODELS)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096], help="prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded after the first, for TPOT")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine KV cache dtype: auto, fp32, bf16, fp16, int8")
    p.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench binary (optional)")
    p.add_argument("--tag", default="", help="suffix of the result file name")
    return p.parse_args()


def serve_one(llm: Any, prompt: list[int], decode_tokens: int, request_id: str) -> tuple[float, float]:
    """(TTFT seconds, median decode step seconds) of one greedy request."""
    from tokenmill.engine.loader import eos_ids
    from tokenmill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=1 + decode_tokens, ignore_eos=True, temperature=0)
    started = time.perf_counter()
    llm.core.add_request(request_id, prompt, params, eos_ids(llm.loaded))
    ttft, steps = 0.0, []
    while llm.core.has_unfinished:
        step_start = time.perf_counter()
        result = llm.core.step()
        if any(out.new_token_ids for out in result.outputs):
            if ttft == 0.0:
                ttft = time.perf_counter() - started
            else:
                steps.append(time.perf_counter() - step_start)
    return ttft, statistics.median(steps)


def llama_bench(binary: str, model: str, context: int, decode_tokens: int, threads: int) -> dict[str, Any]:
    """llama-bench's prompt processing of `context` tokens and its generation at that depth."""
    from tokenmill.models.resolve import resolve_model

    path = str(resolve_model(model).path)
    out: dict[str, Any] = {}
    for key, extra in (("pp", ["-p", str(context), "-n", "0"]), ("tg", ["-p", "0", "-n", str(decode_tokens),
                                                                         "-d", str(context)])):
        command = [binary, "-m", path, "-t", str(threads), "-r", "2", "-o", "json", *extra]
        rows = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
        out[f"{key}_tok_s"] = rows[0]["avg_ts"]
        out[f"{key}_command"] = command
    out["prefill_s"] = context / out["pp_tok_s"]
    out["tpot_s"] = 1 / out["tg_tok_s"]
    return out


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    from tokenmill.kernels import cpu_kernels
    from tokenmill.llm import LLM

    native = cpu_kernels()
    if native is None or not native.wide_attention_built():
        raise SystemExit("long_context: this host's CPU kernels have no AVX-512 attention to compare")
    longest = max(args.contexts) + args.decode_tokens + 16
    llm = LLM(args.model, num_threads=args.threads, max_num_seqs=1, num_kv_blocks=longest // 16 + 8,
              max_model_len=longest, kv_cache_dtype=args.kv_cache_dtype)
    bos = common.prompt_bos(llm.tokenizer)
    results: dict[str, Any] = {"contexts": {}}
    rows = []
    for context in args.contexts:
        base = common.build_prompts(llm.tokenizer.encode, 1, context, bos)[0]
        runs: dict[str, dict[str, list[float]]] = {p: {"ttft_s": [], "tpot_s": []} for p in PATHS}
        serve_one(llm, [7, *base[1:]], 4, f"warm-{context}")
        for r in range(args.rounds):
            for path in PATHS if r % 2 == 0 else PATHS[::-1]:
                native.set_wide_attention(path == "wide")
                prompt = [1000 + 2 * r + (path == "wide"), *base[1:]]  # a first token of its own: no prefix hit
                ttft, tpot = serve_one(llm, prompt, args.decode_tokens, f"{path}-{context}-{r}")
                runs[path]["ttft_s"].append(ttft)
                runs[path]["tpot_s"].append(tpot)
        native.set_wide_attention(True)
        med = {p: {k: statistics.median(v) for k, v in runs[p].items()} for p in PATHS}
        entry: dict[str, Any] = {"rounds": runs, "median": med,
                                 "ttft_avx2_over_wide": med["avx2"]["ttft_s"] / med["wide"]["ttft_s"],
                                 "tpot_avx2_over_wide": med["avx2"]["tpot_s"] / med["wide"]["tpot_s"]}
        row = [context, f"{med['wide']['ttft_s']:.2f}", f"{med['avx2']['ttft_s']:.2f}",
               f"{entry['ttft_avx2_over_wide']:.2f}x", f"{med['wide']['tpot_s'] * 1e3:.1f}",
               f"{med['avx2']['tpot_s'] * 1e3:.1f}", f"{entry['tpot_avx2_over_wide']:.2f}x"]
        if args.llama_bench:
            peer = llama_bench(args.llama_bench, args.model, context, args.decode_tokens, args.threads)
            entry["llama_bench"] = peer
            entry["ttft_llama_over_wide"] = peer["prefill_s"] / med["wide"]["ttft_s"]
            entry["tpot_llama_over_wide"] = peer["tpot_s"] / med["wide"]["tpot_s"]
            row += [f"{peer['prefill_s']:.2f}", f"{entry['ttft_llama_over_wide']:.2f}x",
                    f"{peer['tpot_s'] * 1e3:.1f}", f"{entry['tpot_llama_over_wide']:.2f}x"]
        results["contexts"][str(context)] = entry
        rows.append(row)
    headers = ["context", "TTFT s (avx512)", "TTFT s (avx2 path)", "speed-up", "TPOT ms (avx512)",
               "TPOT ms (avx2 path)", "speed-up"]
    if args.llama_bench:
        headers += ["llama.cpp prefill s", "vs llama.cpp", "llama.cpp TPOT ms", "vs llama.cpp"]
    common.print_table(headers, rows)
    common.save_json("long_context", f"{args.model}{'_' + args.tag if args.tag else ''}",
                     {"args": vars(args), **results})


if __name__ == "__main__":
    main()
