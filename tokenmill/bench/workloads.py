"""Workload archetypes: named, parameterised recipes for sessions, with the arrival process and
SLOs their users care about. Add one by subclassing `Workload` and listing it in `WORKLOADS`.

    chatbot   people chatting: multi-turn, streamed, short replies; judged on P99 TTFT and TPOT
    agent     a long shared system prompt (tool docs) + tool outputs appended turn after turn,
              code out; prefix reuse matters; judged on end-to-end seconds per step
    dataproc  a large burst of independent long generations; only throughput and cost count
    mixed     chatbot sessions (interactive) arriving while a dataproc burst (batch) runs on the
              same target: chat goodput and batch throughput at once (run by bench/mixed.py)
    tool_agent  the agent with real tool calls (bench/tool_agent.py): tools in the system prompt, one
              required call per turn under the server's grammar, tool results appended
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from tokenmill.bench.arrivals import ArrivalOptions
from tokenmill.bench.corpus import TextKind
from tokenmill.bench.errors import BenchError
from tokenmill.bench.metrics import SLO
from tokenmill.bench.sessions import Api, Session, Turn
from tokenmill.bench.tokens import PromptFactory


@dataclass(slots=True, frozen=True)
class WorkloadParams:
    num_sessions: int
    turns: int  # turns per session (1: independent requests)
    input_len: int  # tokens of each appended user or tool message
    output_len: int  # max_tokens of each turn (exact with ignore_eos)
    system_len: int = 0  # tokens of the system prompt (0: none)
    prefix_groups: int = 1  # distinct system prompts; session i shares group i % prefix_groups
    range_ratio: float = 0.0  # lengths uniform in [len·(1 - r), len·(1 + r)], vLLM's random dataset
    think_time_s: float = 0.0  # pause between a reply and the next turn of the same session

    def __post_init__(self) -> None:
        positive = ("num_sessions", "turns", "input_len", "output_len", "prefix_groups")
        if any(getattr(self, name) < 1 for name in positive):
            raise BenchError(f"workload sizes must be ≥ 1: {', '.join(positive)}")
        if not 0 <= self.range_ratio < 1 or self.system_len < 0 or self.think_time_s < 0:
            raise BenchError("workload needs 0 <= range_ratio < 1, system_len >= 0 and think_time_s >= 0")

    @property
    def num_requests(self) -> int:
        return self.num_sessions * self.turns

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def jittered(length: int, range_ratio: float, rng: np.random.Generator) -> int:
    if range_ratio == 0:
        return length
    low, high = math.floor(length * (1 - range_ratio)), math.ceil(length * (1 + range_ratio))
    return max(1, int(rng.integers(low, high + 1)))


class Workload(ABC):
    name: ClassVar[str]
    description: ClassVar[str]
    api: ClassVar[Api] = Api.CHAT
    text_kind: ClassVar[TextKind] = TextKind.PROSE
    preamble: ClassVar[str] = ""  # instructions that open every system prompt

    @abstractmethod
    def default_params(self) -> WorkloadParams: ...

    def default_slo(self) -> SLO:
        return SLO()

    def default_arrival(self) -> tuple[str, ArrivalOptions]:
        return "poisson", ArrivalOptions(rate=1.0)

    async def build_sessions(self, params: WorkloadParams, prompts: PromptFactory,
                             rng: np.random.Generator) -> list[Session]:
        systems = [await self._system(params, prompts, rng) for _ in range(params.prefix_groups)]
        return [await self._session(params, systems[i % len(systems)], prompts, rng)
                for i in range(params.num_sessions)]

    async def _system(self, params: WorkloadParams, prompts: PromptFactory,
                      rng: np.random.Generator) -> tuple[str, int] | None:
        if params.system_len == 0:
            return None
        body = await prompts.text(self.text_kind, params.system_len, rng)
        text = f"{self.preamble}\n\n{body}" if self.preamble else body
        return text, await prompts.count(text)

    async def _session(self, params: WorkloadParams, system: tuple[str, int] | None, prompts: PromptFactory,
                       rng: np.random.Generator) -> Session:
        turns = [await self._turn(params, index, prompts, rng) for index in range(params.turns)]
        return Session(tuple(turns), *(system or (None, 0)))

    async def _turn(self, params: WorkloadParams, index: int, prompts: PromptFactory,
                    rng: np.random.Generator) -> Turn:
        num_tokens = jittered(params.input_len, params.range_ratio, rng)
        text = self.framed(index, await prompts.text(self.text_kind, num_tokens, rng))
        return Turn(text, num_tokens, jittered(params.output_len, params.range_ratio, rng))

    def framed(self, turn_index: int, text: str) -> str:
        """The appended message around a corpus excerpt (override to add a frame)."""
        return text


class Chatbot(Workload):
    name = "chatbot"
    description = "multi-turn chat, short streamed replies; SLOs on P99 TTFT and P99 TPOT"
    preamble = "You are a helpful assistant. Answer briefly."

    def default_params(self) -> WorkloadParams:
        return WorkloadParams(num_sessions=16, turns=3, input_len=64, output_len=48, system_len=32,
                              think_time_s=0.5, range_ratio=0.25)

    def default_slo(self) -> SLO:
        return SLO(ttft_s=2.0, tpot_s=0.2)

    def default_arrival(self) -> tuple[str, ArrivalOptions]:
        return "poisson", ArrivalOptions(rate=1.0)


class Agent(Workload):
    name = "agent"
    description = "long shared system prompt, tool outputs appended each turn, code out; E2E budget"
    text_kind = TextKind.CODE
    preamble = "You are a coding agent. Read the tool output and reply with the next Python code to run."

    def default_params(self) -> WorkloadParams:
        return WorkloadParams(num_sessions=8, turns=4, input_len=128, output_len=64, system_len=1024)

    def default_slo(self) -> SLO:
        return SLO(e2e_s=10.0)

    def default_arrival(self) -> tuple[str, ArrivalOptions]:
        return "poisson", ArrivalOptions(rate=0.5)

    def framed(self, turn_index: int, text: str) -> str:
        return f"Task: continue this module.\n```python\n{text}\n```" if turn_index == 0 else \
            f"Tool output:\n```\n{text}\n```"


class Dataproc(Workload):
    name = "dataproc"
    description = "a burst of independent requests with long outputs; throughput and cost"
    api = Api.COMPLETIONS

    def default_params(self) -> WorkloadParams:
        return WorkloadParams(num_sessions=64, turns=1, input_len=256, output_len=256)

    def default_arrival(self) -> tuple[str, ArrivalOptions]:
        return "burst", ArrivalOptions()


WORKLOADS: dict[str, Workload] = {w.name: w for w in (Chatbot(), Agent(), Dataproc())}


class Mixed(Workload):
    """Its own sessions are the chat part; `batch_params` sizes the burst (bench/mixed.py runs both)."""

    name = "mixed"
    description = "chatbot sessions (interactive) during a dataproc burst (batch) on one target; both classes"
    preamble = Chatbot.preamble

    def default_params(self) -> WorkloadParams:
        return WorkloadParams(num_sessions=8, turns=2, input_len=64, output_len=32, system_len=32,
                              think_time_s=0.5, range_ratio=0.25)

    def batch_params(self) -> WorkloadParams:
        return WorkloadParams(num_sessions=48, turns=1, input_len=128, output_len=192)

    def default_slo(self) -> SLO:
        return Chatbot().default_slo()


WORKLOADS[Mixed.name] = Mixed()


def get_workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise BenchError(f"unknown workload {name!r}: pick one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name]


# The tool-calling agent lives in its own module and registers itself in WORKLOADS; imported last,
# after everything it uses from here is defined.
import tokenmill.bench.tool_agent  # noqa: E402, F401
