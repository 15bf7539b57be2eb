"""The huge-page weight arena: quantized layers move into it with outputs unchanged."""

from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import quant_isa, quant_kernels
from tokenmill.layers import quant_formats as qf
from tokenmill.layers import weight_arena
from tokenmill.layers.linear import QuantLinear

kernels = quant_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="native quantized kernels cannot be built here")


def _layer(rows: int, fmt: qf.QuantFormat, seed: int) -> QuantLinear:
    w = torch.randn(rows, 256, generator=torch.Generator().manual_seed(seed))
    return QuantLinear(qf.concat([qf.quantize(w, fmt)]), None, torch.float32, kernels, quant_isa())


def test_relocated_layers_live_in_one_huge_page_mapping_and_compute_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weight_arena, "huge_pages_available", lambda: True)
    layers = [_layer(37, "q4", 1), _layer(64, "q8", 2)]
    x = torch.randn(5, 256)
    before = [lin(x) for lin in layers]
    old = [t.data_ptr() for lin in layers for t in lin.relocatable if t.numel()]
    arena = weight_arena.relocate(layers)
    assert arena is not None
    base = arena._bytes.data_ptr()
    new = [t.data_ptr() for lin in layers for t in lin.relocatable if t.numel()]
    assert all(base <= p < base + arena.size for p in new) and not set(old) & set(new)
    assert new[0] % (2 << 20) == 0 and all(p % 64 == 0 for p in new)  # a 2 MiB start; cache-line aligned
    assert [s.qs.data_ptr() for lin in layers for s in lin.segments] == [lin.qs[0].data_ptr() for lin in layers]
    for lin, y in zip(layers, before, strict=True):
        assert torch.equal(lin(x), y)


def test_nothing_moves_when_huge_pages_are_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(weight_arena.HUGE_PAGES_ENV, "0")
    layer = _layer(8, "q8", 3)
    ptr = layer.qs[0].data_ptr()
    assert weight_arena.relocate([layer]) is None and layer.qs[0].data_ptr() == ptr


def test_file_pages_are_released_and_anonymous_memory_is_never_touched(tmp_path: pytest.TempPathFactory) -> None:
    import mmap
    from pathlib import Path

    path = Path(str(tmp_path)) / "weights.bin"
    data = torch.arange(4 * mmap.PAGESIZE, dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    from_file = torch.frombuffer(mapped, dtype=torch.uint8)
    assert int(from_file.sum()) == int(data.sum())  # fault every page in
    anonymous = data.clone()
    ranges = weight_arena._file_backed_ranges()
    assert any(lo <= from_file.data_ptr() < hi for lo, hi in ranges)
    assert not any(lo <= anonymous.data_ptr() < hi for lo, hi in ranges)
    weight_arena._release_file_pages(anonymous, ranges)  # not file-backed: left alone
    assert torch.equal(anonymous, data)
    weight_arena._release_file_pages(from_file, ranges)  # dropped from RSS, read back from the file
    assert torch.equal(from_file, data)
    del from_file
    mapped.close()
