"""Repacked quantized weights, cached on disk: a second start maps them instead of repacking.

Packing GGUF blocks into the kernels' layout (layers/quant_formats.py) takes tens of seconds for a
1.5B model on 2 cores (Q6_K → q8 goes through gguf's float reference code and back). The first
load in a quantized mode writes every packed linear layer into one file; later loads of the same
model file in the same mode memory-map it, and each layer's tensors are zero-copy views of the map
(pages come in when a forward pass first reads them).

    $TOKENMILL_HOME/repack/<stem>-<path hash>-<mode>-<isa>-<key hash>.safetensors

    key = the model's identity (size, mtime, inode, device of the GGUF file or of every
          *.safetensors file of a directory), QUANT_LAYOUT_VERSION (quant_formats.py), a hash of
          the code that produces packed bytes (quant_formats.py, linear.py, the GGUF loader's row
          conventions), CACHE_FORMAT_VERSION, the quantization mode and the quant kernel's ISA path

A changed key is another entry, so a stale one (file replaced, layout or code changed) is never
read; it is deleted when its replacement is written, as are entries whose model no longer exists.
A cache file that cannot be read or fails a check (truncated, header garbled, a tensor of the
wrong shape or type) is ignored with one warning and rewritten by that load: never a crash.
Entries are validated against the shapes the loader expects, so no kernel reads out of bounds.

File layout: safetensors (8-byte little-endian header length, JSON header, raw tensor bytes), so
any safetensors reader can inspect it. Written and read here: `safetensors.torch.save_file` first
copies every tensor to bytes (a second GB at peak) and `safe_open` copies each tensor it reads.

    header "__metadata__" {"tokenmill": JSON {"key": {...}, "source": path, "entries": {entry: [fmt, ...]}}}
    entry  = "<name>,<name>,...@<method>+<method>"       one linear layer: its checkpoint names and methods
    tensor = "<entry>#<segment>.qs" | ".scale" | ".offset" (q4; q5 from Q5_1, Q5_K) | ".supers"
             | ".high" (q5, q6; iq4: its table)
    order  = every qs first, from a 64-byte aligned data start (aligned as a model's qs sizes are multiples
             of 64), then the float32s

`TOKENMILL_REPACK_CACHE=0` turns the cache off (nothing read or written).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import mmap
import os
import struct
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tokenmill.layers import quant_formats as qf
from tokenmill.models.pull import tokenmill_home

log = logging.getLogger(__name__)

CACHE_ENV = "TOKENMILL_REPACK_CACHE"
CACHE_FORMAT_VERSION = 1
_SUFFIX = ".safetensors"
_DATA_ALIGN = 64
_DTYPES: dict[str, torch.dtype] = {"I8": torch.int8, "U8": torch.uint8, "F16": torch.float16, "F32": torch.float32}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
# The code whose output is the packed bytes: a change to any of them is a new cache key.
_PACKING_SOURCES = ("layers/quant_formats.py", "layers/gguf_quant.py", "layers/linear.py",
                    "models/loading/gguf_weights.py")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def cache_enabled() -> bool:
    return os.environ.get(CACHE_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def cache_dir() -> Path:
    return tokenmill_home() / "repack"


def file_stamp(files: Sequence[Path]) -> list[list[object]]:
    """The identity of the model's files: replaced or touched files give another cache key."""
    stamps: list[list[object]] = []
    for path in files:
        stat = path.stat()
        stamps.append([path.name, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev])
    return stamps


def _code_hash() -> str:
    digest = hashlib.sha256()
    for relative in _PACKING_SOURCES:
        path = _PACKAGE_ROOT / relative
        digest.update(relative.encode())
        digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()[:16]


