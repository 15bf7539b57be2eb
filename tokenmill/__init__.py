"""tokenmill: an LLM inference serving engine on PyTorch."""

__version__ = "0.1.0"
