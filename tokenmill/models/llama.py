"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2), lean enough for per-step host cost.

Weights arrive with Hugging Face names; q/k/v are fused into one matrix and gate/up into
another so a layer is four GEMMs. Every layer reads and writes the paged KV cache through
`PagedAttention`; nothing here loops over requests.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelFormatError
from tokenmill.layers.attention import AttentionMetadata, PagedAttention, decode_kernel
from tokenmill.layers.kv_cache import LayerKVCache
from tokenmill.layers.linear import LinearFn, linear_kernel
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RopeTables, RotaryEmbedding, apply_rotary
from tokenmill.models.arch import ArchConfig

_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, norm_offset: float, gemm_backend: str = "auto") -> None:
        super().__init__()
        self.arch = arch
        self.gemm_backend = gemm_backend
        self.layer_idx = layer_idx
        self.is_sliding = arch.is_sliding_layer(layer_idx)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, norm_offset)
        self.qkv_weight = torch.empty(0)
        self.qkv_bias: torch.Tensor | None = None
        self.o_weight = torch.empty(0)
        self.gate_up_weight = torch.empty(0)
        self.down_weight = torch.empty(0)
        self.act = _ACTIVATIONS[arch.hidden_act]
        # One GEMM kernel per weight, picked at load from the weight's size (see layers/linear.py).
        self._qkv_mm: LinearFn = F.linear
        self._o_mm: LinearFn = F.linear
        self._gate_up_mm: LinearFn = F.linear
        self._down_mm: LinearFn = F.linear

    def load(self, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> None:
        p = f"model.layers.{self.layer_idx}."

        def get(name: str) -> torch.Tensor:
            return _take(tensors, p + name).to(device=device, dtype=dtype)

        self.qkv_weight = torch.cat([get(f"self_attn.{n}_proj.weight") for n in "qkv"]).contiguous()
        if self.arch.attention_bias:
            self.qkv_bias = torch.cat([get(f"self_attn.{n}_proj.bias") for n in "qkv"]).contiguous()
        self.o_weight = get("self_attn.o_proj.weight").contiguous()
        self.gate_up_weight = torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]).contiguous()
        self.down_weight = get("mlp.down_proj.weight").contiguous()
        self._qkv_mm = linear_kernel(self.qkv_weight, self.gemm_backend)
        self._o_mm = linear_kernel(self.o_weight, self.gemm_backend)
        self._gate_up_mm = linear_kernel(self.gate_up_weight, self.gemm_backend)
        self._down_mm = linear_kernel(self.down_weight, self.gemm_backend)
        for name, norm in self.norms().items():
            norm.load(_take(tensors, p + name + ".weight").to(device), dtype)

    def norms(self) -> dict[str, RMSNorm]:
        return {"input_layernorm": self.input_layernorm, "post_attention_layernorm": self.post_attention_layernorm}

    def qkv(self, x: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        num_heads, num_kv_heads = self.arch.num_heads, self.arch.num_kv_heads
        heads = self._qkv_mm(x, self.qkv_weight, self.qkv_bias)
        heads = heads.view(-1, num_heads + 2 * num_kv_heads, self.arch.head_dim)
        v = heads[:, num_heads + num_kv_heads:]
        if self.has_qk_norm:
            q, k = self.qk_norm(heads[:, :num_heads], heads[:, num_heads:num_heads + num_kv_heads])
            return apply_rotary(q, *rope), apply_rotary(k, *rope), v
        # q and k rotate together: one set of RoPE ops per layer instead of two.
        qk = apply_rotary(heads[:, :num_heads + num_kv_heads], *rope)
        return qk[:, :num_heads], qk[:, num_heads:], v

    has_qk_norm = False

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up_mm(x, self.gate_up_weight, None).chunk(2, dim=-1)
        return self._down_mm(self.act(gate) * up, self.down_weight, None)

    def attention(self, x: torch.Tensor, rope: RopeTables, attn: PagedAttention,
                  kv: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv(x, rope)
        out = attn(q, k, v, kv, meta, self.is_sliding)
        return self._o_mm(out, self.o_weight, None)

    def forward(self, x: torch.Tensor, rope: RopeTables, attn: PagedAttention,
                kv: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        h = x + self.attention(self.input_layernorm(x), rope, attn, kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    norm_offset = 0.0
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, arch: ArchConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                 gemm_backend: str = "auto", attention_backend: str = "auto") -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.gemm_backend = gemm_backend
        self.layers = nn.ModuleList(self.layer_class(arch, i, self.norm_offset, gemm_backend)
                                    for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, self.norm_offset)
        self.embed_weight = torch.empty(0)
        self.lm_head_weight = torch.empty(0)
        self._lm_head_mm: LinearFn = F.linear
        self.attn = PagedAttention(arch.num_heads, arch.num_kv_heads, arch.head_dim, self.attention_scale(),
                                   arch.attn_logit_softcapping, arch.sliding_window,
                                   decode_kernel(attention_backend, device))
        self.rope_global = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_theta,
                                           arch.rope_scaling_factor or 1.0, dtype, device)
        self.rope_local = self.rope_global
        if arch.rope_local_theta is not None:
            self.rope_local = RotaryEmbedding(arch.head_dim, max_positions, arch.rope_local_theta, 1.0, dtype, device)

    def attention_scale(self) -> float:
        return float(self.arch.head_dim) ** -0.5

    def load_weights(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.embed_weight = _take(tensors, "model.embed_tokens.weight").to(self.device, self.dtype).contiguous()
        if self.arch.tie_word_embeddings or "lm_head.weight" not in tensors:
            self.lm_head_weight = self.embed_weight
        else:
            self.lm_head_weight = _take(tensors, "lm_head.weight").to(self.device, self.dtype).contiguous()
        self._lm_head_mm = linear_kernel(self.lm_head_weight, self.gemm_backend)
        self.norm.load(_take(tensors, "model.norm.weight").to(self.device), self.dtype)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.load(tensors, self.dtype, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_weight)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final hidden states [T, hidden]."""
        x = self.embed(input_ids)
        rope_global = self.rope_global.tables(positions)  # gathered once per step, shared by layers
        rope_local = self.rope_local.tables(positions) if self.rope_local is not self.rope_global else rope_global
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope_local if layer.is_sliding else rope_global, self.attn, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → float32 logits [N, vocab]."""
        logits = self._lm_head_mm(hidden, self.lm_head_weight, None).float()
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _take(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise ModelFormatError(f"checkpoint is missing tensor '{name}': the file is incomplete or another architecture")
    return tensors[name]
