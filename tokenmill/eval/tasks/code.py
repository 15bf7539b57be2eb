"""Code completion, pass@1: complete a function from its signature and docstring (greedy), run the
completed function against hidden asserts in the sandbox (`eval.sandbox`: timeout, limits, no
writes outside a temporary folder). The completion ends at HumanEval's stop sequences."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tokenmill.eval.client import Backend, GenerateOptions
from tokenmill.eval.metrics import Metric
from tokenmill.eval.sandbox import SandboxLimits, run_python
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
from tokenmill.eval.tasks.code_problems import PROBLEMS, CodeProblem

STOP = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#", "\nassert ", "```")  # the last: a chat model closing markdown
MAX_TOKENS = 160
SANDBOX_WORKERS = 2


def program(problem: CodeProblem, completion: str) -> str:
    return problem.prompt + completion + "\n\n" + problem.tests


@register
class Code(Task):
    name = "code"
    description = "complete a Python function, run hidden asserts in a sandbox (pass@1, greedy)"
    default_items = len(PROBLEMS)
    metrics = (PairedMetric(Metric("pass_at_1", mean("passed")), "passed", binary=True),)
    limits = SandboxLimits(timeout_s=10.0)

    def run(self, backend: Backend, config: TaskConfig, progress: ProgressBar) -> list[ItemResult]:
        problems = PROBLEMS[:config.items(self.default_items)]
        progress.start(len(problems))
        prompts = [fit_prompt(backend, p.prompt, MAX_TOKENS) for p in problems]
        outputs = backend.generate(prompts, GenerateOptions(MAX_TOKENS, STOP), progress.advance)
        with ThreadPoolExecutor(SANDBOX_WORKERS) as pool:
            runs = list(pool.map(lambda pair: run_python(program(pair[0], pair[1].text), self.limits),
                                 zip(problems, outputs, strict=True)))
        return [ItemResult(problem.name, {"passed": float(run.passed)},
                           {"completion": out.text, "timed_out": run.timed_out, "error": run.stderr[-300:]})
                for problem, out, run in zip(problems, outputs, runs, strict=True)]
