"""Beam search on the real packaged models (fp32 reference weights) against transformers' generate(num_beams):
the same beams, the models' own end-of-sequence tokens ending them. Slow; models not pulled are skipped."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM
from tokenmill.engine.beam_search import BeamSearchParams
from tokenmill.models.resolve import installed_models

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_real_model_beams_match_transformers(name: str) -> None:
    from transformers import AutoModelForCausalLM

    path = installed_models().get(name)
    if path is None:
        pytest.skip(f"{name} is not pulled: run `tokenmill pull {name}`")
    llm = LLM(name, dtype="float32", quantization="none")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    eos = list(llm.engine.eos_token_ids)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True),
                                  add_special_tokens=False)
    (ours,) = llm.beam_search([prompt], BeamSearchParams(4, 24, length_penalty=1.0))
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, num_beams=4, num_return_sequences=4,
                      do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
    beams = [row[len(prompt):].tolist() for row in ref]
    beams = [next((b[:i + 1] for i, t in enumerate(b) if t in eos), b) for b in beams]  # transformers pads after
    assert [out.token_ids for out in ours.outputs] == beams
    assert "Paris" in ours.outputs[0].text and ours.outputs[0].finish_reason is not None
