"""GGUF (llama.cpp) files → `Checkpoint` with Hugging Face tensor names and conventions.

The header is parsed here rather than with `gguf.GGUFReader`, which decodes every tokenizer string
up front (~30 s for Gemma's 262k-token vocabulary on a busy 2-core machine); this parser skips
string arrays nobody asked for. Tensor data stays in a private (copy-on-write) memory map:

    file:  | header: kv metadata, tensor infos | pad to alignment | tensor data ... |
                                                                  ^ data_offset + each tensor's offset

Conventions undone, exactly as transformers' GGUF loader does (`modeling_gguf_pytorch_utils.py`):
- llama: convert_hf_to_gguf.py interleaves the two RoPE halves of every q/k head
  (rows (head, 2, dim) → (head, dim, 2)); we permute them back.
- gemma3: norm weights are stored as `1 + w`; we subtract 1.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from tokenmill.errors import ModelFormatError, ModelNotFoundError
from tokenmill.layers.quant_formats import RawBlocks
from tokenmill.models.arch import ArchConfig
from tokenmill.models.loading.repack_cache import RepackCaches, cache_enabled
from tokenmill.models.loading.weights import Checkpoint, LazyTensors, TensorSource, select_tensors

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")
_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.GGUFValueType) → struct format; 8 is STRING, 9 is ARRAY.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_FLOAT32, _STRING, _ARRAY = 6, 8, 9
_T = GGMLQuantizationType
_ZERO_COPY_DTYPES = {_T.F32: torch.float32, _T.F16: torch.float16, _T.BF16: torch.bfloat16}
_DEQUANTIZABLE = {_T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q2_K, _T.Q3_K, _T.Q4_K, _T.Q5_K, _T.Q6_K}

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


@dataclass(frozen=True, slots=True)
class UnreadArray:
    """A string array the caller did not ask to decode (e.g. 262k vocabulary entries)."""

    length: int


@dataclass(frozen=True, slots=True)
class GgufTensorInfo:
    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # row-major, as torch sees it: ggml's `ne` reversed
    offset: int  # absolute byte offset of the data in the file
    num_bytes: int


@dataclass(frozen=True, slots=True)
class GgufHeader:
    metadata: dict[str, object]  # numeric arrays are numpy arrays; skipped string arrays UnreadArray
    tensors: dict[str, GgufTensorInfo]
    buffer: mmap.mmap  # private copy-on-write map: writes never reach the file


class _Cursor:
    """Little-endian reads from the map; reading past the end raises struct.error."""

    __slots__ = ("buf", "pos")

    def __init__(self, buf: mmap.mmap, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def count(self) -> int:
        return int(self.scalar("<Q"))

    def string(self) -> str:
        size = self.count()
        raw = self.buf[self.pos : self.pos + size]
        if len(raw) != size:
            raise struct.error("string runs past the end of the file")
        self.pos += size
        return raw.decode("utf-8")

    def items(self, num_items: int, min_item_bytes: int) -> range:
        """Loop bounds for `num_items` records, refused when they could not fit in what is left:
        a corrupt count must fail, not spin for 2**60 iterations."""
        if num_items * min_item_bytes > len(self.buf) - self.pos:
            raise struct.error(f"{num_items} records run past the end of the file")
        return range(num_items)

    def skip_strings(self, num_strings: int) -> None:
        for _ in self.items(num_strings, 8):
            size = self.count()  # not `pos += count()`: that adds to the pos read before count() moved it
            self.pos += size  # overrunning the end fails at the next read


def read_gguf_header(path: Path, string_arrays: Collection[str] = ()) -> GgufHeader:
    """Parse metadata and tensor infos; string arrays are decoded only when named in `string_arrays`."""
    buf = _map_file(path)
    try:
        return _parse(buf, frozenset(string_arrays))
    except (struct.error, ValueError, OverflowError, KeyError) as err:  # UnicodeDecodeError is a ValueError
        raise ModelFormatError(f"{path}: corrupt or truncated GGUF file ({err}); re-download it") from err


def _map_file(path: Path) -> mmap.mmap:
    if not path.is_file():
        raise ModelNotFoundError(f"{path}: no such GGUF file")
    with path.open("rb") as handle:
        if handle.read(4) != _GGUF_MAGIC:
            raise ModelFormatError(f"{path}: not a GGUF file (bad magic); pass a llama.cpp .gguf file")
        return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)


def _parse(buf: mmap.mmap, string_arrays: frozenset[str]) -> GgufHeader:
    cursor = _Cursor(buf, pos=len(_GGUF_MAGIC))
    version = cursor.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"unsupported GGUF version {version} (big-endian files are not supported)")
    num_tensors, num_kv = cursor.count(), cursor.count()
    metadata = {}
    for _ in cursor.items(num_kv, 12):
        key = cursor.string()
        metadata[key] = _read_value(cursor, int(cursor.scalar("<I")), key in string_arrays)
    raw_infos = [_read_tensor_info(cursor) for _ in cursor.items(num_tensors, 24)]
    alignment = _alignment(metadata)
    data_offset = -(-cursor.pos // alignment) * alignment
    tensors = {info.name: _place(info, data_offset, len(buf)) for info in raw_infos}
    return GgufHeader(metadata, tensors, buf)


def _alignment(metadata: Mapping[str, object]) -> int:
    alignment = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    return alignment


def _read_value(cursor: _Cursor, value_type: int, decode_strings: bool) -> object:
    if value_type == _STRING:
        return cursor.string()
    if value_type == _FLOAT32:
        # The shortest decimal that is this float32, so 1e-6 reads back as 1e-6, as in config.json.
        return float(str(np.float32(cursor.scalar("<f"))))
    if value_type != _ARRAY:
        return cursor.scalar(_SCALAR_FORMATS[value_type])
    item_type, length = int(cursor.scalar("<I")), cursor.count()
    if item_type == _STRING:
        if decode_strings:
            return [cursor.string() for _ in cursor.items(length, 8)]
        cursor.skip_strings(length)
        return UnreadArray(length)
    dtype = np.dtype(_SCALAR_FORMATS[item_type])
    values = np.frombuffer(cursor.buf, dtype=dtype, count=length, offset=cursor.pos).copy()
    cursor.pos += dtype.itemsize * length
    return values


def _read_tensor_info(cursor: _Cursor) -> GgufTensorInfo:
    name = cursor.string()
    num_dims = int(cursor.scalar("<I"))
    ne = [cursor.count() for _ in cursor.items(num_dims, 8)]
    ggml_type = GGMLQuantizationType(cursor.scalar("<I"))
    block_size, block_bytes = GGML_QUANT_SIZES[ggml_type]
    if ne and ne[0] % block_size:
        raise ValueError(f"tensor {name!r} rows of {ne[0]} do not split into {ggml_type.name} blocks")
    num_bytes = math.prod(ne) // block_size * block_bytes
    return GgufTensorInfo(name, ggml_type, tuple(reversed(ne)), cursor.count(), num_bytes)


def _place(info: GgufTensorInfo, data_offset: int, file_bytes: int) -> GgufTensorInfo:
    start = data_offset + info.offset
    if start + info.num_bytes > file_bytes:
        raise ValueError(f"tensor {info.name!r} ends at byte {start + info.num_bytes} of {file_bytes}")
    return GgufTensorInfo(info.name, info.ggml_type, info.shape, start, info.num_bytes)


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
            "use a file quantized with Q4_K_M, Q5_K_M or Q8_0"
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
