"""Slow: regenerate the golden continuations with transformers right now and compare live."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ModelNotInstalledError
from tokenmill.models.resolve import resolve_model

ROOT = Path(__file__).resolve().parent.parent.parent
GOLDEN = json.loads((ROOT / "tests" / "fixtures" / "greedy_golden.json").read_text())


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("make_greedy_golden", ROOT / "scripts" / "make_greedy_golden.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(GOLDEN))
def test_live_transformers_equals_fixture_and_engine(model: str) -> None:
    try:
        resolve_model(model)
    except ModelNotInstalledError:
        pytest.skip(f"{model} is not pulled")
    live = _script().golden_for(model)
    assert live == GOLDEN[model], "transformers' output moved: regenerate with scripts/make_greedy_golden.py"
    llm = LLM(model, dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=1024, quantization="none")
    params = SamplingParams(max_tokens=len(live["outputs"][0]), temperature=0.0, ignore_eos=True)
    outs = llm.generate(live["prompts"], params)
    assert [o.outputs[0].token_ids for o in outs] == live["outputs"]