class RepackCaches:
    """The repack caches of one model (GGUF file or safetensors directory), one per quantization mode,
    opened on first use. Created by the loader; `flush()` once the model holds its layers."""

    def __init__(self, source: Path, files: Sequence[Path], shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.source = source.resolve()
        self.files = [f.resolve() for f in files]
        self.shapes = shapes
        self._by_mode: dict[str, RepackCache | None] = {}

    def for_mode(self, quantization: str) -> RepackCache | None:
        if quantization not in self._by_mode:
            self._by_mode[quantization] = self._open(quantization)
        return self._by_mode[quantization]

    def _open(self, quantization: str) -> RepackCache | None:
        from tokenmill.kernels import quant_isa

        try:
            key = {"format": CACHE_FORMAT_VERSION, "layout": qf.QUANT_LAYOUT_VERSION, "code": _code_hash(),
                   "mode": quantization, "isa": quant_isa(), "files": file_stamp(self.files)}
        except OSError as err:  # the model file vanished under us: no cache, the load itself will say more
            log.warning("repack cache off for %s: %s", self.source, err)
            return None
        path = cache_dir() / f"{self.prefix(quantization, str(key['isa']))}-{_hash_json(key)}{_SUFFIX}"
        return RepackCache(path, key, self.source, self.shapes)

    def prefix(self, quantization: str, isa: str) -> str:
        """What entries of this model, mode and ISA share: an older one with this prefix is stale."""
        path_hash = hashlib.sha256(str(self.source).encode()).hexdigest()[:12]
        stem = self.source.name if self.source.is_dir() else self.source.stem
        return f"{stem}-{path_hash}-{quantization}-{isa}"

    def flush(self) -> None:
        for cache in self._by_mode.values():
            if cache is not None:
                cache.flush()


class RepackCache:
    """One cache file: packed segments of linear layers by (checkpoint names, methods)."""

    def __init__(self, path: Path, key: Mapping[str, Any], source: Path, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self.path = path
        self.key = dict(key)
        self.source = source
        self.shapes = shapes
        self._stored: dict[str, tuple[qf.QuantMatrix, ...]] = {}  # from this file (hits) or new
        self._new = 0
        self._tensors, self._entries = self._read()
        self.hits = 0

    # -- reading ---------------------------------------------------------------------------------

    def _read(self) -> tuple[dict[str, torch.Tensor], dict[str, list[str]]]:
        try:
            tensors, metadata = read_safetensors(self.path)
            meta = json.loads(metadata.get("tokenmill", "null"))
            if not isinstance(meta, dict) or meta.get("key") != self.key or not isinstance(meta.get("entries"), dict):
                raise ValueError("its header names another model, mode or version")
            return tensors, meta["entries"]
        except (FileNotFoundError, NotADirectoryError):  # not written yet (or no home to write it to)
            return {}, {}
        except Exception as err:  # any unreadable file is a cache miss, never an error
            self._invalidate(err)
            return {}, {}

    def _invalidate(self, err: Exception) -> None:
        log.warning("repack cache %s is unusable (%s): ignored, the weights are repacked and it is rewritten",
                    self.path, err)
        self._tensors, self._entries = {}, {}

    def load(self, names: Sequence[str], methods: Sequence[str]) -> list[qf.QuantMatrix] | None:
        """The layer's packed segments, or None (not cached). A bad entry invalidates the whole file."""
        entry = entry_name(names, methods)
        formats = self._entries.get(entry)
        if formats is None:
            return None
        try:
            segments = [self._segment(entry, i, fmt, rows, cols)
                        for i, (fmt, rows, cols) in enumerate(_expected_segments(names, methods, self.shapes))]
            if formats != [s.fmt for s in segments]:
                raise ValueError(f"entry {entry!r} has formats {formats}")
        except (KeyError, ValueError) as err:
            self._invalidate(err)
            return None
        self._stored[entry] = tuple(segments)
        self.hits += 1
        return segments

    def _segment(self, entry: str, index: int, fmt: str, rows: int, cols: int) -> qf.QuantMatrix:
        prefix = f"{entry}#{index}."
        if fmt not in qf.PACKED_FORMATS:
            raise ValueError(f"entry {entry!r} names format {fmt!r}")
        quant: qf.QuantFormat = fmt  # checked against PACKED_FORMATS above
        qs_shape, lane_shape = qf.packed_shapes(quant, rows, cols)
        qs = _checked(self._tensors, prefix + "qs", torch.int8 if quant == "q8" else torch.uint8, qs_shape)
        lane_type = self._tensors[prefix + "scale"].dtype
        allowed = _LANE_TYPES[quant]
        if lane_type not in allowed:
            raise ValueError(f"tensor {prefix + 'scale'!r} is {lane_type}, expected one of {allowed} for {quant}")
        scale = _checked(self._tensors, prefix + "scale", lane_type, lane_shape)
        offset = torch.empty(0)
        if quant == "q4" or (quant == "q5" and prefix + "offset" in self._tensors):  # q5: Q5_1's and Q5_K's
            offset = _checked(self._tensors, prefix + "offset", lane_type, lane_shape)
        high = torch.empty(0, dtype=torch.uint8)
        if quant in ("q5", "q6"):
            high = _checked(self._tensors, prefix + "high", torch.uint8, qf.high_shape(rows, cols, quant))
        elif quant == "iq4":  # its int8 table
            high = _checked(self._tensors, prefix + "high", torch.int8, (16,))
        supers = torch.empty(0, dtype=torch.float16)
        if lane_type in (torch.uint8, torch.int8):  # two-level lanes: their fp16 super lanes
            planes = 1 if quant == "q6" else 2
            supers = _checked(self._tensors, prefix + "supers", torch.float16,
                              (planes, lane_shape[0], cols // qf.BLOCK))
        return qf.QuantMatrix(quant, qs, scale, offset, rows, high, supers)

    # -- writing ---------------------------------------------------------------------------------

    def store(self, names: Sequence[str], methods: Sequence[str], segments: Sequence[qf.QuantMatrix]) -> None:
        self._stored[entry_name(names, methods)] = tuple(segments)
        self._new += 1

    def flush(self) -> None:
        """Write every layer this load used, when any was new (best effort: a failed write costs the
        next load a repack, nothing else)."""
        if not self._new:
            return
        tensors: dict[str, torch.Tensor] = {}
        entries: dict[str, list[str]] = {}
        for entry, segments in self._stored.items():
            entries[entry] = [s.fmt for s in segments]
            for i, s in enumerate(segments):
                tensors[f"{entry}#{i}.qs"] = s.qs
                tensors[f"{entry}#{i}.scale"] = s.scale
                if s.offset.numel():
                    tensors[f"{entry}#{i}.offset"] = s.offset
                if s.fmt in ("q5", "q6", "iq4"):
                    tensors[f"{entry}#{i}.high"] = s.high
                if s.supers.numel():
                    tensors[f"{entry}#{i}.supers"] = s.supers
        meta = {"key": self.key, "source": str(self.source), "entries": entries}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors(self.path, tensors, {"tokenmill": json.dumps(meta)})
        except OSError as err:
            log.warning("repack cache %s not written (%s): the next start repacks again", self.path, err)
            return
        self._new = 0
        log.info("repack cache written: %s (%d layers, %.0f MB)", self.path, len(entries),
                 sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6)
        prune(self.path)


def entry_name(names: Sequence[str], methods: Sequence[str]) -> str:
    return ",".join(names) + "@" + "+".join(methods)


def _expected_segments(names: Sequence[str], methods: Sequence[str],
                       shapes: Mapping[str, tuple[int, ...]]) -> list[tuple[str, int, int]]:
    """(fmt, rows, cols) per segment: neighbouring parts of one method fuse (qf.concat's rule)."""
    segments: list[tuple[str, int, int]] = []
    for name, method in zip(names, methods, strict=True):
        rows, cols = shapes[name]
        if segments and segments[-1][0] == method:
            segments[-1] = (method, segments[-1][1] + rows, cols)
        else:
            segments.append((method, rows, cols))
    return segments


# A format's scale lanes: float32, fp16 where GGUF's scales are exact, uint8 (q4/q5 in Q4_K's/Q5_K's two levels),
# int8 (q6).
_LANE_TYPES: dict[str, tuple[torch.dtype, ...]] = {
    "q8": (torch.float32, torch.float16), "q5": (torch.float32, torch.float16, torch.uint8),
    "q4": (torch.float32, torch.float16, torch.uint8), "q6": (torch.int8,), "iq4": (torch.float32, torch.float16),
}


def _checked(tensors: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype,
             shape: tuple[int, ...]) -> torch.Tensor:
    tensor = tensors[name]
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise ValueError(f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)}, expected {dtype} {list(shape)}")
    return tensor


# ---- the file -------------------------------------------------------------------------------------


def read_safetensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Zero-copy tensors over a private memory map, and the header's metadata; ValueError when the
    file is not a well-formed safetensors file of the dtypes written here."""
    with path.open("rb") as handle:
        header, base, size = _read_header(handle)
        buf = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    data_len = size - base
    metadata = header.pop("__metadata__", None) or {}
    tensors: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        dtype = _DTYPES.get(str(info.get("dtype"))) if isinstance(info, dict) else None
        if dtype is None:
            raise ValueError(f"tensor {name!r} has no dtype of {sorted(_DTYPES)}")
        shape = [int(n) for n in info["shape"]]
        start, end = (int(n) for n in info["data_offsets"])
        numel = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= start <= end <= data_len or end - start != numel * dtype.itemsize:
            raise ValueError(f"tensor {name!r} does not fit its bytes {start}..{end} of {data_len}")
        if numel == 0:
            tensors[name] = torch.empty(shape, dtype=dtype)
        else:
            tensors[name] = torch.frombuffer(buf, dtype=dtype, count=numel, offset=base + start).view(shape)
    if hasattr(mmap, "MADV_WILLNEED"):
        buf.madvise(mmap.MADV_WILLNEED)  # read ahead in the background: the first forward pass finds the pages
    return tensors, {str(k): str(v) for k, v in metadata.items()}


def _read_header(handle: BinaryIO) -> tuple[dict[str, Any], int, int]:
    """(header, byte offset of the data, file size)."""
    size = os.fstat(handle.fileno()).st_size
    prefix = handle.read(8)
    if len(prefix) < 8:
        raise ValueError(f"{size} bytes is too short for a header")
    (header_len,) = struct.unpack("<Q", prefix)
    if header_len > size - 8:
        raise ValueError(f"header of {header_len} bytes runs past the end of the {size}-byte file")
    header = json.loads(handle.read(header_len))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + header_len, size


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str]) -> None:
    """Atomically (temporary file, then rename), streaming each tensor's bytes."""
    order = sorted(tensors, key=lambda name: tensors[name].dtype == torch.float32)  # qs first: kernel alignment
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(8 + len(encoded)) % _DATA_ALIGN)  # safetensors allows trailing spaces
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            for name in order:
                _write_tensor(out, tensors[name])
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_tensor(out: BinaryIO, tensor: torch.Tensor) -> None:
    t = tensor.detach().cpu().contiguous()
    if t.numel():
        out.write(t.numpy().data.cast("B"))


def prune(fresh: Path) -> None:
    """Delete stale entries: same model, mode and ISA under another key, or a model that is gone,
    and temporary files of interrupted writes."""
    prefix = fresh.name.rsplit("-", 1)[0] + "-"
    for path in fresh.parent.iterdir():
        if path == fresh:
            continue
        stale = path.name.startswith(prefix) and path.name.endswith(_SUFFIX)
        if not stale and path.name.endswith(_SUFFIX):
            stale = not _source_exists(path)
        if not stale and path.name.startswith(".") and path.name.endswith(".tmp"):
            with contextlib.suppress(OSError):
                stale = _age_s(path) > 3600  # not another process's write in flight
        if stale:
            with contextlib.suppress(OSError):
                path.unlink()


def _source_exists(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            header, _, _ = _read_header(handle)
        source = json.loads(header["__metadata__"]["tokenmill"])["source"]
    except Exception:
        return True  # not ours to judge: leave it
    return isinstance(source, str) and Path(source).exists()


def _age_s(path: Path) -> float:
    return time.time() - path.stat().st_mtime


def _hash_json(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]
