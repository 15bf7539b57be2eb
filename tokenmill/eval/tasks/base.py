"""The task plug-in contract: a `Task` builds its items from local data and a seed, runs them on a
`Backend`, and returns one `ItemResult` per item; aggregates are `Metric`s over the items' values.

A task that can compare two models position by position (next-token agreement, greedy identity)
also implements `pair`, which turns a reference item and a candidate item into paired values.
Register a task with `@register`; `tokenmill eval run --tasks NAME` then finds it.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from tokenmill.eval.client import Backend, EvalError, PositionLogprobs, Prompt
from tokenmill.eval.metrics import Columns, Metric


class ProgressBar(Protocol):
    def start(self, total: int) -> None: ...

    def advance(self, count: int) -> None: ...


class NoProgress:
    def start(self, total: int) -> None:
        pass

    def advance(self, count: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class TaskConfig:
    num_items: int | None = None  # None: the task's default
    seed: int = 0
    golden_dir: Path | None = None  # greedy: where golden files live (None: the shipped ones)

    def items(self, default: int) -> int:
        return default if self.num_items is None else self.num_items


@dataclass(slots=True)
class ItemResult:
    item_id: str
    values: dict[str, float]  # per-item numbers: the columns metrics aggregate
    detail: dict[str, Any] = field(default_factory=dict)  # JSON-able, kept in the result file
    raw: Any = None  # in memory only (per-position top-k lists, token ids): for `pair`


@dataclass(frozen=True, slots=True)
class PairedMetric:
    """A metric of one model's items whose paired test uses `column`'s per-item differences:
    `binary` columns (right/wrong) get McNemar's exact test, the rest a sign-flip permutation test."""

    metric: Metric
    column: str
    binary: bool = False
    relative: bool = False  # deltas as a ratio (perplexity: -1% is the same at any level)


class Task(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    default_items: ClassVar[int]
    metrics: ClassVar[tuple[PairedMetric, ...]]
    pair_metrics: ClassVar[tuple[Metric, ...]] = ()  # over the columns `pair` returns

    @abstractmethod
    def run(self, backend: Backend, config: TaskConfig, progress: ProgressBar) -> list[ItemResult]:
        """Build the items (deterministic for `config`) and run them all."""

    def pair(self, reference: ItemResult, candidate: ItemResult) -> dict[str, float]:
        """Paired per-item values of two models on the same item (only with `pair_metrics`)."""
        raise NotImplementedError

    def summarize(self, items: list[ItemResult]) -> dict[str, Any]:
        """Extra JSON-able facts about a run (e.g. whether a golden file was found)."""
        return {}


MAX_WINDOW = 1024  # tokens per scoring request, at most: longer texts are scored in rolling windows


def score_texts(backend: Backend, texts: list[list[int]], top_k: int, progress: ProgressBar,
                max_window: int = MAX_WINDOW) -> list[list[PositionLogprobs]]:
    """Logprobs of every token of each text, the first given the prefix token (BOS, else EOS).

    A text longer than a window is scored as lm-evaluation-harness's rolling loglikelihood does:
    the first window from the start, then windows that each score the next `window // 2` tokens
    with the preceding tokens as context, so every token is scored once with at least half a
    window before it.
    """
    prefix = backend.prefix_token()
    window = max(min(backend.max_length(), max_window), 2)
    stride = max(window // 2, 1)
    requests: list[tuple[int, list[int], int]] = []  # (text, prompt, how many of its last positions count)
    for index, tokens in enumerate(texts):
        full = [prefix, *tokens]
        if len(full) <= window:
            requests.append((index, full, len(tokens)))
            continue
        requests.append((index, full[:window], window - 1))
        done = window - 1
        while done < len(tokens):
            new = min(stride, len(tokens) - done)
            end = done + 1 + new  # text token j sits at full[j + 1]
            requests.append((index, full[end - window:end], new))
            done += new
    progress.start(len(requests))
    scored = backend.score([prompt for _, prompt, _ in requests], top_k, progress.advance)
    result: list[list[PositionLogprobs]] = [[] for _ in texts]
    for (index, _, count), positions in zip(requests, scored, strict=True):
        result[index].extend(positions[-count:] if count else [])
    return result


def fit_prompt(backend: Backend, text: str, max_tokens: int) -> Prompt:
    """`text` as is when it fits the context with `max_tokens` to generate; else its last tokens after
    the prefix token (a small-context model still gets the end of the prompt, where the question is)."""
    room = backend.max_length() + 1 - max_tokens - 1  # the context, less the generated tokens and the prefix
    tokens = backend.tokenize(text)
    if len(tokens) + 1 <= room:
        return text
    if room < 2:
        raise EvalError(f"{backend.name}'s context is too short for {max_tokens} generated tokens")
    return [backend.prefix_token(), *tokens[-(room - 1):]]


def columns(items: list[ItemResult]) -> Columns:
    keys = items[0].values.keys() if items else []
    return {k: np.array([item.values[k] for item in items], dtype=float) for k in keys}


def ratio(numerator: str, denominator: str) -> Callable[[Columns], float]:
    """Σ numerator / Σ denominator: a pooled rate (tokens, positions) rather than a mean of rates."""
    def aggregate(cols: Columns) -> float:
        total = float(np.sum(cols[denominator]))
        return float(np.sum(cols[numerator])) / total if total > 0 else float("nan")
    return aggregate


def mean(column: str) -> Callable[[Columns], float]:
    def aggregate(cols: Columns) -> float:
        values = cols[column]
        return float(np.mean(values)) if len(values) else float("nan")
    return aggregate


TASKS: dict[str, type[Task]] = {}
BUILTIN_MODULES = ("perplexity", "next_token", "arithmetic", "code", "multiple_choice", "greedy")
T = TypeVar("T", bound=type[Task])


def register(cls: T) -> T:
    if cls.name in TASKS:
        raise ValueError(f"task {cls.name!r} registered twice")
    TASKS[cls.name] = cls
    return cls


def get_task(name: str) -> Task:
    _load_builtin_tasks()
    if name not in TASKS:
        raise EvalError(f"unknown task {name!r}: one of {', '.join(TASKS)}")
    return TASKS[name]()


def task_names() -> list[str]:
    _load_builtin_tasks()
    return list(TASKS)


def _load_builtin_tasks() -> None:
    # Importing the modules registers their tasks; done here so that `base` imports none of them.
    for module in BUILTIN_MODULES:
        importlib.import_module(f"tokenmill.eval.tasks.{module}")
