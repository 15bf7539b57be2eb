"""The native kernels at another git revision against the working tree's, in one engine, alternating rounds.

A kernel change's effect on a real decode step is a few percent, and this VM's speed moves by more
than that between processes, so both builds run in one process on one loaded model: the four
kernel modules (cpu, glue, quant, stack) are built from `--base` (default HEAD) under their own
cached names, every quantized linear gets a plan from each quant module (the lm_head's too), and
each round switches the model's plans and native decoder stack between the two builds, `--rounds`
times, their order alternating. Printed and saved: each round's median step time per build and
the median of the per-round ratios (> 1: the working tree is faster); greedy tokens of the two
builds are compared (a kernel change that reorders float sums may legitimately flip a near-tie,
so a difference is reported, not fatal).

    flock /tmp/tokenmill-bench.lock python benchmarks/kernel_ab.py --model smollm2-135m --batch 1
    flock /tmp/tokenmill-bench.lock python benchmarks/kernel_ab.py --base HEAD~3 --model qwen2.5-coder-0.5b

`--query-rows K` times a speculative verification's step instead: one request with `--prompt-len` tokens of
context scoring K query rows (the last token and K - 1 proposals), `--output-len` such steps a round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common

SOURCES = ("cpu_kernels.cpp", "glue_kernels.cpp", "quant_kernels.cpp", "stack_kernels.cpp", "attention_avx512.h",
           "c_api.h", "prefill_avx512.h", "quant_amx.h", "quant_vnni.h")
KERNELS = Path("tokenmill") / "kernels"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default="HEAD", help="git revision whose kernel sources are the baseline")
    p.add_argument("--model", default="smollm2-135m", type=_model,
                   help=f"one of {', '.join(CATALOG)}, or a .gguf file (e.g. a Q5_K_M made with llama-quantize)")
    p.add_argument("--batch", type=int, default=1, help="requests decoding together")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128, help="tokens per request and round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tag", default="", help="suffix of the result file name (runs of one shape on one day "
                                              "otherwise overwrite each other)")
    p.add_argument("--base-q6-as-q8", action="store_true",
                   help="the base build's q6 layers (TOKENMILL_Q6_K=q6 loads) re-rounded to q8: the two formats A/B")
    p.add_argument("--base-q5-as-q8", action="store_true",
                   help="the base build's q5 layers with offsets (Q5_1, Q5_K) re-rounded to q8: the two formats A/B")
    p.add_argument("--base-iq4-as-q8", action="store_true",
                   help="the base build's iq4 layers (IQ4_NL, IQ4_XS) unpacked to q8 through their tables (exact)")
    p.add_argument("--query-rows", type=int, default=0,
                   help="time one request's verification step of this many query rows instead of decoding")
    args = p.parse_args()
    if args.query_rows and args.batch != 1:
        p.error("--query-rows times one request: leave --batch at 1")
    return args


CATALOG = (*common.MODELS, "qwen2.5-coder-1.5b", "gemma3-270m")


def _model(value: str) -> str:
    if value in CATALOG or (value.endswith(".gguf") and Path(value).is_file()):
        return value
    raise argparse.ArgumentTypeError(f"{value!r}: not one of {', '.join(CATALOG)}, nor a .gguf file")


def base_sources(revision: str, into: Path) -> str:
    """The kernel sources at `revision`, written into `into`; returns the revision's commit id."""
    commit = subprocess.run(["git", "rev-parse", "--short", revision], cwd=common.ROOT, check=True,
                            capture_output=True, text=True).stdout.strip()
    for name in SOURCES:
        shown = subprocess.run(["git", "show", f"{commit}:{(KERNELS / name).as_posix()}"], cwd=common.ROOT,
                               capture_output=True)
        if shown.returncode != 0 and name.endswith(".h"):
            shown.stdout = b""  # a header split out after `revision`: its code is still in the .cpp there
        elif shown.returncode != 0:
            raise SystemExit(f"{name} at {commit}: {shown.stderr.decode().strip()}")
        (into / name).write_bytes(shown.stdout)
    return commit


