"""The one-call native decoder stack (models/native_stack.py, kernels/stack_kernels.cpp).

It must be a pure speed-up: on every decode step it serves, its final hidden states equal the
Python layers' bit for bit (same kernels, same order, same residual adds), for dense and int8 KV
caches, several sequences of different lengths, and speculative verification rows; every other
step (a prefill in it) and every model with a piece that is not native takes the Python layers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.kernels import quant_kernels, stack_kernels
from tokenmill.layers.kv_cache import Int8KVCache
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.models.native_stack import NATIVE_STACK_ENV, NativeDecodeStack

pytestmark = pytest.mark.skipif(quant_kernels() is None or stack_kernels() is None,
                                reason="native kernels cannot be built here")


def _llm(path: Path, **kwargs: Any) -> LLM:
    options: dict[str, Any] = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 96, "max_model_len": 256,
                               "quantization": "auto"}
    return LLM(str(path), **{**options, **kwargs})


class _Checked:
    """Runs every forward twice, native stack and Python layers, and checks they agree exactly."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.stack = model.native_stack
        assert isinstance(self.stack, NativeDecodeStack)
        self.forward = model.forward
        self.native_steps = 0
        self.python_steps = 0
        self.max_rows = 0
        self.rows: list[int] = []
        self.previous: tuple[torch.Tensor, torch.Tensor] | None = None  # an output and its copy

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[Any], meta: Any) -> Any:
        assert self.stack is not None
        self.stack.enabled = True
        x = self.model.embed(input_ids)
        native = self.stack(x, positions, kv_caches, meta)
        self.stack.enabled = False
        reference = self.forward(input_ids, positions, kv_caches, meta)  # rewrites the same KV slots
        self.stack.enabled = True
        if native is None:
            self.python_steps += 1
            return reference
        self.native_steps += 1
        self.max_rows = max(self.max_rows, native.shape[0])
        self.rows.append(native.shape[0])
        assert torch.equal(native, reference), (native - reference).abs().max()
        if self.previous is not None:  # the stack reuses its buffers: what it returned must stay the caller's
            assert torch.equal(*self.previous)
        self.previous = (native, native.clone())
        return native


def _check(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> _Checked:
    model = llm.core.runner.model
    checked = _Checked(model)
    model.forward = checked  # type: ignore[method-assign]
    try:
        outputs = llm.generate(prompts, params)
    finally:
        del model.forward
    assert all(len(o.outputs[0].token_ids) == params.max_tokens for o in outputs)
    return checked


def _prompts(lengths: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 263, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "bf16"])
def test_decode_steps_equal_the_python_layers_exactly(arch: str, kv_cache_dtype: str,
                                                      quant_gguf: Callable[[str], Path]) -> None:
    llm = _llm(quant_gguf(arch), kv_cache_dtype=kv_cache_dtype)
    # Three sequences of different lengths crossing block boundaries (block size 16), sampled so the
    # rows differ; the first steps mix prefill chunks with decodes (the Python layers' steps).
    checked = _check(llm, _prompts([5, 23, 40]),
                     SamplingParams(max_tokens=24, temperature=0.8, seed=1, ignore_eos=True))
    assert checked.native_steps >= 20 and checked.python_steps >= 1
    assert checked.max_rows == 3


def test_steps_of_changing_width_reuse_the_workspace_exactly(quant_gguf: Callable[[str], Path]) -> None:
    """The stack's activation buffers grow to the widest step and are viewed at each step's rows:
    decode steps of 3, then 1, then 5, then 2 rows (and the short prompts' steps, one row per prompt
    token, which grow the buffers past each earlier width) all equal the Python layers."""
    llm = _llm(quant_gguf("llama"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    rows = []
    for lengths in ([5, 23, 40], [7], [3, 4, 5, 6, 7], [30, 2]):
        checked = _check(llm, _prompts(lengths), params)
        assert checked.native_steps >= 5
        rows += checked.rows
    assert {1, 2, 3, 5} <= set(rows) and rows.index(max(rows)) > rows.index(3)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_key_smoothing_in_the_stack_equals_the_python_layers(arch: str, quant_gguf: Callable[[str], Path]) -> None:
    """The load fits the int8 keys' and values' smoothing (engine/kv_calibration.py); the stack binds it,
    writes keys as (k − μ)·σ⁻¹ and values as (v − ν)·τ⁻¹, scales its queries by σ and maps its outputs
    back exactly as the Python layers do: a stack without either (or writing other rows) would differ."""
    llm = _llm(quant_gguf(arch), kv_cache_dtype="int8")
    caches = llm.core.runner.kv_caches
    assert all(isinstance(c, Int8KVCache) and c.smoothing is not None and c.smoothing.values is not None
               for c in caches)
    assert any(c.smoothing is not None and not bool((c.smoothing.keys.sigma == 1).all()) for c in caches)
    checked = _check(llm, _prompts([9, 30]), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert checked.native_steps >= 14


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_weights_on_the_skinny_kernel_equal_the_python_layers(arch: str,
                                                                    quant_gguf: Callable[[str], Path]) -> None:
    # quantization "none": dense float32 weights; steps of up to 4 rows run the skinny kernel natively,
    # wider ones (here 6 sequences) the Python layers (oneDNN/ATen there).
    llm = _llm(quant_gguf(arch), quantization="none")
    stack = llm.core.runner.model.native_stack
    assert stack is not None and stack.max_rows == 4
    checked = _check(llm, _prompts([5, 23, 40]), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert checked.native_steps >= 10 and checked.max_rows == 3
    checked = _check(llm, _prompts([3, 4, 5, 6, 7, 8]), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert checked.native_steps == 0 and checked.python_steps >= 6


def test_speculative_verification_rows_equal_the_python_layers(quant_gguf: Callable[[str], Path]) -> None:
    # A repeating prompt gives the n-gram proposer matches: decode steps with 1 + k rows per request.
    llm = _llm(quant_gguf("llama"), speculative="ngram", num_speculative_tokens=3)
    checked = _check(llm, [[5, 6, 7, 8] * 8], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert checked.native_steps >= 1 and checked.max_rows > 1


def test_models_with_a_python_piece_keep_the_python_layers(quant_gguf: Callable[[str], Path],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    assert _llm(quant_gguf("llama")).core.runner.model.native_stack is not None
    assert _llm(quant_gguf("gemma3")).core.runner.model.native_stack is None  # q/k norms, sandwich norms
    assert _llm(quant_gguf("llama"), gemm_backend="onednn").core.runner.model.native_stack is not None  # quantized
    assert _llm(quant_gguf("llama"), quantization="none", gemm_backend="aten").core.runner.model.native_stack \
        is None  # dense without the skinny kernel
    monkeypatch.setenv(NATIVE_STACK_ENV, "0")
    assert _llm(quant_gguf("llama")).core.runner.model.native_stack is None


def test_a_changed_kernel_needs_a_rebind(quant_gguf: Callable[[str], Path]) -> None:
    # The stack holds the layers' plans: after one is replaced, rebind_native_stack() picks it up.
    llm = _llm(quant_gguf("llama"))
    model = llm.core.runner.model
    before = model.native_stack
    model.rebind_native_stack()
    assert model.native_stack is not None and model.native_stack is not before
    assert model.native_stack.stack.num_layers == len(model.layers)
