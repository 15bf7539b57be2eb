"""The on-disk repack cache (models/loading/repack_cache.py) on tiny GGUF files built here.

A warm load must give the very logits of a load that packs (bit for bit: the same packed bytes),
without packing anything; a changed file or layout version must never be read; and a damaged
cache file must cost one warning and a repack, never a crash or a wrong answer.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

import tests.fixtures.tiny_models as tiny
from tests.fixtures.engine_logits import engine_prompt_logits
from tokenmill import LLM
from tokenmill.kernels import quant_kernels
from tokenmill.layers import gguf_quant, quant_formats
from tokenmill.layers.linear import QuantLinear
from tokenmill.layers.weight_arena import HUGE_PAGES_ENV
from tokenmill.models.loading import repack_cache

T = GGMLQuantizationType
pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="native quantized kernels cannot be built here")
CACHE_LOGGER = "tokenmill.models.loading.repack_cache"

# 4- and 8-bit GGUF matrices, q/k and v of different widths: fused q/k/v layers hold two segments.
LAYER_TYPES = {
    "attn_q": (T.Q4_0, T.Q4_1), "attn_k": (T.Q4_0, T.Q4_1), "attn_v": (T.Q8_0, T.Q5_0),
    "attn_output": (T.Q5_0, T.Q4_0), "ffn_gate": (T.Q4_1, T.Q8_0), "ffn_up": (T.Q4_1, T.Q8_0),
    "ffn_down": (T.Q8_0, T.Q4_1),
}  # fmt: skip
PROMPT = [5, 17, 42, 9, 100, 230, 3, 77, 12, 64, 150, 8, 31, 200, 45, 6]


@pytest.fixture(scope="module")
def make_gguf(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], Path]]:
    """`make_gguf(name)`: a fresh tiny llama GGUF (RoPE row permutation, tied Q8_0 head) per name."""
    root = tmp_path_factory.mktemp("repack_gguf")
    patch = pytest.MonkeyPatch()
    patch.setattr(tiny, "_LAYER_TYPES", LAYER_TYPES)

    def make(name: str) -> Path:
        return tiny.make_tiny_gguf("llama", root / f"{name}.gguf")

    yield make
    patch.undo()


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TOKENMILL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(repack_cache.CACHE_ENV, raising=False)
    return tmp_path / "home"


class PackCounter:
    """Counts calls into the packing code; `forbid()` makes any call fail the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.forbidden = False
        self._from_gguf, self._quantize = gguf_quant.from_gguf, quant_formats.quantize
        monkeypatch.setattr(gguf_quant, "from_gguf", self._wrap(self._from_gguf))
        monkeypatch.setattr(quant_formats, "quantize", self._wrap(self._quantize))

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            assert not self.forbidden, "packed a layer although the cache holds it"
            self.calls += 1
            return fn(*args, **kwargs)

        return counted


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> PackCounter:
    return PackCounter(monkeypatch)


def _load(path: Path, quantization: str) -> tuple[LLM, torch.Tensor]:
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=16, max_model_len=64,
              quantization=quantization)
    return llm, engine_prompt_logits(llm, PROMPT)


