"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2), lean enough for per-step host cost.

Weights arrive with Hugging Face names; q/k/v are fused into one matrix and gate/up into
another so a layer is four GEMMs. Each matrix is a `Linear` (layers/linear.py) that owns its
storage and kernel, dense or quantized: the model code is the same either way. Every layer
reads and writes the paged KV cache through `PagedAttention`; nothing here loops over requests.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ModelFormatError
from tokenmill.kernels import QUANT_ISAS, cpu_kernels, glue_kernels, triton_available
from tokenmill.layers.attention import AttentionMetadata, PagedAttention, decode_kernel
from tokenmill.layers.embedding import Embedding, build_embedding
from tokenmill.layers.kv_cache import DenseKVCache, LayerKVCache
from tokenmill.layers.linear import Linear, LinearConfig, QuantLinear, build_linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RopeTables, RotaryEmbedding, apply_rotary
from tokenmill.layers.weight_arena import WeightArena, relocate
from tokenmill.models.arch import ArchConfig
from tokenmill.models.compiled import CompiledStack, build_compiled_stack
from tokenmill.models.loading.weights import LazyTensors
from tokenmill.models.native_stack import NativeDecodeStack, build_native_stack

_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class DecoderLayer(nn.Module):
    def __init__(self, arch: ArchConfig, layer_idx: int, norm_offset: float) -> None:
        super().__init__()
        self.arch = arch
        self.layer_idx = layer_idx
        self.is_sliding = arch.is_sliding_layer(layer_idx)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, norm_offset)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, norm_offset)
        self.act = _ACTIVATIONS[arch.hidden_act]
        self.rope_kernel: ModuleType | None = None  # native in-place RoPE (set by load() on CPU)
        self.silu_mul_kernel: ModuleType | None = None  # native SwiGLU glue (set by load() on CPU for silu)
        self.triton_glue: ModuleType | None = None  # fused glue on CUDA (LlamaForCausalLM.use_triton_glue)
        # Set by load(): one Linear per (fused) weight matrix.
        self.qkv_proj: Linear
        self.o_proj: Linear
        self.gate_up_proj: Linear
        self.down_proj: Linear

    def load(self, tensors: Mapping[str, torch.Tensor], config: LinearConfig) -> None:
        p = f"model.layers.{self.layer_idx}."

        def linear(names: list[str], bias_names: list[str] | None = None) -> Linear:
            for name in [*names, *(bias_names or [])]:
                _require(tensors, p + name)
            return build_linear(tensors, [p + n for n in names], [p + n for n in bias_names or []], config)

        qkv = [f"self_attn.{n}_proj" for n in "qkv"]
        self.qkv_proj = linear([f"{n}.weight" for n in qkv], [f"{n}.bias" for n in qkv] if self.arch.attention_bias
                               else None)
        self.o_proj = linear(["self_attn.o_proj.weight"])
        self.gate_up_proj = linear(["mlp.gate_proj.weight", "mlp.up_proj.weight"])
        self.down_proj = linear(["mlp.down_proj.weight"])
        for name, norm in self.norms().items():
            norm.load(_take(tensors, p + name + ".weight").to(config.device), config.dtype)
        self.rope_kernel = glue_kernels() if config.device.type == "cpu" else None
        self.silu_mul_kernel = cpu_kernels() if config.device.type == "cpu" and self.arch.hidden_act == "silu" \
            else None

    def linears(self) -> dict[str, Linear]:
        return {"qkv_proj": self.qkv_proj, "o_proj": self.o_proj, "gate_up_proj": self.gate_up_proj,
                "down_proj": self.down_proj}

    def norms(self) -> dict[str, RMSNorm]:
        return {"input_layernorm": self.input_layernorm, "post_attention_layernorm": self.post_attention_layernorm}

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """The fused projection as [T, q heads + k heads + v heads, head_dim]."""
        return self.qkv_proj(x).view(-1, self.arch.num_heads + 2 * self.arch.num_kv_heads, self.arch.head_dim)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v before RoPE (views of the fused projection; q and k normed where the model norms them)."""
        num_heads, num_kv_heads = self.arch.num_heads, self.arch.num_kv_heads
        heads = self._heads(x)
        q, k = heads[:, :num_heads], heads[:, num_heads:num_heads + num_kv_heads]
        v = heads[:, num_heads + num_kv_heads:]
        return (*self.qk_norm(q, k), v) if self.has_qk_norm else (q, k, v)

    def qkv(self, x: torch.Tensor, rope: RopeTables) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v with RoPE applied to q and k."""
        if self.has_qk_norm:
            q, k, v = self.project(x)
            return apply_rotary(q, *rope, self.rope_kernel), apply_rotary(k, *rope, self.rope_kernel), v
        # q and k rotate together, from the fused projection: one set of RoPE ops per layer instead of two.
        num_heads, num_kv_heads = self.arch.num_heads, self.arch.num_kv_heads
        heads = self._heads(x)
        qk = apply_rotary(heads[:, :num_heads + num_kv_heads], *rope, self.rope_kernel)
        return qk[:, :num_heads], qk[:, num_heads:], heads[:, num_heads + num_kv_heads:]

    has_qk_norm = False

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.triton_glue is not None:
            return self.down_proj(self.triton_glue.act_mul(gate_up, gelu=self.arch.hidden_act != "silu"))
        if self.silu_mul_kernel is not None and gate_up.dtype == torch.float32 and gate_up.is_contiguous():
            return self.down_proj(self.silu_mul_kernel.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def attention(self, x: torch.Tensor, rope: RopeTables, attn: PagedAttention,
                  kv: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        if self.triton_glue is not None and type(kv) is DenseKVCache:
            # RoPE and the KV write in one kernel: k and v go from the projection straight to their slots.
            q, k, v = self.project(x)
            q = self.triton_glue.rope_kv_write(q, k, v, *rope, kv.k, kv.v, meta.slot_mapping)
            return self.o_proj(attn(q, k, v, kv, meta, self.is_sliding, written=True))
        q, k, v = self.qkv(x, rope)
        out = attn(q, k, v, kv, meta, self.is_sliding)
        return self.o_proj(out)

    def forward(self, x: torch.Tensor, rope: RopeTables, attn: PagedAttention,
                kv: LayerKVCache, meta: AttentionMetadata) -> torch.Tensor:
        # x is this forward's own residual stream (the embedding's or the previous layer's output), so
        # the attention output is added into it in place, fused with the norm that reads the sum.
        attended = self.attention(self.input_layernorm(x), rope, attn, kv, meta)
        normed = self.post_attention_layernorm.add_forward(attended, x)
        return x + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    norm_offset = 0.0
    layer_class: type[DecoderLayer] = DecoderLayer

    def __init__(self, arch: ArchConfig, max_positions: int, dtype: torch.dtype, device: torch.device,
                 gemm_backend: str = "auto", attention_backend: str = "auto", quantization: str = "auto") -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.linear_config = LinearConfig(dtype, device, gemm_backend, quantization)
        self.layers = nn.ModuleList(self.layer_class(arch, i, self.norm_offset) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, self.norm_offset)
        # Set by load_weights().
        self.embedding: Embedding
        self.lm_head: Linear
        self.weight_arena: WeightArena | None = None  # the huge-page copy of the quantized weights
        self.native_stack: NativeDecodeStack | None = None  # decode steps in one native call (set by load)
        self.compiled: CompiledStack | None = None  # the torch.compile'd stack (set_compile), for other steps
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
        config = self.linear_config
        embed_name = _require(tensors, "model.embed_tokens.weight")
        self.embedding = build_embedding(tensors, embed_name, config)
        if self.arch.tie_word_embeddings or "lm_head.weight" not in tensors:
            # Tied: a dense head shares the embedding's table; a quantized one packs the same rows.
            self.lm_head = build_linear(tensors, [embed_name], None, config, dense=self.embedding.dense_weight,
                                        precise=True)
        else:
            self.lm_head = build_linear(tensors, ["lm_head.weight"], None, config, precise=True)
        self.norm.load(_take(tensors, "model.norm.weight").to(self.device), self.dtype)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.load(tensors, config)
        if isinstance(tensors, LazyTensors):
            tensors.release_pages()
        if self.device.type == "cpu":
            # After the repack cache is written: the arena's copies replace the loaded tensors.
            self.weight_arena = relocate(self.linears().values())
        elif self.device.type == "cuda" and os.environ.get("TOKENMILL_TRITON_GLUE", "1") != "0":
            self.use_triton_glue(triton_available())
        self.rebind_native_stack()

    def use_triton_glue(self, enabled: bool) -> None:
        """Norms, RoPE + KV write and the gated activation as Triton kernels (kernels/triton_glue.py):
        the default on CUDA where triton imports (TOKENMILL_TRITON_GLUE=0: the ATen ops); on CPU only
        under Triton's interpreter, for tests."""
        glue: ModuleType | None = None
        if enabled:
            from tokenmill.kernels import triton_glue

            glue = triton_glue
        norms = [self.norm]
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.triton_glue = glue
            norms.extend(layer.norms().values())
        for norm in norms:
            norm.triton_glue = glue

    def set_quant_path(self, bf16: bool, isa: str | None = None) -> None:
        """Let the quantized matmuls (not the lm_head, whose near-ties pick tokens) take the amx path's
        bf16 tiles for prefill-sized calls, or keep them all on the integer rounding (the default);
        `isa` also switches their kernel path (A/B benchmarks), None keeps each one's."""
        for name, linear in self.linears().items():
            if isinstance(linear, QuantLinear):
                linear.set_path(isa or QUANT_ISAS[linear.isa], bf16=bf16 and name != "lm_head")
        self.rebind_native_stack()

    def rebind_native_stack(self) -> None:
        """(Re)build the one-call native decode stack from the layers' current kernels (after any
        change to them: it holds their plans); None where some piece is not native."""
        self.native_stack = build_native_stack(self)

    def set_compile(self, mode: str) -> None:
        """Run steps the native stack does not take through the torch.compile'd stack (models/compiled.py)
        where `mode` ("auto", "on", "off": ModelConfig.compile) asks for it and the model qualifies."""
        self.compiled = build_compiled_stack(self, mode)

    def linears(self) -> dict[str, Linear]:
        """Every linear layer by name (lm_head included): for benchmarks and tests."""
        named = {"lm_head": self.lm_head}
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            named.update({f"layers.{i}.{name}": linear for name, linear in layer.linears().items()})
        return named

    def weight_bytes(self) -> int:
        """Bytes of linear-layer weights one decode step reads (each storage once)."""
        seen: dict[int, int] = {}
        for linear in self.linears().values():
            seen[linear.storage[0].data_ptr()] = linear.nbytes
        return sum(seen.values())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[LayerKVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final hidden states [T, hidden]."""
        x = self.embed(input_ids)
        if self.native_stack is not None:
            hidden = self.native_stack(x, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        if self.compiled is not None:
            hidden = self.compiled(x, positions, kv_caches, meta)
            if hidden is not None:
                return hidden
        rope_global = self.rope_global.tables(positions)  # gathered once per step, shared by layers
        rope_local = self.rope_local.tables(positions) if self.rope_local is not self.rope_global else rope_global
        for layer, kv in zip(self.layers, kv_caches, strict=True):
            x = layer(x, rope_local if layer.is_sliding else rope_global, self.attn, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] → float32 logits [N, vocab]."""
        logits = self.lm_head(hidden).float()
        cap = self.arch.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


def _require(tensors: Mapping[str, torch.Tensor], name: str) -> str:
    if name not in tensors:
        raise ModelFormatError(f"checkpoint is missing tensor '{name}': the file is incomplete or another architecture")
    return name


def _take(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    return tensors[_require(tensors, name)]
