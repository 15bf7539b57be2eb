"""One row per request: what the client saw, in seconds relative to the start of the run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any


class TokenSource(StrEnum):
    """Where a request's output token count came from."""

    USAGE = "usage"  # the server's `usage.completion_tokens` (stream_options.include_usage)
    CHUNKS = "chunks"  # no usage sent: one token per content chunk (a lower bound when servers batch)


@dataclass(slots=True)
class RequestRecord:
    """A request as the client measured it. `error_kind` is None exactly when it succeeded.

    Timeline (seconds):  start_s ──ttft_s──▶ first content chunk ──itl_s…──▶ last chunk
                         └──────────────────────── e2e_s ────────────────────────────┘
    """

    session_index: int
    turn_index: int
    start_s: float | None = None  # when it was sent, after the start of the run; None: never sent
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None  # usage.prompt_tokens, else the dataset's count
    output_tokens: int = 0
    output_tokens_source: TokenSource = TokenSource.USAGE
    error_kind: str | None = None
    error: str | None = None
    # The server's own phase times of this request ("queue_s", "prefill_s", "decode_s", "ttft_s",
    # "e2e_s"), from tokenmill's `tokenmill.timings` extension; None where the server sends none.
    server_s: dict[str, float | None] | None = None

    @property
    def is_success(self) -> bool:
        return self.error_kind is None

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), vLLM's per-request TPOT; None with fewer than 2 tokens."""
        if not self.is_success or self.output_tokens < 2 or self.e2e_s is None or self.ttft_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def end_s(self) -> float | None:
        return None if self.start_s is None or self.e2e_s is None else self.start_s + self.e2e_s

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["output_tokens_source"] = self.output_tokens_source.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        fields = dict(data)
        fields["output_tokens_source"] = TokenSource(fields.get("output_tokens_source", "usage"))
        return cls(**fields)


def failed(session_index: int, turn_index: int, kind: str, message: str,
           start_s: float | None = None) -> RequestRecord:
    return RequestRecord(session_index, turn_index, start_s=start_s, error_kind=kind, error=message)
