"""The architecture description every loader produces and every model class consumes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ArchConfig:
    """Shapes and numerics of one decoder-only transformer, independent of the file format.

    Weight tensors travel next to it with Hugging Face names and conventions (e.g.
    `model.layers.0.self_attn.q_proj.weight`, Gemma norms stored as `w` and applied as `1 + w`),
    so a GGUF file and a safetensors directory of the same model yield the same tensors.
    """

    architecture: str  # "llama" (Llama, SmolLM2, Mistral), "qwen2" or "gemma3"
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # Qwen2: q/k/v carry biases
    hidden_act: str = "silu"  # "silu" or "gelu_pytorch_tanh"
    # Gemma 3: local (sliding-window) layers attend to the last `sliding_window` positions
    # and use their own RoPE base; `layer_is_sliding[i]` says which kind layer i is.
    sliding_window: int | None = None
    layer_is_sliding: tuple[bool, ...] = ()
    rope_local_theta: float | None = None
    rope_scaling_factor: float | None = None  # linear RoPE scaling on global layers
    query_pre_attn_scalar: float | None = None  # softmax scale = this ** -0.5 when set
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def is_sliding_layer(self, layer_idx: int) -> bool:
        return bool(self.layer_is_sliding) and self.layer_is_sliding[layer_idx]
