"""Tiny random Hugging Face models built in memory, and engines over their float32 weights.

No files, no tokenizer: each builder returns the transformers model (the reference), the
matching `ArchConfig` and the state dict the engine loads. Models are cached per process, so a
test session pays for `import transformers` and the random init once per architecture.

Shapes: vocab 300, hidden 64, FFN 128, 4 heads. Weights use a large init range (0.2) so logits
are spread out and fp32 greedy ties are vanishingly rare.
- llama:  2 layers, GQA 4/2, separate lm_head.
- qwen2:  2 layers, GQA 4/2, q/k/v biases drawn non-zero.
- gemma3: 4 layers, 1 KV head, head_dim 32, sliding window 8 on layers 0 and 2, norms drawn
          non-zero (Gemma scales by 1 + w, so zero weights would hide a wrong convention).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.request import SamplingParams
from tokenmill.models.arch import ArchConfig

ArchName = Literal["llama", "qwen2", "gemma3"]
ARCH_NAMES: tuple[ArchName, ...] = ("llama", "qwen2", "gemma3")
VOCAB_SIZE = 300
MAX_POSITIONS = 256
GEMMA3_SLIDING_WINDOW = 8


@dataclass(frozen=True, slots=True)
class TinyModel:
    name: ArchName
    hf: Any  # transformers PreTrainedModel in eval mode, float32
    arch: ArchConfig
    state_dict: dict[str, torch.Tensor]


@functools.cache
def tiny_model(name: ArchName) -> TinyModel:
    torch.manual_seed({"llama": 0, "qwen2": 1, "gemma3": 2}[name])
    hf, arch = _BUILDERS[name]()
    hf.eval()
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens, never stop early
    hf.generation_config.pad_token_id = 0
    state_dict = {k: v.detach().float().clone() for k, v in hf.state_dict().items()}
    return TinyModel(name, hf, arch, state_dict)


def _llama() -> tuple[Any, ArchConfig]:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                      tie_word_embeddings=False, initializer_range=0.2)
    arch = ArchConfig("llama", VOCAB_SIZE, 64, 2, 4, 2, 16, 128, cfg.rms_norm_eps, 10000.0, MAX_POSITIONS, False)
    return LlamaForCausalLM(cfg), arch


def _qwen2() -> tuple[Any, ArchConfig]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
                      tie_word_embeddings=False, initializer_range=0.2)
    hf = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    arch = ArchConfig("qwen2", VOCAB_SIZE, 64, 2, 4, 2, 16, 128, cfg.rms_norm_eps, 10000.0, MAX_POSITIONS, False,
                      attention_bias=True)
    return hf, arch


def _gemma3() -> tuple[Any, ArchConfig]:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    sliding = (True, False, True, False)
    cfg = Gemma3TextConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                           max_position_embeddings=MAX_POSITIONS, sliding_window=GEMMA3_SLIDING_WINDOW,
                           layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
                           query_pre_attn_scalar=32, initializer_range=0.2)
    hf = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.normal_(0, 0.5)
    rope = cfg.rope_parameters
    arch = ArchConfig("gemma3", VOCAB_SIZE, 64, 4, 4, 1, 32, 128, cfg.rms_norm_eps,
                      rope["full_attention"]["rope_theta"], MAX_POSITIONS, True, hidden_act="gelu_pytorch_tanh",
                      sliding_window=GEMMA3_SLIDING_WINDOW, layer_is_sliding=sliding,
                      rope_local_theta=rope["sliding_attention"]["rope_theta"], query_pre_attn_scalar=32)
    return hf, arch


_BUILDERS = {"llama": _llama, "qwen2": _qwen2, "gemma3": _gemma3}


def make_core(model: TinyModel, *, block_size: int = 4, num_blocks: int = 256, max_num_batched_tokens: int = 2048,
              max_num_seqs: int = 64, enable_prefix_caching: bool = True, policy: str = "fcfs",
              max_model_len: int | None = None, seed: int = 0, async_scheduling: str = "auto") -> EngineCore:
    config = EngineConfig(
        ModelConfig("tiny", dtype="float32", device="cpu", max_model_len=max_model_len, seed=seed),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=enable_prefix_caching),
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, policy=policy,
                        async_scheduling=async_scheduling),
    )
    return EngineCore(config, model.arch, model.state_dict)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def random_prompts(lengths: Iterable[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def run_to_completion(core: EngineCore, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
                      max_steps: int = 10_000) -> list[list[int]]:
    """Add every prompt (ids "0", "1", ...), step until idle; the output tokens of each, in order."""
    all_params = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    for i, (prompt, p) in enumerate(zip(prompts, all_params, strict=True)):
        core.add_request(str(i), prompt, p, ())
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for _ in range(max_steps):
        if not core.has_unfinished:
            break
        for out in core.step().outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    assert not core.has_unfinished, f"engine still busy after {max_steps} steps"
    return [tokens[str(i)] for i in range(len(prompts))]


def hf_greedy(model: TinyModel, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' own greedy `generate` (with its KV cache)."""
    with torch.no_grad():
        out = model.hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_all_free(core: EngineCore) -> None:
    """No request left, every block back in the free queue, every refcount zero."""
    kv = core.kv
    assert not core.scheduler.requests
    assert len(core.scheduler.running) == 0 and len(core.scheduler.waiting) == 0
    assert kv.block_tables == {}
    assert kv.pool.num_free == kv.num_blocks
    assert all(b.ref_count == 0 for b in kv.pool.blocks)
