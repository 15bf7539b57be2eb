"""Token embeddings: one object per table that owns its storage and its row lookup.

    build_embedding(tensors, name, LinearConfig) → Embedding        (models call only this)
        a GGUF table under a quantized mode on CPU: GgufRowsEmbedding (the blocks stay in the file's
        memory map; a lookup dequantizes only its rows)
        anything else: DenseEmbedding (a float table in the model dtype, which a tied dense lm_head reuses)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from tokenmill.layers import gguf_quant as gq
from tokenmill.layers.linear import LinearConfig, raw_blocks
from tokenmill.layers.quant_formats import RawBlocks


class Embedding(ABC):
    """Rows of the token embedding, in the model dtype."""

    @abstractmethod
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor: ...

    @property
    @abstractmethod
    def dense_weight(self) -> torch.Tensor | None:
        """The float table when there is one (a tied dense lm_head reuses it)."""

    @property
    @abstractmethod
    def nbytes(self) -> int: ...


class DenseEmbedding(Embedding):
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    @property
    def dense_weight(self) -> torch.Tensor | None:
        return self.weight

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


class GgufRowsEmbedding(Embedding):
    """The GGUF blocks stay in the memory map; a lookup dequantizes only the rows it needs (a
    vocabulary-sized fp32 copy would be 4-8x the stored bytes and is read a few rows per step)."""

    def __init__(self, raw: RawBlocks, dtype: torch.dtype) -> None:
        self.raw = raw
        self.dtype = dtype

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1).cpu().numpy()
        rows = gq.gguf_dequantize(self.raw.data[ids], self.raw.ggml_type, self.raw.shape[1])
        return rows.to(self.dtype).view(*input_ids.shape, self.raw.shape[1])

    @property
    def dense_weight(self) -> torch.Tensor | None:
        return None

    @property
    def nbytes(self) -> int:
        return 0  # mapped from the file: only the pages of looked-up rows become resident


def build_embedding(tensors: Mapping[str, torch.Tensor], name: str, config: LinearConfig) -> Embedding:
    raw = raw_blocks(tensors, name)
    if raw is not None and config.quantization != "none" and config.device.type == "cpu":
        return GgufRowsEmbedding(raw, config.dtype)
    return DenseEmbedding(tensors[name].to(config.device, config.dtype).contiguous())
