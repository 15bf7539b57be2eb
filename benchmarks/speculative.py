"""Speculative decoding against plain decoding, side by side in one process, same engine.

  steps  the cost of one verification step: a batch-1 step scoring 1 + k query tokens against its
         paged KV (k = 0: a plain decode), in-process on the ngram model, so the controller's premise
         (extra rows are cheap) is measured, not assumed
  ngram  Qwen2.5-Coder-0.5B (--ngram-model), code-editing prompts ("rewrite this function with
         type hints": the answer copies most of the prompt), at each --concurrency (1 .. 32); a PNG
         of the speed-up against concurrency
  draft  Qwen2.5-Coder-1.5B (--target) with Qwen2.5-Coder-0.5B (--draft) proposing, batch 1, code
         edits and chat prompts (--draft-edits, --draft-chats), each prompt alone; with
         --draft-concurrency c > 1 also c requests at once, the edits and chats in turn; with
         --draft-vocab-ab N... / --draft-fp32-lanes-ab also the draft with its lm_head cut to N ids /
         on float32 scale lanes, as more speculating modes in the same rotated rounds
  llama  the same prompts through llama-server (when built: benchmarks/llama_server.py), with and
         without its own speculation (--spec-type ngram-simple; -md for the draft), batch 1

Each engine is loaded once; speculation is toggled on the same engine (same weights, same KV
pool) and the two runs alternate for --rounds rounds, so machine noise hits both. Reported:
output tokens/s of each (median over rounds), their ratio, acceptance rate and mean accepted
length, and whether the greedy tokens matched. Greedy decoding throughout. The weight path is
--quantization (auto: the GGUF's own q8/q4 blocks on the native integer kernels, the fastest here).

Run it under the shared lock (one benchmark at a time on this machine):

    flock /tmp/tokenmill-bench.lock python benchmarks/speculative.py
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import common  # type: ignore[import-not-found]
from spec_measure import measure, trace_steps  # type: ignore[import-not-found]
from spec_prompts import CHAT, CHATS, code_context, edit_prompt  # type: ignore[import-not-found]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ngram-model", default="qwen2.5-coder-0.5b")
    p.add_argument("--target", default="qwen2.5-coder-1.5b")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b")
    p.add_argument("--draft-quantization", default=None, help="the draft's weight path (default: the target's)")
    p.add_argument("--draft-method", default="draft", choices=["draft", "ngram-draft"],
                   help="draft: the draft model alone; ngram-draft: a lookup where the context repeats, "
                        "the draft elsewhere")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature of the requests, n-gram and draft (0: greedy, outputs compared token "
                        "for token)")
    p.add_argument("--draft-sampling", choices=["on", "off"], default="on",
                   help="draft: a sampled request's guesses drawn from the draft's distribution (on) or its argmax")
    p.add_argument("--draft-edits", type=int, default=2, help="draft: code-edit prompts, each run alone")
    p.add_argument("--draft-chats", type=int, default=len(CHATS), help="draft: chat prompts, each run alone")
    p.add_argument("--draft-concurrency", type=int, nargs="+", default=[1],
                   help="draft: 1 runs each prompt alone; c > 1 runs c requests at once, the edits and chats in turn")
    p.add_argument("--draft-vocab", type=int, default=None, help="draft: the draft's lm_head keeps the first N ids")
    p.add_argument("--draft-vocab-ab", type=int, nargs="+", default=[],
                   help="draft: also run with the draft's head cut to each N, alternating with the full head")
    p.add_argument("--draft-fp32-lanes-ab", action="store_true",
                   help="draft: also run with the draft's quantized layers on float32 scale lanes (same values)")
    p.add_argument("--k", type=int, default=0, help="num_speculative_tokens (0: the method's default)")
    p.add_argument("--ngram-tokens", type=int, default=96, help="max_tokens per request (ngram)")
    p.add_argument("--ngram-answers", action="store_true",
                   help="ngram: whole answers, each request ending at its EOS (at most --ngram-tokens), not "
                        "--ngram-tokens tokens with EOS ignored (which cut some rewrites short and ran others on "
                        "into free text)")
    p.add_argument("--ngram-prompts", type=int, default=1,
                   help="ngram at concurrency 1: this many code-edit prompts, each measured on its own, and the "
                        "speed-up of serving them one after another (a row of its own)")
    p.add_argument("--ngram-context", type=int, default=0,
                   help="ngram: about this many tokens of other Python source before each code edit (a long "
                        "agent prompt: longer attention, and more places for a lookup to match)")
    p.add_argument("--draft-tokens", type=int, default=32, help="max_tokens per request (draft; the 1.5B is slow)")
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--quantization", default="auto", help="weight path of every engine (auto: the GGUF's blocks)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="ngram: requests at once")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--step-ks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5, 7], help="steps: proposals per step")
    p.add_argument("--skip", choices=["steps", "ngram", "draft", "llama"], action="append", default=[])
    p.add_argument("--tag", default="", help="suffix of the result file names")
    p.add_argument("--trace-steps", action="store_true",
                   help="ngram at concurrency 1: after each prompt's rounds, one more speculative run printed step "
                        "by step (guesses proposed / accepted, step time, the text emitted): where its time goes")
    return p.parse_args()


def run_ngram(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tokenmill import LLM

    llm = LLM(args.ngram_model, speculative="ngram", num_speculative_tokens=args.k,
              num_kv_blocks=max(1024, 2 * max(args.concurrency) * (args.ngram_context + 512) // 16),
              max_model_len=2048 + args.ngram_context, num_threads=args.threads, quantization=args.quantization,
              ngram_min=args.ngram_min, ngram_max=args.ngram_max, max_num_seqs=max(64, max(args.concurrency)))
    context = code_context(llm.tokenizer.encode, args.ngram_context) if args.ngram_context else ""
    prompt = functools.partial(edit_prompt, context=context)
    rows = []
    for c in args.concurrency:
        if c == 1 and args.ngram_prompts > 1:
            rows += run_ngram_prompts(llm, args, prompt)
            continue
        result = measure(llm, [prompt(i) for i in range(c)], args.ngram_tokens, args.rounds, args.temperature,
                         ignore_eos=not args.ngram_answers)
        rows.append({"method": "ngram", "model": args.ngram_model, "concurrency": c, **result})
        print(f"ngram c={c}: {result['spec_tok_s']:.1f} vs {result['plain_tok_s']:.1f} tok/s = "
              f"{result['ratio']:.2f}x, acceptance {result['acceptance_rate']:.2f}", flush=True)
    return rows


def run_ngram_prompts(llm: Any, args: argparse.Namespace,
                      prompt: Callable[[int], list[dict[str, str]]]) -> list[dict[str, Any]]:
    """Batch 1, each of the first --ngram-prompts code edits on its own (rows "code-edit-i"), then the
    row the curve plots: their tokens over the summed median times of each mode, i.e. the speed-up of
    serving them one after another (one prompt's figure depends on how much of its answer is copied)."""
    per_prompt = []
    for i in range(args.ngram_prompts):
        result = measure(llm, [prompt(i)], args.ngram_tokens, args.rounds, args.temperature,
                         ignore_eos=not args.ngram_answers)
        per_prompt.append({"method": "ngram", "model": args.ngram_model, "concurrency": 1,
                           "prompt": f"code-edit-{i}", "tokens": result.pop("tokens"), **result})
        print(f"ngram c=1 prompt {i}: {result['ratio']:.2f}x, acceptance {result['acceptance_rate']:.2f}", flush=True)
        if args.trace_steps:
            text = llm.tokenizer.decode
            steps = trace_steps(llm, prompt(i), args.ngram_tokens, ignore_eos=not args.ngram_answers)
            print(f"  {len(steps)} steps: " + " ".join(
                f"[{s.proposed}/{s.accepted} {s.seconds * 1e3:.0f}ms]{text(s.token_ids)!r}" for s in steps), flush=True)
    tokens = sum(r["tokens"] for r in per_prompt)
    spec_s = sum(r["tokens"] / r["spec_tok_s"] for r in per_prompt)
    plain_s = sum(r["tokens"] / r["plain_tok_s"] for r in per_prompt)
    drafted = sum(r["draft_tokens"] for r in per_prompt)
    accepted = sum(r["accepted"] for r in per_prompt)
    drafts = sum(r["drafts"] for r in per_prompt)
    combined = {"method": "ngram", "model": args.ngram_model, "concurrency": 1, "prompt": "code-edit",
                "spec_tok_s": tokens / spec_s, "plain_tok_s": tokens / plain_s, "ratio": plain_s / spec_s,
                "acceptance_rate": accepted / max(drafted, 1), "mean_accepted_length": 1 + accepted / max(drafts, 1),
                "greedy_identical": all(r["greedy_identical"] for r in per_prompt),
                "prompts": len(per_prompt)}
    print(f"ngram c=1, {len(per_prompt)} prompts one after another: {combined['ratio']:.2f}x", flush=True)
    return [*per_prompt, combined]


def run_draft(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tokenmill import LLM

    widest = max(args.draft_concurrency)
    llm = LLM(args.target, speculative=args.draft_method, draft_model=args.draft, num_speculative_tokens=args.k,
              draft_quantization=args.draft_quantization, draft_vocab=args.draft_vocab,
              num_kv_blocks=max(128, 24 * widest), max_model_len=1024,
              num_threads=args.threads, quantization=args.quantization, max_num_seqs=max(64, widest))
    rows = []
    prompts = [(f"code-edit-{i + 1}", edit_prompt(i)) for i in range(args.draft_edits)]
    prompts += [(f"chat-{i + 1}", [{"role": "user", "content": c}]) for i, c in enumerate(CHATS[:args.draft_chats])]
    # c == 1: each prompt alone (batch 1); c > 1: c requests at once, the prompts in turn (edits and chats mixed)
    batches = [(name, [messages]) for name, messages in prompts] if 1 in args.draft_concurrency else []
    batches += [(f"mixed-{c}", [prompts[i % len(prompts)][1] for i in range(c)])
                for c in args.draft_concurrency if c > 1]
    proposer = getattr(llm.core.speculator.proposer, "draft", llm.core.speculator.proposer)
    proposer.sample = args.draft_sampling == "on"
    variants = draft_variants(proposer.runner.model, args.draft_vocab_ab, args.draft_fp32_lanes_ab)
    for name, batch in batches:
        result = measure(llm, batch, args.draft_tokens, args.rounds, args.temperature, variants)
        rows.append({"method": args.draft_method, "model": f"{args.target} <- {args.draft}", "prompt": name,
                     "draft_quantization": llm.config.speculative.draft_weights(args.quantization),
                     "temperature": args.temperature, "draft_sampling": args.draft_sampling,
                     "concurrency": len(batch), **result})
        print(f"{args.draft_method} {name}: {result['spec_tok_s']:.2f} vs {result['plain_tok_s']:.2f} tok/s = "
              f"{result['ratio']:.2f}x, acceptance {result['acceptance_rate']:.2f}", flush=True)
        for variant, v in result["variants"].items():
            print(f"    {variant}: {v['tok_s']:.2f} tok/s = {v['ratio']:.2f}x plain, {v['over_spec']:.3f}x the full "
                  f"head, acceptance {v['acceptance_rate']:.2f}", flush=True)
    return rows


def draft_variants(model: Any, sizes: list[int], fp32_lanes: bool) -> dict[str, Callable[[], None]] | None:
    """Speculating modes beside the draft as loaded (restored by "spec"): --draft-vocab-ab, its lm_head
    cut to each size's first ids; --draft-fp32-lanes-ab, its quantized layers with float32 scale lanes
    (the same values, the bytes before quantize() rounded scales to fp16)."""
    if not sizes and not fp32_lanes:
        return None
    import dataclasses

    from tokenmill.layers.linear import QuantLinear

    full = model.lm_head
    linears = {name: lin for name, lin in model.linears().items() if isinstance(lin, QuantLinear)}
    loaded = {name: lin.segments for name, lin in linears.items()}
    wide = {name: [dataclasses.replace(seg, scale=seg.scale.float(), offset=seg.offset.float()) for seg in segs]
            for name, segs in loaded.items()}

    def use(head: Any, segments: dict[str, Any]) -> Callable[[], None]:
        def setup() -> None:
            for name, lin in linears.items():
                if lin.segments is not segments[name]:
                    lin._set_segments(segments[name])
            model.lm_head = head
            model.rebind_native_stack()

        return setup

    variants = {"spec": use(full, loaded), **{f"spec-vocab{n}": use(full.first_rows(n), loaded) for n in sizes}}
    if fp32_lanes:
        variants["spec-fp32-lanes"] = use(full, wide)
    return variants


def run_steps(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Wall time of one batch-1 step scoring 1 + k query tokens (k proposals) after a 300-token
    context, median of 15 after 3 warm-ups, the k's interleaved round-robin so load drifts hit all."""
    from tokenmill import LLM
    from tokenmill.engine.interfaces import ScheduledRequest, SchedulerOutput
    from tokenmill.engine.request import Request, SamplingParams

    llm = LLM(args.ngram_model, num_kv_blocks=64, max_model_len=1024, num_threads=args.threads,
              quantization=args.quantization)
    core, runner = llm.core, llm.core.runner
    prompt = list(range(1000, 1300))
    request = Request("steps", prompt, SamplingParams(max_tokens=64, temperature=0.0))
    core.kv.allocate(request, len(prompt) + max(args.step_ks) + 1)
    blocks = list(core.kv.block_tables["steps"])
    runner.execute(SchedulerOutput([ScheduledRequest(request, 0, len(prompt), blocks)]))

    def step(k: int) -> float:
        scheduled = ScheduledRequest(request, len(prompt) - 1, 1 + k, blocks, [prompt[10 + j] for j in range(k)])
        start = time.perf_counter()
        runner.execute(SchedulerOutput([scheduled]))
        return time.perf_counter() - start

    times: dict[int, list[float]] = {k: [] for k in args.step_ks}
    for i in range(18):
        for k in args.step_ks:
            t = step(k)
            if i >= 3:
                times[k].append(t)
    base = statistics.median(times[args.step_ks[0]])
    rows = [{"k": k, "rows": 1 + k, "step_ms": statistics.median(ts) * 1e3,
             "vs_decode": statistics.median(ts) / base} for k, ts in times.items()]
    for r in rows:
        print(f"step with {r['rows']} query rows: {r['step_ms']:.1f} ms = {r['vs_decode']:.2f}x a decode", flush=True)
    return rows


def run_llama(args: argparse.Namespace) -> list[dict[str, Any]]:
    """llama-server's own speculation on the same GGUF files and prompts, batch 1, greedy: a server
    per configuration (plain, ngram-simple lookup, draft model), requests one after another."""
    import httpx
    import llama_server  # type: ignore[import-not-found]
    import peers  # type: ignore[import-not-found]

    from tokenmill.config import DEFAULT_SPECULATIVE_TOKENS
    from tokenmill.models.resolve import resolve_model

    binary = llama_server.server_binary(llama_server.isa_level())
    if not binary.is_file():
        print(f"llama-server not built ({binary}): skipping the peer", flush=True)
        return []
    ngram_gguf = resolve_model(args.ngram_model).path
    target_gguf, draft_gguf = resolve_model(args.target).path, resolve_model(args.draft).path
    # Lookup with llama.cpp's own defaults (12-token key, up to 48 drafted); the draft model with our k.
    lookup = ["--spec-type", "ngram-simple"]
    # The draft with our K (0 is "the method's default" to us; passed as 0 it aborted llama-server on its
    # first request: GGML_ASSERT(n_outputs_max <= cparams.n_outputs_max)).
    k = args.k or DEFAULT_SPECULATIVE_TOKENS["draft"]
    drafting = ["--spec-type", "draft-simple", "-md", str(draft_gguf), "--spec-draft-n-max", str(k)]
    chat = [[{"role": "user", "content": CHAT}]]
    configs = [
        ("ngram", args.ngram_model, ngram_gguf, [], [edit_prompt(0)], args.ngram_tokens),
        ("ngram", args.ngram_model, ngram_gguf, lookup, [edit_prompt(0)], args.ngram_tokens),
        ("draft", args.target, target_gguf, [], chat, args.draft_tokens),
        ("draft", args.target, target_gguf, drafting, chat, args.draft_tokens),
    ]
    rates: dict[tuple[str, bool], list[float]] = {}
    failed: dict[str, str] = {}
    for method, model, gguf, extra, messages, max_tokens in configs:
        port = common.free_port()
        argv = [*llama_server.server_argv(binary, gguf, port, model, 1, 2048, args.threads), *extra]
        log = peers.LOG_DIR / f"llama_spec_{method}_{bool(extra)}.log"
        url = f"http://127.0.0.1:{port}"
        try:
            with common.server_process(argv, url + "/health", log, args.threads):
                body = {"model": model, "messages": messages[0], "max_tokens": max_tokens, "temperature": 0.0,
                        "ignore_eos": True}
                httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 4}, timeout=600)
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=600).json()
                    rate = reply["usage"]["completion_tokens"] / (time.perf_counter() - start)
                    rates.setdefault((method, bool(extra)), []).append(rate)
        except Exception as e:  # the peer crashing on one mode (its draft path asserted once) keeps the others
            failed[method] = f"{type(e).__name__}: {e} (see {log})"
            print(f"llama-server {method} {'with' if extra else 'without'} speculation failed: {failed[method]}",
                  flush=True)
    rows = []
    for method in ("ngram", "draft"):
        if method in failed or (method, True) not in rates or (method, False) not in rates:
            rows.append({"method": method, "peer": "llama-server", "failed": failed.get(method, "no rates")})
            continue
        spec, plain = statistics.median(rates[(method, True)]), statistics.median(rates[(method, False)])
        rows.append({"method": method, "peer": "llama-server", "spec_tok_s": spec, "plain_tok_s": plain,
                     "ratio": spec / plain, "rates": {"spec": rates[(method, True)], "plain": rates[(method, False)]}})
        print(f"llama-server {method}: {spec:.1f} vs {plain:.1f} tok/s = {spec / plain:.2f}x", flush=True)
    return rows


