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

from tokenmill.eval.client import Backend, EvalError
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
