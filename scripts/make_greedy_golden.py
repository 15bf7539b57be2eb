"""Generate golden greedy continuations of the real models with Hugging Face transformers (fp32).

    python scripts/make_greedy_golden.py [MODEL ...]   → tests/fixtures/greedy_golden.json

transformers loads the same GGUF file (dequantized to fp32) and runs a plain greedy loop, so
EOS neither stops nor biases it; tokenmill must reproduce the ids exactly (tests/models/test_golden.py).
Prompt ids come from tokenmill's tokenizer, so the comparison is of the models alone.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from tokenmill.engine.loader import load_tokenizer
from tokenmill.models.resolve import resolve_model

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "greedy_golden.json"
MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "Q: What is the boiling point of water at sea level?\nA:",
]
NUM_TOKENS = 32


def greedy(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    ids = torch.tensor([prompt])
    past = None
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            result = model(ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = result.past_key_values
            next_id = int(result.logits[0, -1].argmax())
            out.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out


def golden_for(name: str) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    source = resolve_model(name)
    tokenizer = load_tokenizer(source)
    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name,
                                                 dtype=torch.float32).eval()
    print(f"{name}: transformers loaded in {time.monotonic() - started:.0f} s", file=sys.stderr)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    return {"prompts": prompts, "outputs": [greedy(model, p, NUM_TOKENS) for p in prompts]}


def main(names: list[str]) -> None:
    golden = json.loads(OUT.read_text()) if OUT.exists() else {}
    for name in names or MODELS:
        golden[name] = golden_for(name)
        OUT.write_text(json.dumps(golden, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