def plot_curve(rows: list[dict[str, Any]], args: argparse.Namespace, name: str) -> None:
    curve = [r for r in rows if r["method"] == "ngram" and r.get("prompt", "code-edit") == "code-edit"]
    if len(curve) < 2:
        return
    fig, ax, path = common.new_figure("speculative", name)
    xs = [r["concurrency"] for r in curve]
    ax.plot(xs, [r["ratio"] for r in curve], marker="o", label=f"ngram, k <= {args.k} ({args.quantization} weights)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.axhline(0.95, color="red", lw=0.8, ls="--", label="0.95x (the controller's floor)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tok/s, speculation / none")
    ax.set_title(f"{args.ngram_model}: speculative speed-up vs concurrency (code edits, greedy)")
    ax.legend()
    common.save_figure(fig, path)


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    rows: list[dict[str, Any]] = []
    steps: list[dict[str, Any]] = []
    peer: list[dict[str, Any]] = []
    if "steps" not in args.skip:
        steps = run_steps(args)
    if "ngram" not in args.skip:
        rows += run_ngram(args)
    if "draft" not in args.skip:
        rows += run_draft(args)
    if "llama" not in args.skip:
        try:  # the peer is optional: a failed start must not lose the rows measured above
            peer = run_llama(args)
        except (SystemExit, Exception) as e:
            print(f"llama-server side by side failed: {e!r}", flush=True)
    if rows:
        common.print_table(
            ["method", "model", "prompt", "conc", "spec tok/s", "plain tok/s", "ratio", "accept", "mean len", "same"],
            [[r["method"], r["model"], r.get("prompt", "code-edit"), r["concurrency"], r["spec_tok_s"],
              r["plain_tok_s"], r["ratio"], r["acceptance_rate"], r["mean_accepted_length"], r["greedy_identical"]]
             for r in rows])
    name = (args.ngram_model if "ngram" not in args.skip else args.target) + (f"_{args.tag}" if args.tag else "")
    plot_curve(rows, args, name)
    common.save_json("speculative", name, {"args": vars(args), "step_cost": steps, "results": rows,
                                           "llama_server": peer})


if __name__ == "__main__":
    main()
