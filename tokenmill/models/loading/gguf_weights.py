"""GGUF (llama.cpp) files → `Checkpoint` with Hugging Face tensor names and conventions.

The header comes from gguf_header.py (a parser that skips the string arrays nobody asked for). Tensor
data stays in a private (copy-on-write) memory map, at data_offset + each tensor's offset.

Conventions undone, exactly as transformers' GGUF loader does (`modeling_gguf_pytorch_utils.py`):
- llama: convert_hf_to_gguf.py interleaves the two RoPE halves of every q/k head
  (rows (head, 2, dim) → (head, dim, 2)); we permute them back.
- gemma3: norm weights are stored as `1 + w`; we subtract 1.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from tokenmill.errors import ModelFormatError
from tokenmill.layers.quant_formats import RawBlocks
from tokenmill.models.arch import ArchConfig
from tokenmill.models.loading.gguf_header import GgufHeader, GgufTensorInfo, read_gguf_header
from tokenmill.models.loading.repack_cache import RepackCaches, cache_enabled
from tokenmill.models.loading.weights import Checkpoint, LazyTensors, TensorSource, select_tensors

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
_T = GGMLQuantizationType
_ZERO_COPY_DTYPES = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}
_DEQUANTIZABLE = {_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K,
                  _T.IQ4_NL, _T.IQ4_XS}

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}  # fmt: skip
# `ffn_norm` is the norm before the MLP: post_attention_layernorm in Llama/Qwen2, but Gemma 3 has a
# separate post-attention norm and calls the pre-MLP one pre_feedforward_layernorm.
_FFN_NORM_NAMES = {"llama": "post_attention_layernorm", "qwen2": "post_attention_layernorm"}
_FFN_NORM_NAMES["gemma3"] = "pre_feedforward_layernorm"


# ---- metadata → ArchConfig -------------------------------------------------------------------


class _Keys:
    """Typed access to `<arch>.*` keys, failing with a ModelFormatError that names the key."""

    __slots__ = ("arch", "metadata", "path")

    def __init__(self, metadata: Mapping[str, object], arch: str, path: Path) -> None:
        self.metadata, self.arch, self.path = metadata, arch, path

    def number(self, key: str) -> float | None:
        full_key = key if key.startswith(("tokenizer.", "general.")) else f"{self.arch}.{key}"
        value = self.metadata.get(full_key)
        if value is not None and not isinstance(value, int | float):
            raise ModelFormatError(f"{self.path}: metadata {full_key!r} is not a number; re-convert the file")
        return value

    def real(self, key: str, default: float) -> float:
        value = self.number(key)
        return default if value is None else float(value)

    def optional_int(self, key: str) -> int | None:
        value = self.number(key)
        return None if value is None else int(value)

    def required(self, key: str) -> int:
        value = self.optional_int(key)
        if value is None or value <= 0:
            message = f"metadata '{self.arch}.{key}' is missing or not positive"
            raise ModelFormatError(f"{self.path}: {message}; re-convert with llama.cpp's convert_hf_to_gguf.py")
        return value


def gguf_arch_config(header: GgufHeader, path: Path) -> ArchConfig:
    arch = _architecture(header.metadata, path)
    keys = _Keys(header.metadata, arch, path)
    hidden, num_heads = keys.required("embedding_length"), keys.required("attention.head_count")
    head_dim = keys.optional_int("attention.key_length") or keys.optional_int("rope.dimension_count")
    config = ArchConfig(
        architecture=arch,
        vocab_size=_embedding_rows(header, path),
        hidden_size=hidden,
        num_layers=keys.required("block_count"),
        num_heads=num_heads,
        num_kv_heads=keys.optional_int("attention.head_count_kv") or num_heads,
        head_dim=head_dim or hidden // num_heads,
        intermediate_size=keys.required("feed_forward_length"),
        rms_norm_eps=keys.real("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=keys.real("rope.freq_base", 10000.0),
        max_position_embeddings=keys.required("context_length"),
        tie_word_embeddings="output.weight" not in header.tensors,
        attention_bias="blk.0.attn_q.bias" in header.tensors,
        rope_scaling_factor=_rope_scaling_factor(keys),
        bos_token_id=keys.optional_int("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_eos_token_ids(keys),
    )
    return _with_gemma3_fields(config, keys) if arch == "gemma3" else config


def _architecture(metadata: Mapping[str, object], path: Path) -> str:
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(
            f"{path}: unsupported architecture {arch!r}; tokenmill runs {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(arch)


def _embedding_rows(header: GgufHeader, path: Path) -> int:
    # The embedding, not `<arch>.vocab_size` (absent for gemma3), is what the weights were sized for.
    if "token_embd.weight" not in header.tensors:
        raise ModelFormatError(f"{path}: tensor 'token_embd.weight' is missing; the file is incomplete")
    return header.tensors["token_embd.weight"].shape[0]


def _rope_scaling_factor(keys: _Keys) -> float | None:
    kind = keys.metadata.get(f"{keys.arch}.rope.scaling.type", "none")
    if kind not in ("none", "linear"):
        raise ModelFormatError(f"{keys.path}: RoPE scaling {kind!r} is not supported (only linear)")
    return keys.real("rope.scaling.factor", 1.0) if kind == "linear" else None


def _eos_token_ids(keys: _Keys) -> tuple[int, ...]:
    # llama.cpp stops on any end-of-generation token: eos, and end-of-turn/-message when present.
    names = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [keys.optional_int(f"tokenizer.ggml.{name}") for name in names]
    return tuple(dict.fromkeys(token_id for token_id in ids if token_id is not None))


def _with_gemma3_fields(config: ArchConfig, keys: _Keys) -> ArchConfig:
    window = keys.optional_int("attention.sliding_window")
    return replace(
        config,
        hidden_act="gelu_pytorch_tanh",
        sliding_window=window,
        layer_is_sliding=_sliding_layers(keys, config.num_layers) if window else (),
        # llama.cpp hard-codes 10000 for local layers; newer files may state it.
        rope_local_theta=keys.real("rope.freq_base_swa", 10000.0),
        query_pre_attn_scalar=_query_pre_attn_scalar(config),
        final_logit_softcapping=keys.number("final_logit_softcapping"),
        attn_logit_softcapping=keys.number("attn_logit_softcapping"),
    )


def _sliding_layers(keys: _Keys, num_layers: int) -> tuple[bool, ...]:
    # llama.cpp: every 6th layer is global unless the file states a pattern (an int period or a
    # per-layer bool array, True = sliding); the same rule as transformers' sliding_window_pattern.
    pattern = keys.metadata.get(f"{keys.arch}.attention.sliding_window_pattern")
    if isinstance(pattern, np.ndarray):
        return tuple(bool(is_sliding) for is_sliding in pattern)
    period = keys.required("attention.sliding_window_pattern") if pattern is not None else 6
    return tuple((layer_idx + 1) % period != 0 for layer_idx in range(num_layers))


def _query_pre_attn_scalar(config: ArchConfig) -> float:
    # llama.cpp scales by head_dim, except Gemma 3 27B (62 layers), whose HF config says hidden/heads.
    if config.num_layers == 62:
        return config.hidden_size / config.num_heads
    return float(config.head_dim)


# ---- tensors --------------------------------------------------------------------------------


def hf_tensor_name(arch: str, gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` → `model.layers.3.self_attn.q_proj.weight`; None for tensors we ignore."""
    base, _, suffix = gguf_name.rpartition(".")
    if not base.startswith("blk."):
        mapped = _GLOBAL_NAMES.get(base)
        return f"{mapped}.{suffix}" if mapped else None
    _, layer_idx, part = base.split(".", 2)
    mapped = _FFN_NORM_NAMES[arch] if part == "ffn_norm" else _LAYER_NAMES.get(part)
    return f"model.layers.{layer_idx}.{mapped}.{suffix}" if mapped else None


