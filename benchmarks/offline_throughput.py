"""Offline throughput: tokenmill's continuous batching against Hugging Face transformers `generate`.

Every system gets the same prompts (token ids, exactly --prompt-len each) and must produce exactly
--output-len tokens per prompt (greedy, EOS ignored); wall time includes prefill. Peers run one
after another in this process, never concurrently, on the same pinned thread count:

  tokenmill      all prompts in one `LLM.generate` call (--dtype, default auto)
  hf_serial      `generate` one prompt at a time, on the first --hf-sample prompts
  hf_batch16     `generate` on static batches of 16, left-padded with an attention mask

The peer computes in the dtype tokenmill resolved (--hf-dtype same): `auto` is bf16 only where
the CPU has native bf16 (AVX512-BF16/AMX); on AVX2-only CPUs bf16 matmuls are emulated and ~50x
slower, and a bf16 peer there would flatter the ratios.

Throughput is output tokens per second, so measuring the slow serial peer on a subset is fair.
Targets: tokenmill/hf_serial >= 10x, tokenmill/hf_batch16 >= 2x.

    python benchmarks/offline_throughput.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import gc
from dataclasses import asdict, dataclass, field
from typing import Any

import common

TARGET_VS_SERIAL = 10.0
TARGET_VS_BATCH = 2.0


@dataclass(slots=True)
class Phase:
    name: str
    num_prompts: int
    num_output_tokens: int
    elapsed_s: float
    dtype: str
    others_cores: float  # CPU used by other processes meanwhile (noise)
    load_s: float = 0.0
    attempts_others_cores: list[float] = field(default_factory=list)  # noise of every try; the quietest is kept

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.workload_arguments(p)
    p.add_argument("--hf-sample", type=int, default=8, help="prompts for the one-at-a-time peer")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="tokenmill's dtype")
    p.add_argument("--hf-dtype", default="same", choices=["same", "float32", "bfloat16"],
                   help="the peer's dtype; same: the dtype tokenmill resolved")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="tokenmill's per-step token budget")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quiet-wait-s", type=float, default=120.0, help="wait this long for other load to settle")
    p.add_argument("--attempts", type=int, default=3, help="reruns of a phase that others disturbed")
    p.add_argument("--noise-limit", type=float, default=0.1, help="cores others may use during a valid phase")
    p.add_argument("--skip-hf", action="store_true", help="measure tokenmill only")
    return p.parse_args()


def run_tokenmill(args: argparse.Namespace, prompts: list[list[int]],
                  warmup: list[list[int]]) -> tuple[Phase, list[list[int]], Any]:
    from tokenmill.engine.request import SamplingParams
    from tokenmill.llm import LLM

    block_size = 16
    blocks_per_seq = -(-(args.prompt_len + args.output_len) // block_size)
    with common.Timer() as load:
        llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, max_num_seqs=len(prompts),
                  max_num_batched_tokens=args.max_num_batched_tokens, block_size=block_size,
                  num_kv_blocks=blocks_per_seq * (len(prompts) + len(warmup)) + 8)
    # Warm-up on other prompts than the timed ones: no prefix-cache hits leak into the run.
    llm.generate(warmup, SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    dtype = str(llm.core.runner.dtype).removeprefix("torch.")

    def attempt() -> tuple[Phase, list[list[int]]]:
        if not llm.core.kv.reset_prefix_cache():  # a rerun must not hit the previous run's blocks
            raise RuntimeError("prefix cache still holds blocks after a finished run")
        noise = common.NoiseMeter()
        with common.Timer() as t:
            outs = llm.generate(prompts, params)
        token_ids = [list(o.outputs[0].token_ids) for o in outs]
        return Phase("tokenmill", len(prompts), sum(map(len, token_ids)), t.elapsed_s, dtype,
                     noise.others_cores(), load.elapsed_s), token_ids

    (phase, token_ids), noises = common.quietest(attempt, lambda r: r[0].others_cores, args.attempts,
                                                 args.noise_limit, args.quiet_wait_s)
    phase.attempts_others_cores = noises
    return phase, token_ids, llm.tokenizer


def load_hf(model: str, dtype_name: str) -> tuple[Any, float]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from tokenmill.models.resolve import resolve_model

    # Its GGUF loader warns that packed weights want float32, but for llama/qwen2 it dequantizes
    # into plain Linear layers of `dtype` (recorded by `describe_hf`); silence the misleading warning.
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    path = resolve_model(model).path
    with common.Timer() as t:
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                  dtype=getattr(torch, dtype_name))
    hf.eval()
    return hf, t.elapsed_s


def describe_hf(hf: Any) -> dict[str, Any]:
    """What the peer really runs: layer class, weight dtypes and bytes, attention implementation."""
    linear = hf.model.layers[0].mlp.down_proj
    params = list(hf.parameters())
    return {"linear_class": type(linear).__name__, "weight_dtypes": sorted({str(p.dtype) for p in params}),
            "param_bytes": sum(p.numel() * p.element_size() for p in params),
            "attn_implementation": hf.config._attn_implementation}


def hf_generate(hf: Any, batch: list[list[int]], new_tokens: int, pad_id: int) -> list[list[int]]:
    """Greedy `generate` on a left-padded batch; exactly `new_tokens` new ids per row."""
    import torch

    width = max(map(len, batch))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.inference_mode():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                          min_new_tokens=new_tokens, pad_token_id=pad_id, temperature=None, top_p=None,
                          top_k=None)
    return [row[width:].tolist() for row in out]


def run_hf(hf: Any, name: str, prompts: list[list[int]], batch_size: int, new_tokens: int, pad_id: int,
           args: argparse.Namespace) -> tuple[Phase, list[list[int]]]:
    dtype = str(hf.dtype).removeprefix("torch.")

    def attempt() -> tuple[Phase, list[list[int]]]:
        noise = common.NoiseMeter()
        outputs: list[list[int]] = []
        with common.Timer() as t:
            for start in range(0, len(prompts), batch_size):
                outputs += hf_generate(hf, prompts[start:start + batch_size], new_tokens, pad_id)
        return Phase(name, len(prompts), sum(map(len, outputs)), t.elapsed_s, dtype, noise.others_cores()), outputs

    (phase, outputs), noises = common.quietest(attempt, lambda r: r[0].others_cores, args.attempts,
                                               args.noise_limit, args.quiet_wait_s)
    phase.attempts_others_cores = noises
    return phase, outputs


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict[str, float]:
    """Greedy agreement: how many leading tokens match (rounding may fork a greedy path late)."""
    from tokenmill.eval.metrics import common_prefix

    prefixes = [common_prefix(a, b) for a, b in zip(ours, theirs, strict=False)]
    return {"num_compared": len(prefixes), "median_matching_prefix": common.Stats.of(prefixes).median,
            "fully_identical": sum(a == b for a, b in zip(ours, theirs, strict=False))}


def plot(phases: list[Phase], ratios: dict[str, float], model: str) -> None:
    fig, ax, path = common.new_figure("offline_throughput", model)
    names = [p.name for p in phases]
    values = [p.tokens_per_s for p in phases]
    bars = ax.bar(names, values, color=["#2a9d8f", "#e76f51", "#f4a261"][: len(phases)])
    for bar, value in zip(bars, values, strict=True):
        ax.annotate(f"{value:.1f}", (bar.get_x() + bar.get_width() / 2, value), ha="center", va="bottom")
    ax.set_ylabel("output tokens / s")
    ratio_text = ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items())
    dtypes = "/".join(dict.fromkeys(p.dtype for p in phases))
    ax.set_title(f"offline throughput, {model}, {dtypes}, 2 threads\n{ratio_text}")
    common.save_figure(fig, path)


def main() -> None:
    args = parse_args()
    common.pin_threads(args.threads)
    phases: list[Phase] = []
    ours, tokenizer = _tokenmill_phase(args, phases)
    prompts = ours["prompts"]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_ids[0]
    checks: dict[str, Any] = {}
    if not args.skip_hf:
        hf_dtype = phases[0].dtype if args.hf_dtype == "same" else args.hf_dtype
        hf, hf_load_s = load_hf(args.model, hf_dtype)
        checks["hf_model"] = describe_hf(hf)
        hf_generate(hf, ours["warmup"], 4, pad_id)
        sample = prompts[: args.hf_sample]
        serial, serial_out = run_hf(hf, "hf_serial", sample, 1, args.output_len, pad_id, args)
        serial.load_s = hf_load_s
        batched, batched_out = run_hf(hf, f"hf_batch{args.hf_batch_size}", prompts, args.hf_batch_size,
                                      args.output_len, pad_id, args)
        phases += [serial, batched]
        checks["greedy_agreement"] = {"tokenmill_vs_hf_serial": agreement(ours["outputs"], serial_out),
                                      "hf_batch_vs_hf_serial": agreement(batched_out, serial_out)}
        del hf
        gc.collect()
    report(args, phases, checks)


def _tokenmill_phase(args: argparse.Namespace, phases: list[Phase]) -> tuple[dict[str, Any], Any]:
    from tokenmill.engine.loader import load_tokenizer
    from tokenmill.models.resolve import resolve_model

    tokenizer = load_tokenizer(resolve_model(args.model))
    # Two extra prompts for warm-up, never timed.
    everything = common.build_prompts(tokenizer.encode, args.num_prompts + 2, args.prompt_len,
                                      common.prompt_bos(tokenizer))
    prompts, warmup = everything[: args.num_prompts], everything[args.num_prompts:]
    phase, outputs, tokenizer = run_tokenmill(args, prompts, warmup)
    phases.append(phase)
    gc.collect()  # the LLM is dropped here, before the peer loads its copy of the weights
    return {"prompts": prompts, "warmup": warmup, "outputs": outputs}, tokenizer


def report(args: argparse.Namespace, phases: list[Phase], checks: dict[str, Any]) -> None:
    rows = [(p.name, p.dtype, p.num_prompts, p.num_output_tokens, p.elapsed_s, p.tokens_per_s, p.others_cores)
            for p in phases]
    print(f"\nmodel {args.model}: {args.num_prompts} prompts x {args.prompt_len} tokens -> {args.output_len} "
          f"tokens each, {args.threads} threads")
    common.print_table(["system", "dtype", "prompts", "out tokens", "wall s", "out tok/s", "others' cores"], rows)
    ratios: dict[str, float] = {}
    ours = phases[0].tokens_per_s
    targets = {"hf_serial": TARGET_VS_SERIAL, f"hf_batch{args.hf_batch_size}": TARGET_VS_BATCH}
    for p in phases[1:]:
        ratios[f"tokenmill/{p.name}"] = ours / p.tokens_per_s
        print(f"tokenmill/{p.name}: {common.verdict(ours / p.tokens_per_s, targets.get(p.name, 1.0))}")
    if len(phases) > 1:
        print(f"(hf_serial ran on {args.hf_sample} of the {args.num_prompts} prompts: the ratio compares "
              "throughputs, tokens/s, so a subset is fair)")
    for name, check in checks.get("greedy_agreement", {}).items():
        print(f"greedy agreement {name}: {check}")
    if "hf_model" in checks:
        print(f"peer model: {checks['hf_model']}")
    common.save_json("offline_throughput", args.model, {
        "config": vars(args), "phases": [{**asdict(p), "tokens_per_s": p.tokens_per_s} for p in phases],
        "ratios": ratios, "targets": {f"tokenmill/{k}": v for k, v in targets.items()}, **checks,
    })
    plot(phases, ratios, args.model)


if __name__ == "__main__":
    main()
