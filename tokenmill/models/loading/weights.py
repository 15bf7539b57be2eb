"""Model files → `Checkpoint`: an `ArchConfig` plus tensors under Hugging Face names and conventions.

Both formats produce the same contract, so a model class never knows which file it came from:

    model.embed_tokens.weight                                  (vocab, hidden)
    model.layers.{i}.self_attn.{q,k,v,o}_proj.{weight,bias}   (bias: q/k/v only, when attention_bias)
    model.layers.{i}.self_attn.{q,k}_norm.weight              (gemma3)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight
    model.layers.{i}.{input,post_attention}_layernorm.weight
    model.layers.{i}.{pre,post}_feedforward_layernorm.weight  (gemma3)
    model.norm.weight
    lm_head.weight                                             (absent when tie_word_embeddings)

Gemma norm weights are `w` (applied as `1 + w`) and Llama q/k rows are in Hugging Face's
half-split RoPE order, whatever the file stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch

from tokenmill.errors import ModelFormatError
from tokenmill.layers.quant_formats import RawBlocks
from tokenmill.models.arch import ArchConfig

if TYPE_CHECKING:
    from tokenmill.models.loading.repack_cache import RepackCache, RepackCaches

WeightFormat = Literal["gguf", "hf"]


@dataclass(frozen=True, slots=True)
class TensorSource:
    """Where one tensor comes from: its shape is known up front, its data is produced on demand."""

    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]
    # The stored quantized blocks (GGUF), rows already in Hugging Face order; None for float tensors.
    raw: Callable[[], RawBlocks] | None = None


class LazyTensors(Mapping[str, torch.Tensor]):
    """Named tensors produced on access.

    Nothing is cached: each `[name]` reads (and for quantized GGUF types, dequantizes) again, so a
    consumer that casts or copies each tensor and drops it never holds two copies. Float tensors
    stored unquantized come back as zero-copy views of the memory-mapped file, in their stored
    dtype (float32, float16 or bfloat16); dequantized ones are float32. Consumers cast.
    """

    __slots__ = ("_release", "_repack", "_sources")

    def __init__(self, sources: Mapping[str, TensorSource], release: Callable[[], None] | None = None,
                 repack: RepackCaches | None = None) -> None:
        self._sources = dict(sources)
        self._release = release
        self._repack = repack

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._sources[name].load()

    def __contains__(self, name: object) -> bool:
        # Mapping's default tries `self[name]`, which here reads (and dequantizes) the whole tensor:
        # `name in tensors` checks cost 35 s of a Qwen2.5-1.5B load before this.
        return name in self._sources

    def __iter__(self) -> Iterator[str]:
        return iter(self._sources)

    def __len__(self) -> int:
        return len(self._sources)

    def sources(self) -> Mapping[str, TensorSource]:
        return self._sources

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self._sources[name].shape

    def release_pages(self) -> None:
        """The consumer has built its own copies: write the repack cache when layers were packed, and
        let the OS drop the file pages read so far (GGUF: they stay mapped and fault back in on
        access, e.g. embedding rows read from the map)."""
        if self._repack is not None:
            self._repack.flush()
        if self._release is not None:
            self._release()

    def repack_cache(self, quantization: str) -> RepackCache | None:
        """The on-disk cache of packed layers for this mode (layers/linear.py asks), or None when off."""
        return None if self._repack is None else self._repack.for_mode(quantization)

    def quantized(self, name: str) -> RawBlocks | None:
        """The tensor's stored quantized blocks, without dequantizing (None when stored as floats)."""
        raw = self._sources[name].raw
        return None if raw is None else raw()


@dataclass(slots=True)
class Checkpoint:
    arch: ArchConfig
    tensors: LazyTensors


def load_checkpoint(path: Path, fmt: WeightFormat) -> Checkpoint:
    """Read a GGUF file or a Hugging Face directory; raises `ModelFormatError` for unusable input."""
    # Imported here: both loaders import `Checkpoint` from this module.
    if fmt == "gguf":
        from tokenmill.models.loading.gguf_weights import load_gguf

        return load_gguf(Path(path))
    if fmt == "hf":
        from tokenmill.models.loading.hf_weights import load_hf

        return load_hf(Path(path))
    raise ModelFormatError(f"unknown weight format {fmt!r}: use 'gguf' or 'hf'")


def expected_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a model of this architecture needs, with its shape."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, arch.hidden_size),
        "model.norm.weight": (arch.hidden_size,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, arch.hidden_size)
    for layer_idx in range(arch.num_layers):
        prefix = f"model.layers.{layer_idx}."
        shapes.update({prefix + name: shape for name, shape in _layer_shapes(arch).items()})
    return shapes


def _layer_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    hidden, ffn = arch.hidden_size, arch.intermediate_size
    q_dim, kv_dim = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "self_attn.q_proj.weight": (q_dim, hidden),
        "self_attn.k_proj.weight": (kv_dim, hidden),
        "self_attn.v_proj.weight": (kv_dim, hidden),
        "self_attn.o_proj.weight": (hidden, q_dim),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    if arch.attention_bias:
        shapes.update({"self_attn.q_proj.bias": (q_dim,), "self_attn.k_proj.bias": (kv_dim,)})
        shapes["self_attn.v_proj.bias"] = (kv_dim,)
    if arch.architecture == "gemma3":
        for name in ("self_attn.q_norm", "self_attn.k_norm"):
            shapes[f"{name}.weight"] = (arch.head_dim,)
        for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            shapes[f"{name}.weight"] = (hidden,)
    return shapes


def select_tensors(arch: ArchConfig, sources: Mapping[str, TensorSource], path: Path) -> LazyTensors:
    """Keep exactly the tensors the architecture needs, after checking each exists with its shape.

    Extra tensors (a tied `lm_head`, rotary caches, vision towers) are dropped.
    """
    for name, shape in expected_shapes(arch).items():
        source = sources.get(name)
        if source is None:
            raise ModelFormatError(f"{path}: tensor {name!r} is missing; the file is incomplete, re-export it")
        if source.shape != shape:
            raise ModelFormatError(
                f"{path}: tensor {name!r} has shape {list(source.shape)}, expected {list(shape)} "
                "from the model's metadata; the file is inconsistent, re-convert it"
            )
    return LazyTensors({name: sources[name] for name in expected_shapes(arch)})
