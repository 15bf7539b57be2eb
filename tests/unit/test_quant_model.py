"""Quantized weights through the loader, the Linear seam and the engine, on tiny GGUF files.

The tiny GGUF here stores its matrices as 4- and 8-bit GGUF types (Q4_0, Q4_1, Q5_0, Q8_0, with
q/k and v of different widths so the fused q/k/v mixes formats). With `--quantization auto` the
engine must run those blocks natively and stay close to the dequantized (`none`) reference; a
wrong RoPE row permutation, scale or offset of packed rows would move the logits far more.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from tests.fixtures.engine_logits import engine_prompt_logits
from tokenmill import LLM, SamplingParams
from tokenmill.errors import TokenmillError
from tokenmill.kernels import QUANT_ISA_ENV, available_quant_isas, cpu_flags, isa_key, quant_kernels
from tokenmill.layers import gguf_quant, quant_formats
from tokenmill.layers import linear as linear_module
from tokenmill.layers.embedding import GgufRowsEmbedding
from tokenmill.layers.linear import QuantLinear

T = GGMLQuantizationType
pytestmark = pytest.mark.skipif(quant_kernels() is None, reason="native quantized kernels cannot be built here")

# Layer 1's v is Q5_0: q8 or q5 as gguf_quant.q5_0_format decides for the CPU; pinned here both ways.
EXPECTED_QKV = {"q8": ["q4+q8", "q4+q8"], "q5": ["q4+q8", "q4+q5"]}


def _llm(path: Path, quantization: str) -> LLM:
    return LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256,
               quantization=quantization)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 263, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("q5_0", ["q8", "q5"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_auto_runs_gguf_blocks_natively_and_tracks_the_dequantized_path(
        arch: str, q5_0: str, quant_gguf: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gguf_quant.Q5_0_ENV, q5_0)
    path = quant_gguf(arch)
    native, reference = _llm(path, "auto"), _llm(path, "none")
    model = native.core.runner.model
    methods = {name: linear.method for name, linear in model.linears().items()}
    assert [methods[f"layers.{i}.qkv_proj"] for i in range(2)] == EXPECTED_QKV[q5_0]
    assert methods["layers.0.gate_up_proj"] == "q4" and methods["layers.1.gate_up_proj"] == "q8"
    # Tied heads pack the Q8_0 embedding; qwen2's separate head is F16 in the file: it stays dense.
    assert (methods["lm_head"] == "q8") if arch != "qwen2" else not methods["lm_head"].startswith("q")
    assert isinstance(model.embedding, GgufRowsEmbedding)  # Q8_0 embedding read from the map
    assert {m.method for m in reference.core.runner.model.linears().values()} <= {"aten", "native+aten"}

    prompt = _prompt(40, seed=3)
    ours, ref = engine_prompt_logits(native, prompt), engine_prompt_logits(reference, prompt)
    # Only the int8 rounding of activations differs (the weights are the same GGUF values).
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 0.05, f"max relative logit error {rel:.3f}"
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9

    out = native.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8


# Q5_1 (what a Q5_K_M file holds where a row is not a multiple of 256) beside Q5_0 in one fused q/k/v, and
# beside q4 in a fused gate/up. (Q5_K needs K >= 256, past the tiny models: tested on random blocks.)
Q5_LAYER_TYPES = {
    "attn_q": (T.Q5_0, T.Q4_0), "attn_k": (T.Q5_0, T.Q4_0), "attn_v": (T.Q5_1, T.Q8_0),
    "attn_output": (T.Q5_1, T.Q4_1), "ffn_gate": (T.Q4_1, T.Q5_1), "ffn_up": (T.Q5_1, T.Q5_1),
    "ffn_down": (T.Q8_0, T.Q5_1),
}  # fmt: skip


def test_q5_1_stays_5_bit_and_joins_q5_0_in_one_segment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fixtures.tiny_models import make_tiny_gguf

    monkeypatch.setenv(gguf_quant.Q5_0_ENV, "q5")
    path = make_tiny_gguf("llama", tmp_path / "q5.gguf", layer_types=Q5_LAYER_TYPES)
    native, reference = _llm(path, "auto"), _llm(path, "none")
    linears = native.core.runner.model.linears()
    methods = {name: linear.method for name, linear in linears.items()}
    # Q5_0's implied offsets (-16 · scale) written out beside Q5_1's: one q5 segment, not two formats
    assert methods["layers.0.qkv_proj"] == "q5" and methods["layers.0.gate_up_proj"] == "q4+q5"
    assert methods["layers.1.gate_up_proj"] == "q5" and methods["layers.1.down_proj"] == "q5"
    qkv = linears["layers.0.qkv_proj"]
    assert isinstance(qkv, QuantLinear) and qkv.segments[0].offset.numel()
    prompt = _prompt(40, seed=4)
    ours, ref = engine_prompt_logits(native, prompt), engine_prompt_logits(reference, prompt)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < 0.05, f"max relative logit error {rel:.3f}"  # a dropped offset moves them by far more
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def test_packed_rows_are_the_gguf_values_in_hf_order(quant_gguf: Callable[[str], Path]) -> None:
    """llama q/k rows are stored RoPE-interleaved: the packed rows must come back un-interleaved,
    i.e. equal to the loader's own dequantized (and permuted) float tensor."""
    from tokenmill.models.loading.weights import load_checkpoint

    tensors = load_checkpoint(quant_gguf("llama"), "gguf").tensors
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        raw = tensors.quantized(name)
        assert raw is not None
        packed = gguf_quant.from_gguf(raw.data, raw.ggml_type, raw.shape[1], "q4")
        assert torch.equal(packed.dequantize(), tensors[name])


