"""Real models: greedy continuations equal transformers' on the same GGUF in fp32.

Golden ids come from `scripts/make_greedy_golden.py`; a model that is not pulled is skipped
(`make test` pulls all three).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelNotInstalledError
from tokenmill.models.resolve import resolve_model

GOLDEN = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "greedy_golden.json").read_text())


@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_greedy_matches_transformers(model: str) -> None:
    try:
        resolve_model(model)
    except ModelNotInstalledError:
        pytest.skip(f"{model} is not pulled")
    golden = GOLDEN[model]
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=1024, quantization="none")
    params = SamplingParams(max_tokens=len(golden["outputs"][0]), temperature=0.0, ignore_eos=True)
    outs = llm.generate(golden["prompts"], params)
    for i, (out, expected) in enumerate(zip(outs, golden["outputs"], strict=True)):
        assert out.outputs[0].token_ids == expected, f"{model} prompt {i}"
