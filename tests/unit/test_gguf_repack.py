"""Packing GGUF blocks in row slices (gguf_quant.from_gguf) gives the bytes of one pass."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.fixtures.gguf_blocks import gguf_blocks
from tokenmill.layers import gguf_quant as gq
from tokenmill.layers import quant_formats as qf

T = GGMLQuantizationType


CASES = [(T.Q4_K, "q4"), (T.Q6_K, "q8"), (T.Q5_0, "q8"), (T.Q5_0, "q5"), (T.Q8_0, "q8"), (T.Q4_1, "q4"), (T.Q4_0, "q8"),
         (T.Q5_K, "q5"), (T.Q5_1, "q5"), (T.IQ4_XS, "iq4"), (T.IQ4_NL, "iq4")]


@pytest.mark.parametrize(("ggml_type", "fmt"), CASES, ids=[f"{t.name}-{f}" for t, f in CASES])
def test_sliced_packing_is_byte_identical(ggml_type: GGMLQuantizationType, fmt: qf.QuantFormat,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Exact mappings and re-quantization through float alike; 37 rows: the last slice ends mid-group."""
    blocks = gguf_blocks(ggml_type, 37, 256, seed=11)
    whole = gq.from_gguf(blocks, ggml_type, 256, fmt)
    converted: list[int] = []
    real_concat = gq.concat

    def counting_concat(mats: list[qf.QuantMatrix]) -> list[qf.QuantMatrix]:
        converted.append(len(mats))
        return real_concat(mats)

    monkeypatch.setattr(gq, "_SLICE_ELEMENTS", 8 * 256)  # one row group a slice: 5 slices
    monkeypatch.setattr(gq, "concat", counting_concat)
    sliced = gq.from_gguf(blocks, ggml_type, 256, fmt)
    assert converted == [5]
    assert (sliced.fmt, sliced.rows) == (whole.fmt, whole.rows) == (fmt, 37)
    for field in ("qs", "scale", "offset", "high", "supers"):
        assert torch.equal(getattr(sliced, field), getattr(whole, field)), field