class Build:
    """One build's plans (one per quantized linear) and native decoder stack over a loaded model."""

    def __init__(self, model: Any, modules: dict[str, Any], q6_as_q8: bool = False, q5_as_q8: bool = False,
                 iq4_as_q8: bool = False) -> None:
        from tokenmill.layers import linear_layers
        from tokenmill.layers.linear import QuantLinear
        from tokenmill.models.native_stack import stack_over

        # A build that predates super lanes (Q4_K's two levels, q6) gets each layer as it used to load it (float32
        # lanes, Q6_K as q8): an A/B across those changes then also measures the bytes they saved. `q6_as_q8`:
        # this build's q6 layers re-rounded to q8 (an A/B of the two formats under one build); `q5_as_q8` likewise
        # its q5 layers with offsets (Q5_1, Q5_K).
        legacy = "supers" not in (modules["quant"].QuantPlan.__init__.__doc__ or "")
        convert: Callable[[Any], Any] | None = None
        if legacy:
            convert = linear_layers.legacy_segment
        elif q6_as_q8 or q5_as_q8 or iq4_as_q8:
            def convert(segment: Any) -> Any:
                if iq4_as_q8:
                    segment = linear_layers.iq4_as_q8(segment)
                if q5_as_q8:
                    segment = linear_layers.q5_offsets_as_q8(segment)
                return linear_layers.q6_as_q8(segment) if q6_as_q8 else segment
        self.plans = {name: lin.plan_from(modules["quant"], convert)
                      for name, lin in model.linears().items() if isinstance(lin, QuantLinear)}
        by_layer = {id(lin): self.plans[name] for name, lin in model.linears().items() if name in self.plans}
        self.stack = stack_over(model, modules["stack"], modules["glue"], modules["module"], modules["quant"],
                                lambda lin: by_layer[id(lin)])

    def install(self, model: Any) -> None:
        for name, lin in model.linears().items():
            if name in self.plans:
                lin.plan = self.plans[name]
        model.native_stack = self.stack


def decode_round(llm: Any, prompts: list[list[int]], output_len: int, tag: str) -> tuple[float, list[list[int]]]:
    """Median seconds of the steps where every request decodes, and each request's tokens."""
    from tokenmill.engine.loader import eos_ids
    from tokenmill.engine.request import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        llm.core.add_request(request_id, prompt, params, eos_ids(llm.loaded))
    times, tokens = [], {request_id: [] for request_id in ids}
    while llm.core.has_unfinished:
        started = time.perf_counter()
        result = llm.core.step()
        if result.stats.num_scheduled_tokens == len(prompts):
            times.append(time.perf_counter() - started)
        for out in result.outputs:
            tokens[out.request_id].extend(out.new_token_ids)
    return statistics.median(times), [tokens[request_id] for request_id in ids]


class VerifyRounds:
    """Steps of one request scoring `rows` query rows over `prompt` (already prefilled): the shape of a
    speculative verification, the proposals the prompt's own tokens (any ids score alike)."""

    def __init__(self, llm: Any, prompt: list[int], rows: int) -> None:
        from tokenmill.engine.interfaces import ScheduledRequest, SchedulerOutput
        from tokenmill.engine.request import Request, SamplingParams

        self.runner = llm.core.runner
        request = Request("verify", prompt, SamplingParams(max_tokens=rows + 1, temperature=0.0))
        llm.core.kv.allocate(request, len(prompt) + rows)
        blocks = list(llm.core.kv.block_tables["verify"])
        self.runner.execute(SchedulerOutput([ScheduledRequest(request, 0, len(prompt), blocks)]))
        proposals = [prompt[j % len(prompt)] for j in range(rows - 1)]
        self.step = SchedulerOutput([ScheduledRequest(request, len(prompt) - 1, rows, blocks, proposals)])

    def __call__(self, steps: int) -> tuple[float, list[list[int]]]:
        """Median seconds a step, and the tokens the last step's rows sampled."""
        times = []
        for _ in range(steps):
            started = time.perf_counter()
            out = self.runner.execute(self.step)
            times.append(time.perf_counter() - started)
        return statistics.median(times), [list(out.sampled["verify"].token_ids)]


