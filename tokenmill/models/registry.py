"""Architecture name → model class."""

from __future__ import annotations

from tokenmill.errors import ModelFormatError
from tokenmill.models.gemma3 import Gemma3ForCausalLM
from tokenmill.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    if architecture not in MODEL_CLASSES:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise ModelFormatError(f"architecture '{architecture}' is not supported (supported: {supported})")
    return MODEL_CLASSES[architecture]
