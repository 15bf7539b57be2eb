"""GPU check (run on a CUDA machine, ~4 minutes): the engine's CUDA path, its tests, parity and speed.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py [OUT_DIR] [--quick] [--only SECTION,SECTION]
    GPU_CHECK_DEVICE=cpu TRITON_INTERPRET=1 python benchmarks/gpu_check.py /tmp/out --tiny --quick  # dry run on CPU

1. Device facts and ceilings: name, torch/triton versions, device-to-device copy bandwidth (bytes
   read + written per second) and a read-only pass (torch.sum over the same bytes).
2. The CUDA tests: tests/unit/test_triton_attention.py and tests/engine/test_cuda_graphs.py, run by
   pytest on the GPU (the Triton kernel compiled, graphs captured and replayed against eager steps).
3. Parity: tiny random llama / qwen2 / gemma3 checkpoints, tokenmill on CUDA (fp32, CUDA graphs on)
   against transformers on CUDA: greedy tokens for 32 steps, and the same with --enforce-eager.
4. Decode attention: the Triton paged kernel against gather + SDPA (the path without it), Qwen2.5-1.5B
   heads (12 q / 2 kv x 128, bf16), batch 1 / 32 / 128 at 512 / 2048 / 8192 tokens of context.
5. Decode speed: a random Qwen2.5-1.5B-shaped Qwen2 model in bf16. Decode tokens/s at batch 1, 8, 32
   and 128 for tokenmill with CUDA graphs (asynchronous scheduling on, and off as by default),
   tokenmill eager, and transformers `generate` (the same
   prompts; decode time = time(1 + D tokens) - time(1 token), prefix caching off); the fraction of
   the HBM roofline = weight bytes per step x steps per second / measured copy bandwidth; and the
   forward alone (one graph replay, no host work) per batch.
6. Speculation (gpu_spec_check.py): batch 1 and 8, each request predicting its own greedy answer
   (predicted outputs, K = 7): the speed-up ceiling of an 8-row verification over a one-row decode here.
Writes gpu_check.json to OUT_DIR after every section (a timeout keeps what finished).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpu_spec_check import speculation_ceiling  # type: ignore[import-not-found]  # noqa: E402

from tests.fixtures.tiny_models import make_tiny_hf  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402

DEVICE = os.environ.get("GPU_CHECK_DEVICE", "cuda")
DTYPE = "bfloat16" if DEVICE == "cuda" else "float32"
TINY = "--tiny" in sys.argv  # small shapes: a dry run of the whole script in seconds
REPORT: dict[str, Any] = {}
OUT = Path(".")


def _save() -> None:
    (OUT / "gpu_check.json").write_text(json.dumps(REPORT, indent=1))


ONLY: set[str] = set()


def section(name: str, fn: Callable[[], Any]) -> None:
    if ONLY and name not in ONLY:
        return
    started = time.perf_counter()
    try:
        REPORT[name] = fn()
    except Exception as e:  # one broken section must not lose the others
        REPORT[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    gc.collect()  # the section's engine (weights, KV cache, graph pools) goes before the next loads
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    print(f"== {name} ({time.perf_counter() - started:.1f} s)\n{json.dumps(REPORT[name], indent=1)}", flush=True)
    _save()


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _time_cuda(fn: Callable[[], Any], repeats: int) -> float:
    """Seconds per call, by CUDA events around `repeats` calls after two warm-ups."""
    for _ in range(2):
        fn()
    if DEVICE != "cuda":
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t) / repeats
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / repeats


def device_facts() -> dict[str, Any]:
    import triton

    n = 1 << (20 if TINY else 30)  # 2 GiB of bf16 each way
    src = torch.empty(n, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    copy_s = _time_cuda(lambda: dst.copy_(src), 10)
    read_s = _time_cuda(lambda: src.sum(dtype=torch.float32), 10)
    facts: dict[str, Any] = {"device": DEVICE}
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts = {"device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
                 "memory_gib": round(props.total_memory / 2**30, 1)}
    return {**facts, "torch": torch.__version__,
            "triton": triton.__version__, "copy_bytes_per_s": 2 * src.nbytes / copy_s,
            "read_bytes_per_s": src.nbytes / read_s}


def cuda_tests() -> dict[str, Any]:
    # Only the CUDA cases: the CPU ones would spend device time building the CPU kernels.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           *os.environ.get("GPU_CHECK_TESTS", "tests/unit/test_triton_attention.py tests/unit/test_triton_glue.py "
                           "tests/engine/test_cuda_graphs.py::test_cuda_graph_replay_equals_eager_on_gpu").split()]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    return {"returncode": proc.returncode, "summary": tail[-1] if tail else "", "failures": [
        line for line in tail if line.startswith(("FAILED", "ERROR"))][:20],
        "tail": "\n".join(tail[-40:]) if proc.returncode else ""}


def parity(root: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    results: dict[str, Any] = {}
    for arch in ("llama", "qwen2", "gemma3"):
        path = make_tiny_hf(arch, root / arch)  # type: ignore[arg-type]
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(DEVICE).eval()
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (23, 5, 40)]
        refs = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=DEVICE)
            with torch.no_grad():
                for _ in range(32):
                    ids = torch.cat([ids, hf(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
            refs.append(ids[0, len(prompt):].tolist())
        entry: dict[str, Any] = {}
        for eager in (False, True):
            llm = LLM(str(path), dtype="float32", device=DEVICE, num_kv_blocks=64, max_model_len=256,
                      enforce_eager=eager)
            outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
            graphs = llm.core.runner.graphs
            entry["eager" if eager else "graphs"] = {
                "greedy_equal": [o.outputs[0].token_ids == r for o, r in zip(outs, refs, strict=True)],
                "replays": graphs.replays if graphs is not None else 0}
            del llm
        results[arch] = entry
    return results


def attention_kernels() -> dict[str, Any]:
    from tokenmill.kernels.triton_attention import paged_decode
    from tokenmill.layers.kv_cache import _gather

    heads, kv_heads, head_dim, block_size = 12, 2, 128, 16
    results = {}
    for batch in (1, 4) if TINY else (1, 32, 128):
        for ctx in (64, 256) if TINY else (512, 2048, 8192):
            blocks = ctx // block_size
            num_blocks = batch * blocks + 1
            k = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
            v = torch.randn_like(k)
            table = torch.randperm(num_blocks - 1, device=DEVICE)[:batch * blocks].view(batch, blocks)
            lens = torch.full((batch,), ctx, dtype=torch.int64, device=DEVICE)
            q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=DEVICE)
            scale = head_dim ** -0.5
            triton_s = _time_cuda(lambda: paged_decode(q, k, v, table, lens, scale, 0, 0.0), 20)  # noqa: B023

            def sdpa() -> torch.Tensor:
                keys, values = _gather(k, table), _gather(v, table)  # noqa: B023
                return torch.nn.functional.scaled_dot_product_attention(
                    q.unsqueeze(2), keys, values, scale=scale, enable_gqa=True)  # noqa: B023

            sdpa_s = _time_cuda(sdpa, 20)
            out = paged_decode(q, k, v, table, lens, scale, 0, 0.0).float()
            err = (out - sdpa().squeeze(2).float()).abs().max().item()
            kv_bytes = 2 * batch * ctx * kv_heads * head_dim * 2
            results[f"b{batch}_ctx{ctx}"] = {"triton_us": triton_s * 1e6, "gather_sdpa_us": sdpa_s * 1e6,
                                             "speedup": sdpa_s / triton_s, "max_abs_err": err,
                                             "triton_kv_bytes_per_s": kv_bytes / triton_s}
    return results


def random_qwen_1p5b(root: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if TINY else \
        dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28)
    config = Qwen2Config(vocab_size=151936, num_attention_heads=12 if not TINY else 4, num_key_value_heads=2,
                         max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1000000.0,
                         **shape)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    out = root / "qwen1.5b"
    model.save_pretrained(out)
    del model
    make_tiny_hf("qwen2", root / "tok")  # borrow a tokenizer.json (random ids stand in for text)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = root / "tok" / name
        if src.exists():
            (out / name).write_text(src.read_text())
    return out


BATCHES = (1, 3) if TINY else (1, 8, 32, 128)
PROMPT_LEN, DECODE = (8, 4) if TINY else (64, 64)


def _prompts(batch: int) -> list[list[int]]:
    return [torch.randint(100, 150000, (PROMPT_LEN,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(batch)]


def _decode_rate(generate: Callable[[int], Any], batch: int) -> float:
    """Decode tokens/s: (time of 1 + DECODE tokens) - (time of 1 token), the prefill cancelled out."""
    generate(2)  # warm-up
    times = {}
    for n in (1, 1 + DECODE):
        _sync()
        t = time.perf_counter()
        generate(n)
        _sync()
        times[n] = time.perf_counter() - t
    return batch * DECODE / (times[1 + DECODE] - times[1])


def tokenmill_speed(path: Path, copy_bw: float, eager: bool, glue: bool = True,
                    async_scheduling: str = "auto") -> dict[str, Any]:
    """`glue` False: the ATen glue ops instead of kernels/triton_glue.py (TOKENMILL_TRITON_GLUE=0).
    `async_scheduling`: "on" schedules step N + 1 while N runs (engine/pipeline.py); "off" (as "auto" now)
    steps synchronously."""
    os.environ["TOKENMILL_TRITON_GLUE"] = "1" if glue else "0"
    llm = LLM(str(path), dtype=DTYPE, device=DEVICE, max_num_seqs=max(BATCHES), max_model_len=512,
              enable_prefix_caching=False, enforce_eager=eager, async_scheduling=async_scheduling)
    os.environ.pop("TOKENMILL_TRITON_GLUE")
    runner = llm.core.runner
    weight_bytes = runner.model.weight_bytes()
    results: dict[str, Any] = {"weight_bytes": weight_bytes, "dtype": str(runner.dtype),
                               "attention": type(runner.model.attn.decode_kernel).__name__,
                               "triton_glue": runner.model.norm.triton_glue is not None}
    for batch in BATCHES:
        prompts = _prompts(batch)

        def generate(n: int) -> None:
            llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))  # noqa: B023

        rate = _decode_rate(generate, batch)
        entry: dict[str, Any] = {"tok_s": rate, "step_ms": 1000 * batch / rate,
                 "roofline_fraction": weight_bytes * rate / batch / copy_bw}
        if runner.graphs is not None:  # the forward alone: one replay of this batch's graph, no host work
            from tokenmill.engine.model_input import ModelInput

            key = (batch, runner.graphs.widths[0])
            ids, positions, meta = runner.graphs._views(*key)
            inp = ModelInput(ids, positions, meta, ids, [], [], graph_key=key)
            replay_s = _time_cuda(lambda: runner.graphs.replay(inp), 50)  # type: ignore[union-attr]  # noqa: B023
            entry["graph_replay_ms"] = replay_s * 1000
            entry["graph_replay_roofline_fraction"] = weight_bytes / replay_s / copy_bw
        if batch == 8:  # tokens to compare across configurations (bf16: rounding may part them late)
            outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
            entry["greedy_tokens"] = [o.outputs[0].token_ids for o in outs]
        results[f"b{batch}"] = entry
        print(f"tokenmill {'eager' if eager else 'graphs'} glue={glue} async={async_scheduling} batch {batch}: "
              f"{entry}", flush=True)
    return results


def transformers_speed(path: Path) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, DTYPE)).to(DEVICE).eval()
    results = {}
    for batch in BATCHES:
        ids = torch.tensor(_prompts(batch), device=DEVICE)

        def generate(n: int) -> None:
            with torch.no_grad():
                hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,  # noqa: B023
                            min_new_tokens=n, do_sample=False)

        results[f"b{batch}"] = {"tok_s": _decode_rate(generate, batch)}
        print(f"transformers batch {batch}: {results[f'b{batch}']}", flush=True)
    return results


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main() -> None:
    global OUT
    args = [a for a in sys.argv[1:2] if not a.startswith("--")]
    OUT = Path(args[0]) if args else Path(".")
    OUT.mkdir(parents=True, exist_ok=True)
    quick = "--quick" in sys.argv
    if "--only" in sys.argv:
        ONLY.update(sys.argv[sys.argv.index("--only") + 1].split(","))
    section("device", device_facts)
    copy_bw = REPORT["device"]["copy_bytes_per_s"] if "device" in REPORT else 4.28e12
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        section("parity", lambda: parity(root))
        path = random_qwen_1p5b(root)
        section("tokenmill_graphs", lambda: tokenmill_speed(path, copy_bw, eager=False, async_scheduling="on"))
        section("tokenmill_graphs_sync", lambda: tokenmill_speed(path, copy_bw, eager=False, async_scheduling="off"))
        section("tokenmill_graphs_aten_glue", lambda: tokenmill_speed(path, copy_bw, eager=False, glue=False))
        section("tokenmill_eager", lambda: tokenmill_speed(path, copy_bw, eager=True))
        section("transformers", lambda: transformers_speed(path))
        section("speculation", lambda: speculation_ceiling(path, DEVICE, DTYPE, (1, 8), DECODE, _prompts, _sync))
    section("attention", attention_kernels)
    if not quick:  # last: the slowest (pytest compiles every kernel variant the tests ask for)
        section("cuda_tests", cuda_tests)
    summary: dict[str, Any] = {}
    for batch in BATCHES:
        key = f"b{batch}"
        try:
            graphs = REPORT["tokenmill_graphs"][key]["tok_s"]
            summary[key] = {"graphs_tok_s": graphs,
                            "roofline_fraction": REPORT["tokenmill_graphs"][key]["roofline_fraction"]}
            for name, peer in (("async_vs_sync", "tokenmill_graphs_sync"),
                               ("glue_vs_aten_glue", "tokenmill_graphs_aten_glue"),
                               ("graphs_vs_eager", "tokenmill_eager"), ("graphs_vs_transformers", "transformers")):
                if isinstance(REPORT.get(peer), dict) and key in REPORT[peer]:
                    summary[key][name] = graphs / REPORT[peer][key]["tok_s"]
        except (KeyError, TypeError):
            continue
    try:
        same = [_common_prefix(a, b) for a, b in zip(REPORT["tokenmill_graphs"]["b8"]["greedy_tokens"],
                                                     REPORT["tokenmill_graphs_aten_glue"]["b8"]["greedy_tokens"],
                                                     strict=True)]
        summary["glue_vs_aten_common_prefix_of_32"] = same
    except (KeyError, TypeError):
        pass
    with contextlib.suppress(KeyError, TypeError):  # same kernels, same batches: no token may move
        summary["async_vs_sync_same_tokens"] = (REPORT["tokenmill_graphs"]["b8"]["greedy_tokens"]
                                                == REPORT["tokenmill_graphs_sync"]["b8"]["greedy_tokens"])
    with contextlib.suppress(KeyError, TypeError):  # predicted outputs at full acceptance: the ceiling
        summary["speculation_ceiling"] = {k: REPORT["speculation"][k]["ratio"] for k in ("b1", "b8")}
    REPORT["summary"] = summary
    print("== summary\n" + json.dumps(summary, indent=1), flush=True)
    _save()


if __name__ == "__main__":
    os.environ.setdefault("TOKENMILL_LOG_LEVEL", "WARNING")
    main()