@pytest.mark.parametrize("fmt", ["q8", "q4", "q5"])
def test_safetensors_quantize_at_load(fmt: str, tiny_hf_dir: Callable[[str], Path]) -> None:
    llm, reference = _llm(tiny_hf_dir("qwen2"), fmt), _llm(tiny_hf_dir("qwen2"), "none")
    assert {linear.method for linear in llm.core.runner.model.linears().values()} == {fmt}
    prompt = _prompt(24, seed=5)
    ours, ref = engine_prompt_logits(llm, prompt), engine_prompt_logits(reference, prompt)
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < {"q8": 0.05, "q5": 0.15, "q4": 0.3}[fmt]
    assert _llm(tiny_hf_dir("qwen2"), "auto").core.runner.model.lm_head.method.startswith(("aten", "native"))


def test_unsupported_type_names_itself_and_falls_back_once(
        quant_gguf: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    mapping = {t: v for t, v in gguf_quant.GGUF_MAPPING.items() if t != T.Q4_1}
    monkeypatch.setattr(gguf_quant, "GGUF_MAPPING", mapping)
    monkeypatch.setattr(linear_module, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="tokenmill.layers.linear"):
        llm = _llm(quant_gguf("llama"), "auto")
    warnings = [r.getMessage() for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "tokenmill.layers.linear"]
    assert len(warnings) == 1 and "Q4_1" in warnings[0] and "dequantized" in warnings[0]
    methods = {name: lin.method for name, lin in llm.core.runner.model.linears().items()}
    assert not methods["layers.1.qkv_proj"].startswith("q")  # its q/k are Q4_1: the fused matrix goes dense
    assert methods["layers.0.qkv_proj"] == "q4+q8"


@pytest.mark.parametrize("ggml_type", [T.Q2_K, T.Q3_K], ids=lambda t: t.name)
def test_2_and_3_bit_k_quants_run_quantized(ggml_type: GGMLQuantizationType, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    """Q3_K_M / Q2_K files: no kernel reads 2-3 bits, and dense float32 would be ~10x the file. `auto` holds
    Q3_K exactly in q6, silently, and re-rounds Q2_K to q8 with one warning a type naming it and the first
    tensor; `none` keeps both dense."""
    from tests.fixtures.gguf_blocks import gguf_blocks
    from tokenmill.layers.linear import LinearConfig, WeightPart, choose_method

    raw = quant_formats.RawBlocks(ggml_type, (16, 256), gguf_blocks(ggml_type, 16, 256, seed=3))
    monkeypatch.setattr(linear_module, "_warned", set())
    config = LinearConfig(torch.float32, torch.device("cpu"), quantization="auto")
    with caplog.at_level(logging.WARNING, logger="tokenmill.layers.linear"):
        methods = [choose_method(WeightPart(f"w{i}", {}, raw), (16, 256), config) for i in range(3)]
    warnings = [r.getMessage() for r in caplog.records if r.name == "tokenmill.layers.linear"]
    if ggml_type == T.Q3_K:
        assert methods == ["q6"] * 3 and not warnings
    else:
        assert methods == ["q8"] * 3
        assert len(warnings) == 1 and ggml_type.name in warnings[0] and "w0" in warnings[0] and "q8" in warnings[0]
    none = LinearConfig(torch.float32, torch.device("cpu"), quantization="none")
    assert choose_method(WeightPart("w", {}, raw), (16, 256), none) == "dense"


def test_a_type_nothing_reads_is_a_load_error_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """IQ2_XXS (and the other IQ1-IQ3 codes) has neither a kernel nor a dequantizer here: the load stops with
    one error naming the file, the tensor and its type, and the files that work."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES

    from tests.fixtures import tiny_models
    from tokenmill.errors import ModelFormatError

    add = tiny_models._add_tensor

    def iq2_q_proj(writer: Any, name: str, data: Any, layer_types: Any) -> None:
        if name != "blk.0.attn_q.weight":
            return add(writer, name, data, layer_types)
        writer.add_tensor(name, np.zeros((data.shape[0], GGML_QUANT_SIZES[T.IQ2_XXS][1]), dtype=np.uint8),
                          raw_dtype=T.IQ2_XXS)

    monkeypatch.setattr(tiny_models, "_add_tensor", iq2_q_proj)
    path = tiny_models.make_tiny_gguf("llama", tmp_path / "iq2.gguf")
    with pytest.raises(ModelFormatError, match=r"'blk\.0\.attn_q\.weight' is IQ2_XXS.*IQ4_XS, Q4_K_M"):
        _llm(path, "auto")


def test_forced_isa_env(quant_gguf: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QUANT_ISA_ENV, "portable")
    linear = _llm(quant_gguf("qwen2"), "auto").core.runner.model.layers[0].qkv_proj
    assert isinstance(linear, QuantLinear) and linear.isa == 0
    monkeypatch.setenv(QUANT_ISA_ENV, "sse9")
    with pytest.raises(TokenmillError, match="not a quant ISA"):
        _llm(quant_gguf("qwen2"), "auto")
    missing = [isa for isa in ("avx2", "avx512vnni") if isa not in available_quant_isas()]
    if missing:
        monkeypatch.setenv(QUANT_ISA_ENV, missing[-1])
        with pytest.raises(TokenmillError, match="this CPU runs only"):
            _llm(quant_gguf("qwen2"), "auto")


def test_bad_quantization_is_a_clear_error() -> None:
    from tokenmill.config import ModelConfig

    with pytest.raises(TokenmillError, match="quantization 'q3' is not supported"):
        ModelConfig("smollm2-135m", quantization="q3")


def test_build_cache_is_keyed_by_instruction_set() -> None:
    """A home folder shared between CPUs must not hand one CPU's -march=native object to another."""
    avx2 = "processor : 0\nflags\t\t: fpu sse2 avx avx2 fma f16c bmi2 hypervisor\n"
    avx512 = avx2.replace("bmi2", "bmi2 avx512f avx512bw avx512vl avx512_vnni")
    assert cpu_flags(avx2) == {"sse2", "avx", "avx2", "fma", "f16c", "bmi2"}  # non-ISA flags ignored
    assert isa_key(cpu_flags(avx2), "x86_64") != isa_key(cpu_flags(avx512), "x86_64")
    assert isa_key(cpu_flags(avx2), "x86_64") == isa_key(cpu_flags(avx2 + "extra: hypervisor\n"), "x86_64")
    assert isa_key(cpu_flags(avx2), "x86_64") != isa_key(cpu_flags(avx2), "aarch64")
    module = quant_kernels()
    assert module is not None and isa_key() in module.__name__


def test_gateway_replicas_get_the_quantization_flag() -> None:
    from tokenmill.gateway.config import LocalReplicaConfig
    from tokenmill.gateway.local import LocalLauncher

    command = LocalLauncher(LocalReplicaConfig("m", ("--threads", "2"), quantization="q4")).command(9000)
    assert command[command.index("--quantization") + 1] == "q4" and command[-2:] == ["--threads", "2"]
    assert "--quantization" not in LocalLauncher(LocalReplicaConfig("m")).command(9000)
    with pytest.raises(TokenmillError, match="quantization 'q3' is not supported"):
        LocalReplicaConfig("m", quantization="q3")


def test_two_pass_activations_nearly_remove_the_rounding() -> None:
    module = quant_kernels()
    mat = quant_formats.quantize(torch.randn(48, 256), "q8")
    x = torch.randn(5, 256)
    exact = x.double() @ mat.dequantize().double().T
    errors = []
    for passes in (1, 2):
        linear = QuantLinear([mat], None, torch.float32, module, available_quant_isas()[-1], passes)
        assert linear.method == ("q8(1-pass)" if passes == 1 else "q8")
        errors.append((linear(x).double() - exact).abs().max().item())
    assert errors[1] < errors[0] / 50
    assert linear_module.ACTIVATION_PASSES == 2  # the default that passes the release gate
    with pytest.raises(ValueError, match="passes must be 1 or 2"):
        QuantLinear([mat], None, torch.float32, module, available_quant_isas()[-1], 3)


def test_amx_bf16_is_opt_in_and_never_reaches_the_lm_head(quant_gguf: Callable[[str], Path]) -> None:
    """By default every QuantLinear keeps the integer rounding at any row count (the same bits on every
    path, so batch composition never changes a token); --amx-bf16 / LLM(amx_bf16=True) lets all but
    the lm_head take the amx path's bf16 tiles from amx_bf16_rows() rows, and below that row count
    both answer alike."""
    from tokenmill.cli.main import build_parser

    path = quant_gguf("llama")
    default = _llm(path, "auto")
    fast = LLM(str(path), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256, quantization="auto",
               amx_bf16=True)
    quant = [lin for lin in default.core.runner.model.linears().values() if isinstance(lin, QuantLinear)]
    assert quant and not any(lin.bf16 for lin in quant)
    opted = {n: lin for n, lin in fast.core.runner.model.linears().items() if isinstance(lin, QuantLinear)}
    assert len(opted) == len(quant) and not opted["lm_head"].bf16
    assert all(lin.bf16 for n, lin in opted.items() if n != "lm_head")
    prompt = _prompt(12, seed=3)  # 12 rows: under every AMX threshold, so both runs take the same kernels
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert (fast.generate([prompt], params)[0].outputs[0].token_ids
            == default.generate([prompt], params)[0].outputs[0].token_ids)
    for command in (["serve", "m", "--amx-bf16"], ["generate", "m", "hi", "--amx-bf16"]):
        assert build_parser().parse_args(command).amx_bf16
    assert not build_parser().parse_args(["serve", "m"]).amx_bf16
