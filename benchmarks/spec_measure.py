"""The measurement loop of benchmarks/speculative.py: one engine, speculation toggled on and off (and
more speculating modes) in rotated rounds, with the speculation counters of the steps each ran."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class StepCounter:
    """Wraps EngineCore.step to sum the speculation counters of the steps it ran."""

    def __init__(self, core: Any) -> None:
        self.core, self.inner = core, core.step
        self.drafts = self.draft_tokens = self.accepted = self.steps = self.off_steps = 0
        core.step = self

    def __call__(self) -> Any:
        result = self.inner()
        s = result.stats
        self.steps += 1
        self.off_steps += s.spec_is_on is False
        self.drafts += s.spec_num_drafts
        self.draft_tokens += s.spec_num_draft_tokens
        self.accepted += s.spec_num_accepted_tokens
        return result

    def reset(self) -> None:
        self.drafts = self.draft_tokens = self.accepted = self.steps = self.off_steps = 0


@dataclass(frozen=True, slots=True)
class TracedStep:
    proposed: int  # guesses verified this step
    accepted: int
    seconds: float
    token_ids: list[int]  # what the step emitted


def trace_steps(llm: Any, messages: list[dict[str, str]], max_tokens: int, ignore_eos: bool = True) -> list[TracedStep]:
    """One greedy speculative run of one request, step by step (a prefill chunk that emits nothing too)."""
    from tokenmill import SamplingParams

    core, steps = llm.core, []
    inner = core.step

    def step() -> Any:
        start = time.perf_counter()
        result = inner()
        steps.append(TracedStep(result.stats.spec_num_draft_tokens, result.stats.spec_num_accepted_tokens,
                                time.perf_counter() - start, [t for o in result.outputs for t in o.new_token_ids]))
        return result

    core.step = step
    try:
        llm.chat([messages], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos))
    finally:
        core.step = inner
    return steps


def measure(llm: Any, messages: list[list[dict[str, str]]], max_tokens: int, rounds: int,
            temperature: float = 0.0, variants: dict[str, Callable[[], None]] | None = None,
            ignore_eos: bool = True) -> dict[str, Any]:
    """Speculation against plain decoding on one engine, alternating rounds. `variants`: more
    speculating modes, each set up by its callable before it runs (and the plain "spec" mode restored
    by variants["spec"] where given), rotated with the other two so that none always goes first."""
    from tokenmill import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos)
    speculator = llm.core.speculator
    counter = StepCounter(llm.core)
    setups = {"spec": lambda: None, **(variants or {})}
    modes = ["spec", "plain", *[m for m in setups if m != "spec"]]
    # Warm-up with every prompt: kernels, allocator, and the prefix cache, which both modes then hit
    # alike (a cold first run would pay every prompt's prefill for whichever mode went first).
    llm.chat(messages, SamplingParams(max_tokens=4, temperature=0.0))
    rates: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[list[int]]] = {}
    keys = ("drafts", "draft_tokens", "accepted", "steps", "controller_off_steps")
    stats = {m: dict.fromkeys(keys, 0) for m in modes}
    for round_index in range(rounds):
        shift = round_index % len(modes)  # rotated: no mode always goes first
        for mode in modes[shift:] + modes[:shift]:
            if mode != "plain":
                setups[mode]()
            llm.core.speculator = None if mode == "plain" else speculator
            counter.reset()
            start = time.perf_counter()
            outs = llm.chat(messages, params)
            elapsed = time.perf_counter() - start
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
            rates[mode].append(sum(len(t) for t in tokens[mode]) / elapsed)
            for key, value in zip(keys, (counter.drafts, counter.draft_tokens, counter.accepted, counter.steps,
                                         counter.off_steps), strict=True):
                stats[mode][key] += value
    llm.core.speculator = speculator
    setups["spec"]()
    median = {m: statistics.median(r) for m, r in rates.items()}

    def acceptance(mode: str) -> dict[str, float]:
        s = stats[mode]
        return {"acceptance_rate": s["accepted"] / max(s["draft_tokens"], 1),
                "mean_accepted_length": 1 + s["accepted"] / max(s["drafts"], 1)}

    greedy = temperature == 0.0
    return {
        "tokens": sum(len(t) for t in tokens["spec"]),  # generated a round (the last, spec mode)
        "spec_tok_s": median["spec"], "plain_tok_s": median["plain"], "ratio": median["spec"] / median["plain"],
        "rates": rates, **acceptance("spec"),
        "greedy_identical": tokens["spec"] == tokens["plain"] if greedy else None, **stats["spec"],
        # the controller's learned acceptance per proposal bucket (n-gram: match length) and position
        "acceptance_by_bucket": {str(b): r for b, r in speculator.controller.acceptance.rates(
            speculator.controller.bucket_prior).items()},
        "variants": {m: {"tok_s": median[m], "ratio": median[m] / median["plain"],
                         "over_spec": median[m] / median["spec"], **acceptance(m), **stats[m],
                         "greedy_identical": tokens[m] == tokens["plain"] if greedy else None}
                     for m in modes if m not in ("spec", "plain")},
    }
