"""GPU check (run on a CUDA machine): the same engine code on CUDA, parity and throughput.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py [OUT_DIR]

1. Parity: tiny random llama / qwen2 / gemma3 checkpoints, tokenmill on CUDA (fp32) against
   transformers on CUDA: max relative logit error and greedy tokens for 32 steps.
2. Throughput: a random SmolLM2-360M-shaped Llama (bf16), 64 prompts x 128 tokens -> 128 tokens:
   tokenmill vs transformers `generate` with static padded batches of 16; batch-1 decode tok/s.
Writes gpu_check.json to OUT_DIR.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.fixtures.tiny_models import make_tiny_hf
from tokenmill import LLM, SamplingParams

DEVICE = os.environ.get("DEVICE", "cuda")  # DEVICE=cpu for a dry run of the parity part


def parity(root: Path) -> dict[str, object]:
    from transformers import AutoModelForCausalLM

    results: dict[str, object] = {}
    for arch in ("llama", "qwen2", "gemma3"):
        path = make_tiny_hf(arch, root / arch)  # type: ignore[arg-type]
        llm = LLM(str(path), dtype="float32", device=DEVICE, num_kv_blocks=64, max_model_len=256)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(3, llm.core.arch.vocab_size, (23,), generator=g).tolist()
        out = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))[0]
        ids = torch.tensor([prompt], device=DEVICE)
        with torch.no_grad():
            for _ in range(32):
                ids = torch.cat([ids, hf(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
        ref = ids[0, len(prompt):].tolist()
        results[arch] = {"greedy_equal": out.outputs[0].token_ids == ref}
        print(arch, results[arch], flush=True)
    return results


def random_360m(root: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=960, intermediate_size=2560, num_hidden_layers=32,
                         num_attention_heads=15, num_key_value_heads=5, max_position_embeddings=2048,
                         tie_word_embeddings=True, rope_theta=100000.0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out = root / "llama360m"
    model.save_pretrained(out)
    make_tiny_hf("llama", root / "tok")  # borrow a tokenizer.json (ids stay < 49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = root / "tok" / name
        if src.exists():
            (out / name).write_text(src.read_text())
    return out


def throughput(path: Path) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    prompts = [torch.randint(100, 40000, (128,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(64)]
    params = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)
    llm = LLM(str(path), dtype="bfloat16", device=DEVICE, max_num_seqs=64, max_model_len=512)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    _sync()
    t = time.perf_counter()
    llm.generate(prompts, params)
    _sync()
    ours = 64 * 128 / (time.perf_counter() - t)
    t = time.perf_counter()
    llm.generate(prompts[:1], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))
    batch1 = 128 / (time.perf_counter() - t)
    del llm
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    t = time.perf_counter()
    with torch.no_grad():
        for i in range(0, 64, 16):
            ids = torch.tensor(prompts[i:i + 16], device=DEVICE)
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128, min_new_tokens=128,
                        do_sample=False)
    _sync()
    hf16 = 64 * 128 / (time.perf_counter() - t)
    return {"tokenmill_tok_s": ours, "hf_batch16_tok_s": hf16, "ratio_vs_hf_batch16": ours / hf16,
            "tokenmill_batch1_tok_s": batch1}


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(".")
    name = torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE
    report: dict[str, object] = {"device": name, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        report["parity"] = parity(root)
        if DEVICE == "cuda":
            report["throughput"] = throughput(random_360m(root))
    print(json.dumps(report, indent=1), flush=True)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
