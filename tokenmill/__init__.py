"""tokenmill: an LLM inference serving engine on PyTorch."""

__version__ = "0.1.0"

from tokenmill.engine.request import SamplingParams
from tokenmill.llm import LLM

__all__ = ["LLM", "SamplingParams", "__version__"]
