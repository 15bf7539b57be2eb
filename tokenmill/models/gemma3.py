"""Gemma 3 text decoder: Llama's skeleton plus the Gemma differences.

  * norms scale by (1 + w); extra norms after attention and around the MLP (sandwich norms)
  * per-head RMSNorm on q and k before RoPE
  * embeddings scaled by sqrt(hidden_size)
  * sliding-window local layers with their own RoPE base; softmax scale query_pre_attn_scalar^-0.5
"""

from __future__ import annotations

import torch

from tokenmill.layers.attention import AttentionMetadata, PagedAttention
from tokenmill.layers.kv_cache import LayerKVCache
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RopeTables
from tokenmill.models.arch import ArchConfig
from tokenmill.models.llama import DecoderLayer, LlamaForCausalLM


class Gemma3DecoderLayer(DecoderLayer):
    def __init__(self, arch: ArchConfig, layer_idx: int, norm_offset: float) -> None:
        super().__init__(arch, layer_idx, norm_offset)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, norm_offset)
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, norm_offset)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, norm_offset)
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps, norm_offset)

    def norms(self) -> dict[str, RMSNorm]:
        return {**super().norms(), "pre_feedforward_layernorm": self.pre_feedforward_layernorm,
                "post_feedforward_layernorm": self.post_feedforward_layernorm,
                "self_attn.q_norm": self.q_norm, "self_attn.k_norm": self.k_norm}

    has_qk_norm = True

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)

    def forward(self, x: torch.Tensor, rope: RopeTables, attn: PagedAttention,
                kv: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        a = self.attention(self.input_layernorm(x), rope, attn, kv, meta)
        h = x + self.post_attention_layernorm(a)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    norm_offset = 1.0
    layer_class = Gemma3DecoderLayer

    def attention_scale(self) -> float:
        scalar = self.arch.query_pre_attn_scalar or self.arch.head_dim
        return float(scalar) ** -0.5

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # HF rounds the normaliser to the activation dtype before multiplying.
        normalizer = torch.tensor(self.arch.hidden_size**0.5, dtype=self.dtype)
        return super().embed(input_ids) * normalizer