def _tensor_sources(header: GgufHeader, arch: ArchConfig, path: Path) -> dict[str, TensorSource]:
    sources = {}
    for info in header.tensors.values():
        name = hf_tensor_name(arch.architecture, info.name)
        if name is None:
            continue
        _check_type(info, path)
        load: Callable[[], torch.Tensor] = partial(_read_tensor, header.buffer, info)
        undo = _convention_undo(arch, name)
        raw = None
        if info.ggml_type not in _ZERO_COPY_DTYPES and len(info.shape) == 2:
            raw = partial(_read_blocks, header.buffer, info, _row_permutation(arch, name))
        sources[name] = TensorSource(info.shape, load if undo is None else partial(_compose, undo, load), raw)
    return sources


def _check_type(info: GgufTensorInfo, path: Path) -> None:
    if info.ggml_type not in _ZERO_COPY_DTYPES and info.ggml_type not in _DEQUANTIZABLE:
        raise ModelFormatError(
            f"{path}: tensor {info.name!r} is {info.ggml_type.name}, which tokenmill cannot dequantize; "
            "use a file quantized with Q3_K_M, IQ4_XS, Q4_K_M, Q5_K_M, Q6_K or Q8_0"
        )


def _read_tensor(buffer: mmap.mmap, info: GgufTensorInfo) -> torch.Tensor:
    dtype = _ZERO_COPY_DTYPES.get(info.ggml_type)
    if dtype is not None:
        flat = torch.frombuffer(buffer, dtype=dtype, count=math.prod(info.shape), offset=info.offset)
        return flat.view(info.shape)
    blocks = np.frombuffer(buffer, dtype=np.uint8, count=info.num_bytes, offset=info.offset)
    blocks = blocks.reshape(quant_shape_to_byte_shape(info.shape, info.ggml_type))
    return torch.from_numpy(dequantize(blocks, info.ggml_type))