def _cache_files(home: Path) -> list[Path]:
    folder = home / "repack"
    return sorted(folder.glob("*.safetensors")) if folder.is_dir() else []


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == CACHE_LOGGER and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("quantization", ["auto", "q4", "q5"])  # exact GGUF mappings; through float (and q5 bits)
def test_warm_load_maps_the_cache_and_gives_identical_logits(
        quantization: str, make_gguf: Callable[[str], Path], home: Path, packs: PackCounter,
        monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_gguf(f"roundtrip-{quantization}")
    # The weights stay where they load (no huge-page copy, layers/weight_arena.py): the zero-copy
    # check below reads the cache's own mapping.
    monkeypatch.setenv(HUGE_PAGES_ENV, "0")
    monkeypatch.setenv(repack_cache.CACHE_ENV, "0")
    _, uncached = _load(path, quantization)
    assert not _cache_files(home)
    monkeypatch.delenv(repack_cache.CACHE_ENV)

    cold, cold_logits = _load(path, quantization)
    assert packs.calls > 0
    (cache_file,) = _cache_files(home)
    assert f"-{quantization}-" in cache_file.name
    packs.forbidden = True
    warm, warm_logits = _load(path, quantization)
    assert torch.equal(cold_logits, uncached) and torch.equal(warm_logits, uncached)

    linears = [lin for lin in warm.core.runner.model.linears().values() if isinstance(lin, QuantLinear)]
    cold_methods = [lin.method for lin in cold.core.runner.model.linears().values() if isinstance(lin, QuantLinear)]
    assert [lin.method for lin in linears] == cold_methods
    if quantization == "auto":  # mixed segments survive the round trip
        assert warm.core.runner.model.layers[0].qkv_proj.method.startswith("q4+q8")
    # Zero-copy: every warm qs tensor is a view of the file's one memory map, at the file's own offsets.
    with safe_open(str(cache_file), framework="pt") as reader:  # and the file is plain safetensors
        assert len(list(reader.keys())) > 0
    header = json.loads(cache_file.read_bytes()[8:8 + int.from_bytes(cache_file.read_bytes()[:8], "little")])
    offsets = sorted(info["data_offsets"][0] for name, info in header.items() if name.endswith(".qs"))
    pointers = sorted(q.data_ptr() for lin in linears for q in lin.qs)
    assert [p - pointers[0] for p in pointers] == [o - offsets[0] for o in offsets]


def test_changed_file_or_layout_version_is_never_read(
        make_gguf: Callable[[str], Path], home: Path, packs: PackCounter, monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_gguf("stale")
    _, reference = _load(path, "auto")
    (first,) = _cache_files(home)

    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file was replaced or touched
    packs.calls = 0
    _, logits = _load(path, "auto")
    assert packs.calls > 0 and torch.equal(logits, reference)
    (second,) = _cache_files(home)  # a new entry; the stale one is deleted when it is written
    assert second != first

    monkeypatch.setattr(quant_formats, "QUANT_LAYOUT_VERSION", quant_formats.QUANT_LAYOUT_VERSION + 1)
    packs.calls = 0
    _, logits = _load(path, "auto")
    assert packs.calls > 0 and torch.equal(logits, reference)
    (third,) = _cache_files(home)
    assert third not in (first, second)

    _load(path, "q8")  # another mode is another entry, and does not evict this one
    assert third in _cache_files(home) and len(_cache_files(home)) == 2


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _garble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"\xff" * 32
    path.write_bytes(bytes(data))


def _wrong_shape(path: Path) -> None:
    tensors, metadata = repack_cache.read_safetensors(path)
    name = next(n for n in tensors if n.endswith("#0.scale"))
    tensors = {n: t.clone() for n, t in tensors.items()}
    tensors[name] = tensors[name][:-1].clone()  # one row short: a kernel would read past its end
    repack_cache.write_safetensors(path, tensors, metadata)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


@pytest.mark.parametrize("damage", [_truncate, _garble_header, _wrong_shape, _empty])
def test_damaged_cache_costs_one_warning_and_a_repack(
        damage: Callable[[Path], None], make_gguf: Callable[[str], Path], home: Path, packs: PackCounter,
        caplog: pytest.LogCaptureFixture) -> None:
    path = make_gguf(f"damaged-{damage.__name__}")
    _, reference = _load(path, "auto")
    (cache_file,) = _cache_files(home)
    damage(cache_file)

    packs.calls = 0
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        _, logits = _load(path, "auto")
    assert torch.equal(logits, reference)
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "unusable" in warnings[0] and str(cache_file) in warnings[0]
    assert packs.calls > 0

    caplog.clear()
    packs.forbidden = True  # the load rewrote the file: the next one is all hits, and quiet
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        _, logits = _load(path, "auto")
    assert torch.equal(logits, reference) and not _warnings(caplog)


def test_unwritable_home_warns_and_serves(
        make_gguf: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("TOKENMILL_HOME", str(blocker))  # mkdir under a file fails
    with caplog.at_level(logging.WARNING, logger=CACHE_LOGGER):
        llm, _ = _load(make_gguf("unwritable"), "auto")
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and "not written" in warnings[0]
    assert isinstance(llm.core.runner.model.layers[0].qkv_proj, QuantLinear)


def test_dense_modes_write_nothing(make_gguf: Callable[[str], Path], home: Path) -> None:
    _load(make_gguf("dense"), "none")
    assert not _cache_files(home)


def test_safetensors_directory_quantized_at_load_is_cached(
        tiny_hf_dir: Callable[[str], Path], home: Path, packs: PackCounter) -> None:
    _, reference = _load(tiny_hf_dir("qwen2"), "q8")
    assert packs.calls > 0 and len(_cache_files(home)) == 1
    packs.forbidden = True
    _, logits = _load(tiny_hf_dir("qwen2"), "q8")
    assert torch.equal(logits, reference)


def test_file_format_round_trip_and_bounds(tmp_path: Path) -> None:
    tensors = {"a#0.qs": torch.arange(96, dtype=torch.uint8).view(3, 32), "a#0.scale": torch.rand(3, 2),
               "b#0.qs": torch.arange(-64, 64, dtype=torch.int8).view(2, 64)}
    path = tmp_path / "x.safetensors"
    repack_cache.write_safetensors(path, tensors, {"tokenmill": "{}"})
    back, metadata = repack_cache.read_safetensors(path)
    assert metadata == {"tokenmill": "{}"} and back.keys() == tensors.keys()
    assert all(torch.equal(back[n], t) for n, t in tensors.items())
    with safe_open(str(path), framework="pt") as reader:  # readable by the reference implementation
        assert all(torch.equal(reader.get_tensor(n), t) for n, t in tensors.items())
    data_start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    assert data_start % 64 == 0 and back["a#0.qs"].data_ptr() % 64 == 0  # qs first, from an aligned start
    assert back["a#0.scale"].data_ptr() % 4 == 0
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(ValueError, match="does not fit"):
        repack_cache.read_safetensors(path)


def test_two_level_and_q6_segments_round_trip(tmp_path: Path) -> None:
    """Q4_K's two-level lanes, q6 (int8 lanes, two mask planes) and q5 with offsets (Q5_K two-level, Q5_1
    fp16) come back with their super lanes and offsets, and an entry whose super lanes are missing
    invalidates the file rather than loading wrong lanes."""
    from tests.fixtures.gguf_blocks import gguf_blocks

    q4k = gguf_quant.from_gguf(gguf_blocks(T.Q4_K, 24, 512, 1), T.Q4_K, 512, "q4")
    q6 = gguf_quant.from_gguf(gguf_blocks(T.Q6_K, 20, 512, 2), T.Q6_K, 512, "q6")
    q5k = gguf_quant.from_gguf(gguf_blocks(T.Q5_K, 16, 512, 3), T.Q5_K, 512, "q5")
    q51 = gguf_quant.from_gguf(gguf_blocks(T.Q5_1, 8, 512, 4), T.Q5_1, 512, "q5")
    iq4 = gguf_quant.from_gguf(gguf_blocks(T.IQ4_XS, 8, 512, 5), T.IQ4_XS, 512, "iq4")
    assert q4k.two_level and q6.fmt == "q6" and q5k.two_level and q51.offset.numel()
    shapes = {"a.weight": (24, 512), "b.weight": (20, 512), "c.weight": (16, 512), "d.weight": (8, 512),
              "e.weight": (8, 512)}
    path, key = tmp_path / "cache.safetensors", {"test": 1}
    cache = repack_cache.RepackCache(path, key, tmp_path, shapes)
    cache.store(["a.weight"], ["q4"], [q4k])
    cache.store(["b.weight"], ["q6"], [q6])
    cache.store(["c.weight"], ["q5"], [q5k])
    cache.store(["d.weight"], ["q5"], [q51])
    cache.store(["e.weight"], ["iq4"], [iq4])
    cache.flush()
    back = repack_cache.RepackCache(path, key, tmp_path, shapes)
    for names, method, want in ((["a.weight"], "q4", q4k), (["b.weight"], "q6", q6), (["c.weight"], "q5", q5k),
                                (["d.weight"], "q5", q51), (["e.weight"], "iq4", iq4)):
        loaded = back.load(names, [method])
        assert loaded is not None
        (got,) = loaded
        assert got.fmt == want.fmt and got.rows == want.rows
        for field in ("qs", "scale", "offset", "high", "supers"):
            assert torch.equal(getattr(got, field), getattr(want, field)), field
    tensors, meta = repack_cache.read_safetensors(path)
    del tensors[next(n for n in tensors if n.endswith("#0.supers") and n.startswith("b.weight"))]
    repack_cache.write_safetensors(path, tensors, meta)
    assert repack_cache.RepackCache(path, key, tmp_path, shapes).load(["b.weight"], ["q6"]) is None
