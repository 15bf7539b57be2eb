"""Run a suite of tasks on one backend: items, per-task metrics with bootstrap intervals, timing."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.eval.client import Backend
from tokenmill.eval.metrics import Interval, bootstrap_interval
from tokenmill.eval.tasks.base import ItemResult, NoProgress, ProgressBar, Task, TaskConfig, columns, get_task

DEFAULT_TASKS = ("ppl-docstrings", "ppl-heldout", "next-token", "arithmetic", "code", "mc", "greedy")
NUM_RESAMPLES = 1000


@dataclass(frozen=True, slots=True)
class SuiteConfig:
    tasks: tuple[str, ...] = DEFAULT_TASKS
    task: TaskConfig = field(default_factory=TaskConfig)
    num_resamples: int = NUM_RESAMPLES
    bootstrap_seed: int = 0


@dataclass(slots=True)
class TaskRun:
    task: Task
    items: list[ItemResult]
    metrics: dict[str, float]
    intervals: dict[str, Interval]
    summary: dict[str, Any]
    seconds: float

    def as_dict(self, with_items: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {
            "description": self.task.description,
            "num_items": len(self.items),
            "seconds": round(self.seconds, 3),
            "metrics": {k: _json_float(v) for k, v in self.metrics.items()},
            "intervals": {k: [_json_float(i.low), _json_float(i.high)] for k, i in self.intervals.items()},
            **({"summary": self.summary} if self.summary else {}),
        }
        if with_items:
            data["items"] = [{"id": item.item_id, "values": {k: _json_float(v) for k, v in item.values.items()},
                              **({"detail": item.detail} if item.detail else {})} for item in self.items]
        return data


ProgressFactory = Callable[[str], ProgressBar]


def run_task(task: Task, backend: Backend, config: SuiteConfig, progress: ProgressBar | None = None) -> TaskRun:
    start = time.perf_counter()
    items = task.run(backend, config.task, progress or NoProgress())
    seconds = time.perf_counter() - start
    cols = columns(items)
    metrics: dict[str, float] = {}
    intervals: dict[str, Interval] = {}
    for paired in task.metrics:
        metric = paired.metric
        metrics[metric.name] = metric.aggregate(cols) if items else math.nan
        if items and math.isfinite(metrics[metric.name]):
            intervals[metric.name] = bootstrap_interval(cols, metric.aggregate, num_resamples=config.num_resamples,
                                                        seed=config.bootstrap_seed)
    return TaskRun(task, items, metrics, intervals, task.summarize(items), seconds)


def run_suite(backend: Backend, config: SuiteConfig, progress: ProgressFactory | None = None) -> list[TaskRun]:
    runs = []
    for name in config.tasks:
        task = get_task(name)
        runs.append(run_task(task, backend, config, progress(f"{backend.name}: {name}") if progress else None))
    return runs


def validate_tasks(names: Sequence[str]) -> tuple[str, ...]:
    for name in names:
        get_task(name)  # raises with the list of known tasks
    return tuple(names)


def _json_float(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None