def _read_blocks(buffer: mmap.mmap, info: GgufTensorInfo,
                 permute: Callable[[torch.Tensor], torch.Tensor] | None) -> RawBlocks:
    """The stored blocks as uint8 [rows, row_bytes]: a view of the map, or a permuted copy. Rows are
    independent in every block format, so a row permutation (RoPE un-interleave) moves whole rows."""
    rows, cols = info.shape
    blocks = np.frombuffer(buffer, dtype=np.uint8, count=info.num_bytes, offset=info.offset).reshape(rows, -1)
    if permute is not None:
        blocks = permute(torch.from_numpy(blocks)).numpy()
    return RawBlocks(info.ggml_type, (rows, cols), blocks)


def _row_permutation(arch: ArchConfig, hf_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    undo = _convention_undo(arch, hf_name)
    return None if undo is None or undo is _undo_gemma_norm_shift else undo


def _compose(undo: Callable[[torch.Tensor], torch.Tensor], load: Callable[[], torch.Tensor]) -> torch.Tensor:
    return undo(load())


def _convention_undo(arch: ArchConfig, hf_name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
    if arch.architecture == "gemma3" and hf_name.endswith("norm.weight"):
        return _undo_gemma_norm_shift
    if arch.architecture == "llama" and ".self_attn.q_proj." in hf_name:
        return partial(_undo_rope_interleave, num_heads=arch.num_heads)
    if arch.architecture == "llama" and ".self_attn.k_proj." in hf_name:
        return partial(_undo_rope_interleave, num_heads=arch.num_kv_heads)
    return None


def _undo_gemma_norm_shift(stored: torch.Tensor) -> torch.Tensor:
    # GGUF holds 1 + w; Hugging Face holds w and computes x * (1 + w). Float32 keeps w exact enough.
    return stored.float() - 1.0


def _undo_rope_interleave(stored: torch.Tensor, num_heads: int) -> torch.Tensor:
    # Rows of each head: GGUF (dim, 2) pairs [x0 y0 x1 y1 ...] ← HF (2, dim) halves [x0 x1 ... y0 y1 ...].
    half_dim = stored.shape[0] // num_heads // 2
    rows = stored.reshape(num_heads, half_dim, 2, *stored.shape[1:])
    return rows.transpose(1, 2).reshape(stored.shape)


def load_gguf(path: Path) -> Checkpoint:
    header = read_gguf_header(path)
    arch = gguf_arch_config(header, path)
    if "rope_freqs.weight" in header.tensors:
        raise ModelFormatError(f"{path}: Llama-3-style RoPE frequency scaling is not supported")
    tensors = select_tensors(arch, _tensor_sources(header, arch, path), path)
    sources = dict(tensors.sources())
    repack = RepackCaches(path, [path], {n: s.shape for n, s in sources.items()}) if cache_enabled() else None
    return Checkpoint(arch, LazyTensors(sources, partial(_drop_pages, header.buffer), repack))


def _drop_pages(buffer: mmap.mmap) -> None:
    # The map is private and never written, so dropped pages re-read the file on the next access:
    # after the model packed its weights, resident memory stops counting the file a second time.
    if hasattr(mmap, "MADV_DONTNEED"):
        buffer.madvise(mmap.MADV_DONTNEED)
