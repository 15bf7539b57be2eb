"""Multi-digit arithmetic, exact match: seeded problems (+, -, ×; 2 to 4 digits), a fixed 4-shot
prompt, greedy decoding up to the end of the line. The answer is the first integer in the output."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tokenmill.eval.client import Backend, GenerateOptions
from tokenmill.eval.metrics import Metric
from tokenmill.eval.tasks.base import (
    ItemResult,
    PairedMetric,
    ProgressBar,
    Task,
    TaskConfig,
    fit_prompt,
    mean,
    register,
)

SHOTS = ("12 + 35 = 47", "81 - 29 = 52", "7 * 14 = 98", "406 + 118 = 524")
_INTEGER = re.compile(r"-?\d+")
_OPS = ("+", "-", "*")
MAX_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b if self.op == "-" else self.a * self.b

    @property
    def question(self) -> str:
        return f"{self.a} {self.op} {self.b} ="


def problems(count: int, seed: int) -> list[Problem]:
    """Digits cycle 2, 3, 4 (multiplication: 2 and 3 only, one operand 1-digit at 3), so every run
    has easy and hard items; subtraction never goes negative."""
    rng = random.Random(f"arithmetic-{seed}")
    result = []
    for i in range(count):
        op = _OPS[i % len(_OPS)]
        digits = 2 + (i // len(_OPS)) % 3
        if op == "*":
            digits = min(digits, 3)
            a = rng.randrange(10 ** (digits - 1), 10**digits)
            b = rng.randrange(2, 10) if digits == 3 else rng.randrange(10, 100)
        else:
            a = rng.randrange(10 ** (digits - 1), 10**digits)
            b = rng.randrange(10 ** (digits - 1), 10**digits)
            if op == "-" and b > a:
                a, b = b, a
        result.append(Problem(a, op, b))
    return result


def prompt(problem: Problem) -> str:
    return "\n".join(SHOTS) + "\n" + problem.question


def parse_answer(text: str) -> int | None:
    match = _INTEGER.search(text.split("\n", 1)[0])
    return int(match.group()) if match else None


@register
class Arithmetic(Task):
    name = "arithmetic"
    description = "multi-digit +, -, × (seeded), 4-shot, greedy, exact match on the first integer"
    default_items = 40
    metrics = (PairedMetric(Metric("exact_match", mean("correct")), "correct", binary=True),)

    def run(self, backend: Backend, config: TaskConfig, progress: ProgressBar) -> list[ItemResult]:
        items = problems(config.items(self.default_items), config.seed)
        progress.start(len(items))
        outputs = backend.generate([fit_prompt(backend, prompt(p), MAX_TOKENS) for p in items],
                                   GenerateOptions(MAX_TOKENS, stop=("\n",)), progress.advance)
        results = []
        for i, (problem, out) in enumerate(zip(items, outputs, strict=True)):
            got = parse_answer(out.text)
            results.append(ItemResult(f"arith-{i}", {"correct": float(got == problem.answer)},
                                      {"question": problem.question, "answer": problem.answer, "output": out.text}))
        return results
