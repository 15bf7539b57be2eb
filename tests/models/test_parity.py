"""Model parity: tiny random checkpoints, in both formats, against Hugging Face transformers (fp32)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.fixtures.engine_logits import engine_prompt_logits
from tokenmill import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "gemma3"]
NUM_STEPS = 32


def _hf_model(path: Path, fmt: str, arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if fmt == "hf":
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # transformers' GGUF reader leaves Gemma 3's query_pre_attn_scalar at its default (256); llama.cpp
    # uses head_dim, which is what the real 270M has. Tell transformers so the reference is right.
    extra = {"query_pre_attn_scalar": 32} if arch == "gemma3" else {}
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                **extra).eval()


def _prompt(vocab_size: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (length,), generator=g).tolist()


def _hf_greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    """Plain greedy loop (no generation config: EOS must not stop or bias it)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            next_id = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


# "auto" leaves the tiny weights on aten's GEMM; "onednn" forces the kernel large weights get on CPU.
CASES = [(a, f, "auto") for a in ARCHS for f in ("hf", "gguf")] + [(a, "gguf", "onednn") for a in ARCHS]


@pytest.fixture(scope="module", params=CASES, ids=lambda p: "-".join(p))
def pair(request: pytest.FixtureRequest, tiny_hf_dir: Callable[[str], Path],
         tiny_gguf_path: Callable[[str], Path]) -> tuple[LLM, torch.nn.Module]:
    arch, fmt, gemm = request.param
    path = tiny_gguf_path(arch) if fmt == "gguf" else tiny_hf_dir(arch)
    llm = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, block_size=16, max_model_len=256,
              gemm_backend=gemm, quantization="none")
    assert arch != "gemma3" or llm.core.arch.head_dim == 32
    return llm, _hf_model(path, fmt, arch)


def test_prompt_logits_match_transformers(pair: tuple[LLM, torch.nn.Module]) -> None:
    llm, hf = pair
    prompt = _prompt(llm.core.arch.vocab_size, 40, seed=1)
    ours = engine_prompt_logits(llm, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"max relative logit error {rel:.2e}"


def test_greedy_tokens_match_transformers(pair: tuple[LLM, torch.nn.Module]) -> None:
    llm, hf = pair
    prompts = [_prompt(llm.core.arch.vocab_size, n, seed=n) for n in (5, 23)]
    params = SamplingParams(max_tokens=NUM_STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, NUM_STEPS)
