"""Hugging Face model directories (config.json + *.safetensors) → `Checkpoint`.

Tensors are already in Hugging Face names and conventions; safetensors files are memory-mapped
through `safe_open`, and each tensor is read only when the consumer asks for it.
Both config generations are accepted: transformers 5 `rope_parameters` (per layer type for
Gemma 3) and the older `rope_theta` / `rope_local_base_freq` / `rope_scaling` keys.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import partial
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from tokenmill.errors import ModelFormatError, ModelNotFoundError
from tokenmill.models.arch import ArchConfig
from tokenmill.models.loading.repack_cache import RepackCaches, cache_enabled
from tokenmill.models.loading.weights import Checkpoint, LazyTensors, TensorSource, select_tensors

_ARCHITECTURE_BY_CLASS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}
_ARCHITECTURE_BY_MODEL_TYPE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}
_ARCHITECTURE_BY_MODEL_TYPE |= {"gemma3": "gemma3", "gemma3_text": "gemma3"}
# The transformers config classes' defaults, for keys a config.json leaves out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "tie_word_embeddings": False, "rope_theta": 10000.0},
    "qwen2": {"max_position_embeddings": 32768, "tie_word_embeddings": False, "rope_theta": 10000.0},
    "gemma3": {"max_position_embeddings": 131072, "tie_word_embeddings": True, "rope_theta": 1_000_000.0},
}
_GEMMA3_LOCAL_THETA = 10000.0
_GEMMA3_SLIDING_WINDOW_PATTERN = 6


def load_hf(path: Path) -> Checkpoint:
    config = _read_config(path)
    sources = _safetensors_sources(path)
    arch = hf_arch_config(config, has_qkv_bias="model.layers.0.self_attn.q_proj.bias" in sources, path=path)
    tensors = select_tensors(arch, sources, path)
    if not cache_enabled():
        return Checkpoint(arch, tensors)
    # q8/q4 modes quantize these float weights at load: the same repack cache as GGUF files.
    selected = dict(tensors.sources())
    repack = RepackCaches(path, sorted(path.glob("*.safetensors")), {n: s.shape for n, s in selected.items()})
    return Checkpoint(arch, LazyTensors(selected, None, repack))


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise ModelNotFoundError(f"{path}: not a directory; pass a Hugging Face model directory")
    config = _read_json(path / "config.json", required=True)
    generation = _read_json(path / "generation_config.json", required=False)
    # Multimodal Gemma 3 nests the language model's config; the text model is all we run.
    merged = {**config, **config.get("text_config", {})}
    merged["_generation_eos_token_id"] = generation.get("eos_token_id")
    return merged


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelFormatError(f"{path}: missing; a Hugging Face model directory needs config.json")
        return {}
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ModelFormatError(f"{path}: not valid JSON ({err}); re-download the model") from err
    if not isinstance(loaded, dict):
        raise ModelFormatError(f"{path}: expected a JSON object; re-download the model")
    return loaded


# ---- config.json → ArchConfig ----------------------------------------------------------------


def hf_arch_config(config: Mapping[str, Any], has_qkv_bias: bool, path: Path) -> ArchConfig:
    arch = _architecture(config, path)
    get = partial(_get, config, _DEFAULTS[arch], path)
    if config.get("mlp_bias"):
        raise ModelFormatError(f"{path}: MLP biases (mlp_bias=true) are not supported")
    hidden, num_heads = int(get("hidden_size")), int(get("num_attention_heads"))
    return ArchConfig(
        architecture=arch,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        num_layers=int(get("num_hidden_layers")),
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden // num_heads),
        intermediate_size=int(get("intermediate_size")),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config, "full_attention", float(get("rope_theta"))),
        max_position_embeddings=int(get("max_position_embeddings")),
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        attention_bias=has_qkv_bias,
        hidden_act=str(config.get("hidden_activation") or config.get("hidden_act") or "silu"),
        rope_scaling_factor=_rope_scaling_factor(config, path),
        bos_token_id=config.get("bos_token_id"),
        eos_token_ids=_eos_token_ids(config),
        **(_gemma3_fields(config) if arch == "gemma3" else {}),
    )


def _architecture(config: Mapping[str, Any], path: Path) -> str:
    for class_name in config.get("architectures") or ():
        if class_name in _ARCHITECTURE_BY_CLASS:
            return _ARCHITECTURE_BY_CLASS[class_name]
    model_type = config.get("model_type")
    if model_type in _ARCHITECTURE_BY_MODEL_TYPE:
        return _ARCHITECTURE_BY_MODEL_TYPE[model_type]
    raise ModelFormatError(
        f"{path}: unsupported architecture {config.get('architectures') or model_type!r}; "
        "tokenmill runs Llama, Qwen2 and Gemma 3 models"
    )


def _get(config: Mapping[str, Any], defaults: Mapping[str, Any], path: Path, key: str) -> Any:
    value = config.get(key, defaults.get(key))
    if value is None:
        raise ModelFormatError(f"{path}/config.json: {key!r} is missing; re-download the model")
    return value


def _rope_params(config: Mapping[str, Any], layer_type: str) -> Mapping[str, Any]:
    """RoPE settings of one layer type; `{}` when the config uses the older flat keys."""
    params = config.get("rope_parameters") or {}
    if layer_type in params:
        return params[layer_type] or {}
    return params if "rope_type" in params or "rope_theta" in params else {}


def _rope_theta(config: Mapping[str, Any], layer_type: str, legacy: float) -> float:
    return float(_rope_params(config, layer_type).get("rope_theta", legacy))


def _rope_scaling_factor(config: Mapping[str, Any], path: Path) -> float | None:
    # Only global layers scale (Gemma 3 local layers never do); transformers 4 used `type`.
    params = _rope_params(config, "full_attention") or config.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "linear":
        raise ModelFormatError(f"{path}/config.json: RoPE scaling {kind!r} is not supported (only linear)")
    return float(params["factor"])


def _eos_token_ids(config: Mapping[str, Any]) -> tuple[int, ...]:
    # generation_config.json often lists more stop tokens (e.g. end-of-turn) than config.json.
    ids: list[int] = []
    for value in (config.get("eos_token_id"), config.get("_generation_eos_token_id")):
        ids.extend([value] if isinstance(value, int) else value or [])
    return tuple(dict.fromkeys(ids))


def _gemma3_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    num_layers = int(config["num_hidden_layers"])
    local_theta = float(config.get("rope_local_base_freq", _GEMMA3_LOCAL_THETA))
    return {
        "sliding_window": config.get("sliding_window", 4096),
        "layer_is_sliding": _sliding_layers(config, num_layers),
        "rope_local_theta": _rope_theta(config, "sliding_attention", local_theta),
        "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
        "final_logit_softcapping": config.get("final_logit_softcapping"),
        "attn_logit_softcapping": config.get("attn_logit_softcapping"),
    }


def _sliding_layers(config: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    layer_types = config.get("layer_types")
    if layer_types:
        return tuple(layer_type == "sliding_attention" for layer_type in layer_types)
    pattern = int(config.get("sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN))
    return tuple((layer_idx + 1) % pattern != 0 for layer_idx in range(num_layers))


# ---- safetensors ------------------------------------------------------------------------------


def _safetensors_sources(path: Path) -> dict[str, TensorSource]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelFormatError(f"{path}: no *.safetensors files; export the model with save_pretrained")
    sources: dict[str, TensorSource] = {}
    for file in files:
        sources.update(_file_sources(file))
    return sources


def _file_sources(file: Path) -> dict[str, TensorSource]:
    try:
        handle = safe_open(str(file), framework="pt")
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelFormatError(f"{file}: corrupt or truncated safetensors file ({err}); re-download it") from err
    # The partial keeps `handle` (and its memory map) alive as long as the tensors are reachable.
    return {
        text_model_name(name): TensorSource(shape, partial(handle.get_tensor, name)) for name, shape in shapes.items()
    }


def text_model_name(name: str) -> str:
    """Multimodal checkpoints nest the language model: `language_model.model.x` (transformers 4)
    or `model.language_model.x` (transformers 5) → `model.x`."""
    name = name.removeprefix("language_model.")
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name
