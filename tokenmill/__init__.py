"""tokenmill: an LLM inference serving engine on PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from tokenmill.engine.request import SamplingParams
    from tokenmill.llm import LLM


def __getattr__(name: str) -> Any:
    # Lazy: `tokenmill pull` and `tokenmill models` should not pay for importing torch.
    if name == "LLM":
        from tokenmill.llm import LLM

        return LLM
    if name == "SamplingParams":
        from tokenmill.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
