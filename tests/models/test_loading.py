"""Weight loading: a HF directory and a GGUF of the same tiny model agree, with each other and with
transformers' own GGUF loader; bad files fail with a one-line ModelFormatError."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.fixtures.tiny_models import TINY_ARCHS, TinyArch, make_tiny_gguf, tiny_vocab
from tokenmill.errors import ModelFormatError, TokenmillError
from tokenmill.models.arch import ArchConfig
from tokenmill.models.loading.gguf_header import UnreadArray, read_gguf_header
from tokenmill.models.loading.weights import Checkpoint, WeightFormat, load_checkpoint

PathFor = Callable[[TinyArch], Path]


@pytest.fixture(scope="module", params=TINY_ARCHS)
def both(request: pytest.FixtureRequest, tiny_hf_dir: PathFor, tiny_gguf_path: PathFor) -> tuple[Checkpoint, ...]:
    arch = request.param
    return load_checkpoint(tiny_hf_dir(arch), "hf"), load_checkpoint(tiny_gguf_path(arch), "gguf")


def test_formats_give_the_same_arch_config(both: tuple[Checkpoint, Checkpoint]) -> None:
    hf, from_gguf = both
    assert hf.arch == from_gguf.arch


def test_formats_give_the_same_tensors(both: tuple[Checkpoint, Checkpoint]) -> None:
    hf, from_gguf = both
    assert list(hf.tensors) == list(from_gguf.tensors)
    for name in hf.tensors:
        expected, actual = hf.tensors[name].float(), from_gguf.tensors[name].float()
        # Q8_0 rounds to 1/254 of a block's largest value, BF16 to 1/256 relative: 1% of the max is loose.
        tolerance = 0.01 * expected.abs().max().item()
        assert (expected - actual).abs().max().item() <= tolerance, name


def test_gguf_matches_transformers_gguf_loader(tiny_gguf_path: PathFor) -> None:
    from transformers import AutoModelForCausalLM

    for arch in TINY_ARCHS:
        path = tiny_gguf_path(arch)
        reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        state = reference.state_dict()
        ours = load_checkpoint(path, "gguf").tensors
        for name in ours:
            assert torch.equal(ours[name].float(), state[name]), f"{arch}: {name}"


def test_tiny_arch_configs_state_what_the_fixtures_built(tiny_gguf_path: PathFor) -> None:
    llama, qwen2, gemma3 = (load_checkpoint(tiny_gguf_path(arch), "gguf") for arch in TINY_ARCHS)
    assert llama.arch.tie_word_embeddings and "lm_head.weight" not in llama.tensors
    assert qwen2.arch.attention_bias and "model.layers.1.self_attn.v_proj.bias" in qwen2.tensors
    assert "lm_head.weight" in qwen2.tensors
    assert _gemma3_fields(gemma3.arch) == (32, 8, (True,) * 5 + (False, True), 10000.0, 1e6, 32.0)
    assert gemma3.arch.hidden_act == "gelu_pytorch_tanh"
    assert (llama.arch.bos_token_id, llama.arch.eos_token_ids) == (1, (2,))


def _gemma3_fields(arch: ArchConfig) -> tuple[object, ...]:
    return (
        arch.head_dim,
        arch.sliding_window,
        arch.layer_is_sliding,
        arch.rope_local_theta,
        arch.rope_theta,
        arch.query_pre_attn_scalar,
    )


def test_unquantized_gguf_tensors_are_views_of_the_file(tiny_gguf_path: PathFor) -> None:
    tensors = load_checkpoint(tiny_gguf_path("qwen2"), "gguf").tensors
    dtypes = {tensors[name].dtype for name in tensors}
    assert {torch.float32, torch.float16, torch.bfloat16} <= dtypes
    name = "model.layers.0.self_attn.o_proj.weight"  # stored F32
    assert tensors[name].data_ptr() == tensors[name].data_ptr()  # the same mapped bytes, not a copy


def test_header_decodes_only_the_string_arrays_asked_for(tiny_gguf_path: PathFor) -> None:
    path = tiny_gguf_path("llama")
    skipped = read_gguf_header(path).metadata["tokenizer.ggml.tokens"]
    decoded = read_gguf_header(path, string_arrays={"tokenizer.ggml.tokens"}).metadata["tokenizer.ggml.tokens"]
    assert skipped == UnreadArray(len(tiny_vocab()))
    assert decoded == tiny_vocab()


# ---- bad input ------------------------------------------------------------------------------------


def _format_error(path: Path, fmt: WeightFormat) -> str:
    with pytest.raises(ModelFormatError) as caught:
        load_checkpoint(path, fmt)
    message = str(caught.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("keep_fraction", [0.5, 0.99, 0.01])
def test_truncated_gguf(tiny_gguf_path: PathFor, tmp_path: Path, keep_fraction: float) -> None:
    data = tiny_gguf_path("gemma3").read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[: int(len(data) * keep_fraction)])
    assert "re-download" in _format_error(path, "gguf")


def test_corrupt_gguf_header(tiny_gguf_path: PathFor, tmp_path: Path) -> None:
    data = bytearray(tiny_gguf_path("llama").read_bytes())
    data[24:40] = b"\xff" * 16  # the first key's length becomes absurd
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(bytes(data))
    assert "corrupt" in _format_error(path, "gguf")


def test_absurd_array_length_fails_fast(tiny_gguf_path: PathFor, tmp_path: Path) -> None:
    data = bytearray(tiny_gguf_path("llama").read_bytes())
    key = b"tokenizer.ggml.tokens"
    count_at = data.index(key) + len(key) + 8  # after the value type and the item type (uint32 each)
    data[count_at : count_at + 8] = (1 << 60).to_bytes(8, "little")
    path = tmp_path / "huge.gguf"
    path.write_bytes(bytes(data))
    assert "corrupt" in _format_error(path, "gguf")


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("definitely not a model")
    assert "not a GGUF file" in _format_error(path, "gguf")


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "unsupported architecture 'mamba'" in _format_error(path, "gguf")


def test_gguf_missing_tensor(tmp_path: Path) -> None:
    path = make_tiny_gguf("qwen2", tmp_path / "partial.gguf", omit={"blk.1.ffn_up.weight"})
    assert "model.layers.1.mlp.up_proj.weight" in _format_error(path, "gguf")


def test_missing_gguf_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(TokenmillError, match="no such GGUF file"):
        load_checkpoint(tmp_path / "absent.gguf", "gguf")


def _copy_dir(tiny_hf_dir: PathFor, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_hf_dir("llama"), tmp_path / "model"))


def test_hf_missing_tensor(tiny_hf_dir: PathFor, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_hf_dir, tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.0.mlp.down_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    assert "model.layers.0.mlp.down_proj.weight" in _format_error(model_dir, "hf")


def test_hf_truncated_safetensors(tiny_hf_dir: PathFor, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_hf_dir, tmp_path)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert "re-download" in _format_error(model_dir, "hf")


def test_hf_unsupported_architecture(tiny_hf_dir: PathFor, tmp_path: Path) -> None:
    model_dir = _copy_dir(tiny_hf_dir, tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["MambaForCausalLM"], model_type="mamba")
    (model_dir / "config.json").write_text(json.dumps(config))
    assert "unsupported architecture" in _format_error(model_dir, "hf")


def test_hf_older_config_keys_and_multimodal_names(tiny_hf_dir: PathFor, tmp_path: Path) -> None:
    expected = load_checkpoint(tiny_hf_dir("gemma3"), "hf")
    model_dir = Path(shutil.copytree(tiny_hf_dir("gemma3"), tmp_path / "model"))
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("rope_parameters", "layer_types"):
        del config[key]
    config.update(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6)
    config.update(architectures=["Gemma3ForConditionalGeneration"])
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = load_file(model_dir / "model.safetensors")
    save_file({f"language_model.{name}": t for name, t in tensors.items()}, model_dir / "model.safetensors")
    legacy = load_checkpoint(model_dir, "hf")
    assert legacy.arch == expected.arch
    assert list(legacy.tensors) == list(expected.tensors)