def main() -> None:
    args = parse_args()
    from tokenmill import kernels
    from tokenmill.llm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        commit = base_sources(args.base, Path(tmp))
        base_modules = {key: kernels.build_variant(key, Path(tmp), f"ab{commit}")
                        for key in ("module", "glue", "quant", "stack")}
    new_modules = {"module": kernels.cpu_kernels(), "glue": kernels.glue_kernels(), "quant": kernels.quant_kernels(),
                   "stack": kernels.stack_kernels()}
    if any(m is None for m in (*base_modules.values(), *new_modules.values())):
        raise SystemExit("kernel_ab: a kernel module did not build (see the warning above)")
    blocks = args.batch * (-(-(args.prompt_len + args.output_len + 16) // 16)) + 8
    llm = LLM(args.model, dtype="float32", num_threads=args.threads, max_num_seqs=args.batch, num_kv_blocks=blocks)
    model = llm.core.runner.model
    if model.native_stack is None:
        raise SystemExit(f"kernel_ab: {args.model} does not run the native decoder stack here")
    builds = {"base": Build(model, base_modules, args.base_q6_as_q8, args.base_q5_as_q8, args.base_iq4_as_q8),
              "new": Build(model, new_modules)}
    prompts = common.build_prompts(llm.tokenizer.encode, args.batch, args.prompt_len, common.prompt_bos(llm.tokenizer))
    verify = VerifyRounds(llm, prompts[0], args.query_rows) if args.query_rows else None

    def run_round(tag: str, output_len: int) -> tuple[float, list[list[int]]]:
        return verify(output_len) if verify is not None else decode_round(llm, prompts, output_len, tag)

    for name, build in builds.items():  # warm-up: caches, first-touch pages, the step-time fits
        build.install(model)
        run_round(f"warm-{name}", 8)
    steps: dict[str, list[float]] = {"base": [], "new": []}
    tokens: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
            builds[name].install(model)
            step_s, tokens[name] = run_round(f"{name}-{r}", args.output_len)
            steps[name].append(step_s)
        print(f"round {r}: base {steps['base'][-1] * 1e3:.2f} ms, new {steps['new'][-1] * 1e3:.2f} ms, "
              f"base/new {steps['base'][-1] / steps['new'][-1]:.3f}", flush=True)
    builds["new"].install(model)
    ratios = [b / n for b, n in zip(steps["base"], steps["new"], strict=True)]
    same = tokens["base"] == tokens["new"]
    summary = {"base_commit": commit, "batch": args.batch, "query_rows": args.query_rows, "prompt_len": args.prompt_len,
               "output_len": args.output_len, "rounds": args.rounds, "base_step_s": steps["base"],
               "new_step_s": steps["new"], "median_ratio": statistics.median(ratios), "same_tokens": same}
    shape = f"{args.query_rows} query rows" if args.query_rows else f"batch {args.batch}"
    print(f"{args.model} {shape}: base ({commit}) {statistics.median(steps['base']) * 1e3:.2f} ms, "
          f"working tree {statistics.median(steps['new']) * 1e3:.2f} ms a step; median base/new "
          f"{summary['median_ratio']:.3f}; greedy tokens {'identical' if same else 'differ'}")
    shape = f"q{args.query_rows}" if args.query_rows else f"b{args.batch}"
    name = Path(args.model).name.removesuffix(".gguf")
    common.save_json("kernel_ab", f"{name}_{shape}_p{args.prompt_len}{'_' + args.tag if args.tag else ''}", summary)


if __name__ == "__main__":
    main()
