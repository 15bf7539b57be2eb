"""What a task asks of a model, behind one small interface with two backends.

`Backend.score` is lm-evaluation-harness's loglikelihood request: token-id prompts, and for
every position after the first the logprob of the token that is there plus the top-k. Over
HTTP that is `/v1/completions` with `echo`, `logprobs=k` and `max_tokens=1`; in process it is
`SamplingParams(prompt_logprobs=k)`. `Backend.generate` is a greedy (or sampled) completion.
Token keys are ids whenever the backend can report them (tokenmill and vLLM do over HTTP with
`return_tokens_as_token_ids`), else the token's text.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import TokenmillError
from tokenmill.eval.metrics import TokenKey

Prompt = str | list[int]
Progress = Callable[[int], None]  # called with the number of prompts just finished


class EvalError(TokenmillError):
    """An eval that cannot run: bad spec, unreachable target, a server without the needed features."""


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """One scored position: the token that is there, its logprob, and the top-k (with it)."""

    token: TokenKey
    logprob: float
    top: dict[TokenKey, float]


@dataclass(frozen=True, slots=True)
class Generation:
    text: str
    token_ids: list[int] | None  # None: the backend reports only text
    tokens: list[str] = field(default_factory=list)  # per-token text where known
    finish_reason: str | None = None


@dataclass(frozen=True, slots=True)
class GenerateOptions:
    max_tokens: int
    stop: tuple[str, ...] = ()
    temperature: float = 0.0
    seed: int | None = None


class Backend(ABC):
    """A model to evaluate. Implementations must be safe to call from one thread at a time."""

    name: str

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """The model's tokens for `text`, without special tokens."""

    @abstractmethod
    def prefix_token(self) -> int:
        """A token to put before a text so that its first token is scored too (BOS, else EOS)."""

    @abstractmethod
    def prompt_bos(self) -> int | None:
        """The BOS id when the model's tokenizer puts BOS before every prompt (Gemma, Llama), else None."""

    @abstractmethod
    def max_length(self) -> int:
        """The longest prompt (in tokens) `score` takes: the model's context less one generated token."""

    @abstractmethod
    def score(self, prompts: Sequence[list[int]], top_k: int,
              progress: Progress | None = None) -> list[list[PositionLogprobs]]:
        """Per prompt, one entry per position 1..n-1 (position 0 has no context)."""

    @abstractmethod
    def generate(self, prompts: Sequence[Prompt], options: GenerateOptions,
                 progress: Progress | None = None) -> list[Generation]:
        """One completion per prompt, in prompt order."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What this backend is (JSON-able), for the result file."""

    def close(self) -> None:  # noqa: B027  # most backends hold nothing
        """Release connections or the engine."""


# ------------------------------------------------------------------ specs


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """`http://host:port[,model=name,api_key=K,concurrency=8]` or `model=NAME[,key=value...]`."""

    url: str | None = None
    model: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        if self.url is not None:
            return self.url
        extra = ",".join(f"{k}={v}" for k, v in self.options.items())
        return f"model={self.model}" + (f",{extra}" if extra else "")


def parse_spec(text: str) -> TargetSpec:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise EvalError("an empty target spec: give a URL (http://127.0.0.1:8000) or model=NAME[,key=value]")
    url = None
    if parts[0].startswith(("http://", "https://")):
        url = parts.pop(0)
    options: dict[str, Any] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise EvalError(f"bad spec item {part!r} in {text!r}: expected key=value")
        options[key.strip().replace("-", "_")] = coerce_value(value.strip())
    model = options.pop("model", None)
    if url is None and model is None:
        raise EvalError(f"spec {text!r} names neither a URL nor model=NAME")
    return TargetSpec(url, None if model is None else str(model), options)


def with_common_dtype(reference: TargetSpec, candidate: TargetSpec,
                      cpu_auto_bf16: bool | None = None) -> tuple[TargetSpec, TargetSpec, str | None]:
    """Both in-process specs with `dtype=float32` where neither names a dtype, both run on the CPU, and this
    CPU's auto dtype is bfloat16; a note saying so, else None. There a dense reference (`quantization=none`)
    would run in bf16 with a bf16 KV cache while quantized GGUF weights run float32 activations
    (engine/loader.py, resolve_compute_dtype): a quant gate then measures bf16's error, not the
    quantization's (Qwen2.5-Coder-0.5B: top-1 agreement 0.888 and perplexity +3.1% in bf16 against 1.000
    and +0.001% in float32, Zen 5). Name a dtype on either side to compare dtypes on purpose."""
    specs = (reference, candidate)
    devices = {str(s.options.get("device", "auto")) for s in specs}
    if any(s.url is not None or "dtype" in s.options for s in specs) or not devices <= {"cpu", "auto"}:
        return reference, candidate, None
    if cpu_auto_bf16 is None:
        import torch

        from tokenmill.platform import auto_dtype

        # `auto` is the GPU where there is one (ModelConfig.torch_device): bf16 on both sides there.
        on_gpu = "auto" in devices and torch.cuda.is_available()
        cpu_auto_bf16 = not on_gpu and auto_dtype(torch.device("cpu")) == torch.bfloat16
    if not cpu_auto_bf16:
        return reference, candidate, None
    pinned = [TargetSpec(s.url, s.model, {**s.options, "dtype": "float32"}) for s in specs]
    return pinned[0], pinned[1], ("dtype=float32 on both sides: this CPU's auto dtype is bfloat16, which a dense "
                                  "reference would run in while quantized weights run float32 (name a dtype to "
                                  "compare dtypes)")


def coerce_value(value: str) -> Any:
    """A spec value as the engine wants it: "8" → 8, "0.5" → 0.5, "true" → True, else the string."""
    lowered = value.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def open_backend(spec: TargetSpec) -> Backend:
    if spec.url is not None:
        from tokenmill.eval.http_backend import HttpBackend

        options = dict(spec.options)
        api_key = options.pop("api_key", None)
        concurrency = int(options.pop("concurrency", 8))
        timeout = float(options.pop("timeout", 600.0))
        if options:
            raise EvalError(f"unknown options for an HTTP target: {', '.join(sorted(options))} "
                            "(known: model, api_key, concurrency, timeout)")
        return HttpBackend(spec.url, spec.model, api_key=None if api_key is None else str(api_key),
                           concurrency=concurrency, timeout_s=timeout)
    from tokenmill.eval.engine_backend import EngineBackend

    assert spec.model is not None
    return EngineBackend(spec.model, spec.options)
