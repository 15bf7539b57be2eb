"""gpu_check.py's speculation section: what verification costs on the device, and the speed-up ceiling.

A random model gives prompt lookup nothing to find, so speculation on it measures only its overhead.
Predicted outputs make the ceiling measurable instead: each request's prediction is its own greedy answer
(from a plain run first), so every guess is right and a step emits K + 1 tokens; the ratio to plain
decoding is then what a verification of K + 1 rows costs against a one-row decode step on this device
(on a bandwidth-bound GPU, close to K + 1). Reported per batch: plain and predicted decode tokens/s
(prefill cancelled out as in gpu_check._decode_rate), the ratio, the tokens accepted per proposed, and
whether the answers matched.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

K = 7  # proposals a step: an 8-row verification, as ngram's default


def _run(llm: Any, prompts: list[list[int]], params: Sequence[Any],
         counts: dict[str, int] | None = None) -> list[list[int]]:
    """Each prompt with its own params, in one continuous batch; the output tokens in prompt order.
    `counts`: proposals scored and accepted are added to it."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"spec-{i}", engine.encode(prompt), p)
    out: dict[str, list[int]] = {}
    while engine.has_unfinished:
        step = engine.step()
        if counts is not None:
            counts["proposed"] += step.stats.spec_num_draft_tokens
            counts["accepted"] += step.stats.spec_num_accepted_tokens
        for output in step.outputs:
            if output.finished:
                out[output.request_id] = list(output.outputs[0].token_ids)
    return [out[f"spec-{i}"] for i in range(len(prompts))]


def speculation_ceiling(path: Path, device: str, dtype: str, batches: Sequence[int], decode: int,
                        prompts_of: Callable[[int], list[list[int]]], sync: Callable[[], None]) -> dict[str, Any]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(str(path), dtype=dtype, device=device, max_num_seqs=max(batches), max_model_len=512,
              enable_prefix_caching=False, speculative="ngram", num_speculative_tokens=K)
    speculator = llm.core.speculator
    results: dict[str, Any] = {"k": K}
    for batch in batches:
        prompts = prompts_of(batch)
        base = SamplingParams(max_tokens=1 + decode, temperature=0, ignore_eos=True)
        llm.core.speculator = None
        answers = _run(llm, prompts, [base] * batch)
        predicted = [replace(base, prediction=a) for a in answers]
        rates: dict[str, float] = {}
        same, counts = True, {"proposed": 0, "accepted": 0}
        for mode, params in (("plain", [base] * batch), ("predicted", predicted)):
            llm.core.speculator = None if mode == "plain" else speculator
            _run(llm, prompts, [replace(p, max_tokens=2) for p in params])  # warm-up
            times = {}
            for n in (1, 1 + decode):
                sync()
                started = time.perf_counter()
                tokens = _run(llm, prompts, [replace(p, max_tokens=n) for p in params], counts)
                sync()
                times[n] = time.perf_counter() - started
            rates[mode] = batch * decode / (times[1 + decode] - times[1])
            same = same and tokens == answers
        results[f"b{batch}"] = {"plain_tok_s": rates["plain"], "predicted_tok_s": rates["predicted"],
                                "ratio": rates["predicted"] / rates["plain"], "same_tokens": same,
                                "acceptance": counts["accepted"] / max(counts["proposed"], 1), **counts}
        print(f"speculation ceiling batch {batch}: {results[f'b{batch}']}", flush=True)
    llm.core.speculator = speculator
    return results
