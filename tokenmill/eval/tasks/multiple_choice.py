"""Multiple choice by log-likelihood, as lm-evaluation-harness scores it: for each choice, the
summed logprob of the continuation given the context (one `echo` + `logprobs` request over the
token ids of `context + continuation`, what lm-eval's `local-completions` sends; BOS goes first
only for a model whose tokenizer puts it before every prompt, as lm-eval's `add_bos_token` does:
Gemma without its BOS is near chance); `acc` takes the argmax of the sums, `acc_norm` of the
sums per byte of continuation. Items are generated from a seed: arithmetic, world capitals, and
the value of short Python expressions.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from tokenmill.eval.client import Backend
from tokenmill.eval.metrics import Metric, choose
from tokenmill.eval.tasks.base import ItemResult, PairedMetric, ProgressBar, Task, TaskConfig, mean, register

NUM_CHOICES = 4
CAPITALS = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("China", "Beijing"), ("Russia", "Moscow"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Australia", "Canberra"),
    ("Brazil", "Brasília"), ("India", "New Delhi"), ("Greece", "Athens"), ("Portugal", "Lisbon"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Austria", "Vienna"),
    ("Ireland", "Dublin"), ("Kenya", "Nairobi"), ("Argentina", "Buenos Aires"), ("Mexico", "Mexico City"),
    ("Turkey", "Ankara"), ("Thailand", "Bangkok"), ("Peru", "Lima"), ("Finland", "Helsinki"),
    ("Denmark", "Copenhagen"), ("Hungary", "Budapest"), ("Cuba", "Havana"), ("Chile", "Santiago"),
)


@dataclass(frozen=True, slots=True)
class Question:
    kind: str
    context: str
    choices: tuple[str, ...]  # continuations, each starting with a space
    answer: int


def _shuffled(rng: random.Random, correct: str, wrong: list[str]) -> tuple[tuple[str, ...], int]:
    options = [correct, *wrong[:NUM_CHOICES - 1]]
    rng.shuffle(options)
    return tuple(" " + o for o in options), options.index(correct)


def _arithmetic(rng: random.Random) -> Question:
    a, b = rng.randrange(10, 100), rng.randrange(10, 100)
    answer = a + b
    wrong = [str(answer + d) for d in rng.sample([-10, -2, -1, 1, 2, 10], 3)]
    choices, index = _shuffled(rng, str(answer), wrong)
    return Question("arithmetic", f"Question: What is {a} plus {b}?\nAnswer:", choices, index)


def _capital(rng: random.Random) -> Question:
    country, capital = rng.choice(CAPITALS)
    wrong = [c for _, c in rng.sample([p for p in CAPITALS if p[1] != capital], NUM_CHOICES - 1)]
    choices, index = _shuffled(rng, capital, wrong)
    return Question("capital", f"Question: What is the capital city of {country}?\nAnswer:", choices, index)


def _expression(rng: random.Random) -> Question:
    xs = rng.sample(range(1, 20), rng.randrange(3, 6))
    word = rng.choice(["python", "token", "kernel", "matrix", "sample", "vector"])
    k = rng.randrange(1, 4)
    templates: list[tuple[str, Callable[[], object]]] = [
        (f"len({xs})", lambda: len(xs)), (f"max({xs})", lambda: max(xs)), (f"min({xs})", lambda: min(xs)),
        (f"sum({xs})", lambda: sum(xs)), (f"sorted({xs})[{k}]", lambda: sorted(xs)[k]),
        (f"{xs}[-1]", lambda: xs[-1]), (f"len('{word}')", lambda: len(word)),
        (f"'{word}'.upper()", lambda: repr(word.upper())), (f"'{word}'[{k}:]", lambda: repr(word[k:])),
        (f"'{word}'[::-1]", lambda: repr(word[::-1])),
    ]
    expression, value = rng.choice(templates)
    result = value()
    if isinstance(result, int):
        wrong = [str(result + d) for d in rng.sample([d for d in (-2, -1, 1, 2, 3) if result + d >= 0], 3)]
        correct = str(result)
    else:
        text = str(result)[1:-1]
        variants = [text.swapcase(), text[::-1], text[1:], text + text[-1], word, word[::-1].upper()]
        wrong = list(dict.fromkeys(repr(v) for v in variants if v != text and v))
        correct = str(result)
    choices, index = _shuffled(rng, correct, wrong)
    return Question("python", f"Question: In Python, what is the value of {expression}?\nAnswer:", choices, index)


def questions(count: int, seed: int) -> list[Question]:
    rng = random.Random(f"multiple-choice-{seed}")
    makers = (_arithmetic, _capital, _expression)
    return [makers[i % len(makers)](rng) for i in range(count)]


def continuation_tokens(backend: Backend, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-evaluation-harness's split: tokenize the whole, take the context's tokens off the front
    (so a merge across the boundary is tokenized as the model would see it), else each on its own."""
    context_ids = backend.tokenize(context)
    whole = backend.tokenize(context + continuation)
    if whole[:len(context_ids)] == context_ids and len(whole) > len(context_ids):
        return context_ids, whole[len(context_ids):]
    return context_ids, backend.tokenize(continuation)


@register
class MultipleChoice(Task):
    name = "mc"
    description = "4-way multiple choice by log-likelihood (arithmetic, capitals, Python values): acc, acc_norm"
    default_items = 48
    metrics = (
        PairedMetric(Metric("acc", mean("correct")), "correct", binary=True),
        PairedMetric(Metric("acc_norm", mean("correct_norm")), "correct_norm", binary=True),
    )

    def run(self, backend: Backend, config: TaskConfig, progress: ProgressBar) -> list[ItemResult]:
        items = questions(config.items(self.default_items), config.seed)
        bos = backend.prompt_bos()
        start = [] if bos is None else [bos]
        prompts: list[list[int]] = []
        lengths: list[int] = []
        for question in items:
            for choice in question.choices:
                context_ids, cont_ids = continuation_tokens(backend, question.context, choice)
                prompts.append([*start, *context_ids, *cont_ids])
                lengths.append(len(cont_ids))
        progress.start(len(prompts))
        scored = backend.score(prompts, top_k=1, progress=progress.advance)  # lm-eval asks for logprobs=1
        results = []
        for i, question in enumerate(items):
            rows = range(i * NUM_CHOICES, (i + 1) * NUM_CHOICES)
            sums = [sum(p.logprob for p in scored[r][-lengths[r]:]) for r in rows]
            byte_lengths = [len(c.encode("utf-8")) for c in question.choices]
            picked, picked_norm = choose(sums), choose(sums, byte_lengths)
            results.append(ItemResult(f"mc-{i}", {
                "correct": float(picked == question.answer), "correct_norm": float(picked_norm == question.answer),
            }, {"kind": question.kind, "context": question.context, "choices": list(question.choices),
                "answer": question.answer, "logprobs": sums}))
        return results
