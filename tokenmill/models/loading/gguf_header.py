"""The GGUF header (metadata and tensor infos) parsed straight from a memory map.

`gguf.GGUFReader` decodes every tokenizer string up front (~30 s for Gemma's 262k-token vocabulary on a
busy 2-core machine); this parser skips the string arrays nobody asked for (`UnreadArray`):

    file:  | header: kv metadata, tensor infos | pad to alignment | tensor data ... |
                                                                  ^ data_offset + each tensor's offset
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill.errors import ModelFormatError, ModelNotFoundError

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types (gguf.GGUFValueType) → struct format; 8 is STRING, 9 is ARRAY.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}  # fmt: skip
_FLOAT32, _STRING, _ARRAY = 6, 8, 9


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
