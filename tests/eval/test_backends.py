"""Both backends on the tiny model: the HTTP one against a live tokenmill server, the engine one in
process; they must report the same tokens and (to float noise) the same logprobs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.conftest import MODEL, LiveServer
from tokenmill.eval.client import EvalError, GenerateOptions, open_backend, parse_spec, with_common_dtype
from tokenmill.eval.engine_backend import EngineBackend, engine_kwargs
from tokenmill.eval.http_backend import HttpBackend


@pytest.fixture(scope="module")
def engine_backend(tiny_model_dir: Path) -> EngineBackend:
    return EngineBackend(str(tiny_model_dir), {"dtype": "float32", "device": "cpu", "num_kv_blocks": 128})


def test_server_names_tokens_by_id_when_asked(live: LiveServer) -> None:
    backend = HttpBackend(live.url)
    assert backend.model == MODEL
    prompt = [backend.prefix_token(), *backend.tokenize("hello world, hello")]
    positions = backend.score([prompt], top_k=5)[0]
    assert [p.token for p in positions] == prompt[1:]  # ids, not text
    assert all(isinstance(k, int) for p in positions for k in p.top)
    assert all(len(p.top) >= 5 for p in positions)
    generated = backend.generate(["hello"], GenerateOptions(max_tokens=6))[0]
    assert generated.token_ids is not None and len(generated.token_ids) == 6


def test_http_and_engine_backends_agree(live: LiveServer, engine_backend: EngineBackend) -> None:
    http = HttpBackend(live.url)
    text = "The quick brown fox jumps over the lazy dog."
    assert http.tokenize(text) == engine_backend.tokenize(text)
    assert http.prefix_token() == engine_backend.prefix_token()
    prompt = [http.prefix_token(), *http.tokenize(text)]
    over_http = http.score([prompt], top_k=3)[0]
    in_process = engine_backend.score([prompt], top_k=3)[0]
    for a, b in zip(over_http, in_process, strict=True):
        assert a.token == b.token
        assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
    options = GenerateOptions(max_tokens=8)
    assert http.generate([text], options)[0].token_ids == engine_backend.generate([text], options)[0].token_ids


def test_specs_and_engine_options() -> None:
    assert parse_spec("http://127.0.0.1:8000").url == "http://127.0.0.1:8000"
    spec = parse_spec("model=smollm2-135m,quantization=none,max-num-seqs=8,enable_prefix_caching=false")
    assert spec.model == "smollm2-135m"
    assert spec.options == {"quantization": "none", "max_num_seqs": 8, "enable_prefix_caching": False}
    url = parse_spec("http://h:1,model=m,concurrency=2")
    assert (url.url, url.model, url.options) == ("http://h:1", "m", {"concurrency": 2})
    with pytest.raises(EvalError):
        parse_spec("smollm2-135m")  # neither a URL nor model=
    with pytest.raises(EvalError):
        open_backend(parse_spec("http://h:1,bogus=1"))
    # The defaults of options this engine may not have yet are dropped; anything else unknown is an error.
    assert engine_kwargs({"quantization": "none", "kv_cache_dtype": "auto", "dtype": "float32"})["dtype"] == "float32"
    with pytest.raises(EvalError, match="no option 'warp_drive'"):
        engine_kwargs({"warp_drive": 9})


def test_a_comparison_pins_float32_where_the_cpu_would_run_a_dense_side_in_bf16() -> None:
    """On a bf16 CPU a dense reference runs bf16 (and a bf16 KV cache) while quantized GGUF weights run
    float32 activations: unless a spec names a dtype, both sides get float32, so a quant gate measures the
    quantization. Elsewhere, or with a dtype named, or over HTTP, the specs stay as given."""
    ref, cand = parse_spec("model=m,quantization=none"), parse_spec("model=m,quantization=auto")
    pinned_ref, pinned_cand, note = with_common_dtype(ref, cand, cpu_auto_bf16=True)
    assert pinned_ref.options["dtype"] == pinned_cand.options["dtype"] == "float32"
    assert pinned_ref.options["quantization"] == "none" and note is not None and "float32" in note
    assert with_common_dtype(ref, cand, cpu_auto_bf16=False) == (ref, cand, None)
    named = parse_spec("model=m,quantization=auto,dtype=bfloat16")
    assert with_common_dtype(ref, named, cpu_auto_bf16=True) == (ref, named, None)
    http = parse_spec("http://h:1,model=m")
    assert with_common_dtype(http, cand, cpu_auto_bf16=True) == (http, cand, None)
    gpu = parse_spec("model=m,device=cuda")
    assert with_common_dtype(gpu, cand, cpu_auto_bf16=True) == (gpu, cand, None)
