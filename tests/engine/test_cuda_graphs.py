"""Decode steps from CUDA graphs (engine/cuda_graphs.py).

On CPU the graphs run in "eager" mode: every replay re-runs the forward over the same static
buffers, so what is tested here is everything but the capture itself: staging a step into the
pinned/static buffers, padding to the batch bucket (padding rows write only the pad block), the
table-width buckets, and that the engine's tokens are exactly those of the plain path and of
transformers. With CUDA, the last test compares captured graphs with eager steps on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.tiny import (
    ARCH_NAMES,
    ArchName,
    TinyModel,
    greedy,
    hf_greedy,
    make_core,
    random_prompts,
    run_to_completion,
    tiny_model,
)
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from tokenmill.engine.core import EngineCore
from tokenmill.engine.cuda_graphs import batch_buckets, width_buckets
from tokenmill.engine.request import SamplingParams


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]
    assert width_buckets(2049, 16) == [128, 512, 2049]  # 2k, 8k tokens, then all 32k
    assert width_buckets(65, 16) == [65]
    assert width_buckets(65, 4, step_tokens=16) == [4, 16, 65]
    assert width_buckets(129, 4, step_tokens=16) == [4, 16, 64, 129]


def _graph_core(model: TinyModel, attention: str = "auto", width_step_tokens: int = 16, **kw: int) -> EngineCore:
    config = EngineConfig(
        ModelConfig("tiny", dtype="float32", device="cpu", attention_backend=attention),
        CacheConfig(block_size=4, num_blocks=kw.pop("num_blocks", 256)),
        SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 8), **kw),
    )
    core = EngineCore(config, model.arch, model.state_dict)
    core.runner.enable_decode_graphs("eager", width_step_tokens=width_step_tokens)
    return core


# 7 prompts through max_num_seqs 8: batches of 7, 6, ... 1 as requests finish (most not a bucket), and
# contexts from 3 to ~70 tokens, so the table widths cross buckets (16 tokens = 4 blocks, 16, 64).
PROMPTS = random_prompts([3, 9, 17, 30, 41, 5, 60], seed=7)
PARAMS = [greedy(n) for n in (12, 5, 9, 3, 7, 14, 10)]


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_graph_steps_are_token_identical_to_eager_and_transformers(arch: ArchName) -> None:
    model = tiny_model(arch)
    core = _graph_core(model)
    graphs = core.runner.graphs
    assert graphs is not None and graphs.pad_block == 256  # one block past the manager's 256
    out = run_to_completion(core, PROMPTS, PARAMS)
    assert graphs.replays > 0
    assert out == run_to_completion(make_core(model), PROMPTS, PARAMS)
    # (transformers' generate masks token 0 as padding: compare only prompts without it)
    checked = [i for i, p in enumerate(PROMPTS) if 0 not in p]
    assert len(checked) >= 4
    for i in checked:
        assert out[i] == hf_greedy(model, PROMPTS[i], PARAMS[i].max_tokens)


def test_triton_kernel_in_graph_steps() -> None:
    """The GPU configuration (Triton decode attention over the static, strided table views), on CPU
    under Triton's interpreter."""
    pytest.importorskip("tokenmill.kernels.triton_attention")
    model = tiny_model("gemma3")  # sliding-window layers too
    core = _graph_core(model, attention="triton")
    prompts, params = PROMPTS[:4], PARAMS[:4]
    assert run_to_completion(core, prompts, params) == run_to_completion(make_core(model), prompts, params)


def test_padding_never_touches_real_blocks_under_preemption() -> None:
    """A pool so small that requests are preempted and blocks reused: the padding rows' writes (to
    the pad block) must never land in a block a request holds."""
    model = tiny_model("llama")
    core = _graph_core(model, num_blocks=24)
    out = run_to_completion(core, PROMPTS, PARAMS)
    assert core.scheduler.stats.num_preemptions > 0
    assert out == run_to_completion(make_core(model, num_blocks=24), PROMPTS, PARAMS)


def test_sampled_and_penalised_requests_replay_too() -> None:
    model = tiny_model("qwen2")
    params = [SamplingParams(max_tokens=8, temperature=0.8, seed=i, repetition_penalty=1.2) for i in range(5)]
    prompts = random_prompts([4, 8, 12, 16, 20], seed=3)
    core = _graph_core(model)
    assert run_to_completion(core, prompts, params) == run_to_completion(make_core(model), prompts, params)
    assert core.runner.graphs is not None and core.runner.graphs.replays > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_cuda_graph_replay_equals_eager_on_gpu(arch: ArchName) -> None:
    model = tiny_model(arch)

    def core(eager: bool) -> EngineCore:
        config = EngineConfig(ModelConfig("tiny", dtype="float32", device="cuda", enforce_eager=eager),
                              CacheConfig(block_size=4, num_blocks=256), SchedulerConfig(max_num_seqs=8))
        return EngineCore(config, model.arch, model.state_dict)

    graphed = core(eager=False)
    assert graphed.runner.graphs is not None
    out = run_to_completion(graphed, PROMPTS, PARAMS)
    assert graphed.runner.graphs.replays > 0
    assert out == run_to_completion(core(eager=True), PROMPTS, PARAMS)


@pytest.mark.parametrize(("method", "draft"), [("ngram", None), ("draft", "qwen2")])
def test_speculative_verification_steps_replay_and_stay_token_identical(method: str, draft: ArchName | None) -> None:
    """Verification rows (1 + k per request) and a draft's catch-up rows are one-token decodes each:
    the graphs serve them too (`stage_rows`), and greedy output stays that of plain decoding."""
    from tests.engine.test_speculative import _assert_greedy_identical, spec_core

    core = spec_core(tiny_model("llama"), method, draft)
    core.runner.enable_decode_graphs("eager", width_step_tokens=16)
    graphs = core.runner.graphs
    assert graphs is not None
    staged_rows = 0
    stage_rows = graphs.stage_rows

    def counting(host):  # type: ignore[no-untyped-def]
        nonlocal staged_rows
        staged = stage_rows(host)
        staged_rows += staged is not None
        return staged

    graphs.stage_rows = counting  # type: ignore[method-assign]
    if draft is not None:
        proposer = core.speculator.proposer  # type: ignore[union-attr]
        proposer.runner.enable_decode_graphs("eager", width_step_tokens=16)  # type: ignore[attr-defined]
    _, accepted = _assert_greedy_identical(core, "llama")
    assert staged_rows > 0 and accepted > 0


def test_short_prompts_with_prompt_logprobs_replay_with_the_same_logprobs() -> None:
    """Prompts of at most 8 tokens are decode rows (`stage_rows`): their prompt logprobs read the
    replayed hidden rows at the host-built offsets, and equal the eager engine's."""
    model = tiny_model("qwen2")
    prompts = random_prompts([3, 6, 8, 2], seed=11)
    params = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=2, logprobs=1)

    def run(core: EngineCore) -> list[tuple[list[int], list[tuple[int, float]]]]:
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params, ())
        got: dict[str, tuple[list[int], list[tuple[int, float]]]] = {str(i): ([], []) for i in range(len(prompts))}
        while core.has_unfinished:
            for out in core.step().outputs:
                tokens, prompt_lp = got[out.request_id]
                tokens.extend(out.new_token_ids)
                prompt_lp.extend((lp.token_id, round(lp.logprob, 4)) for lp in out.prompt_logprobs or [])
        return [got[str(i)] for i in range(len(prompts))]

    core = _graph_core(model, max_num_seqs=32)  # buckets to 32 rows: the 19 prompt rows fit one
    graphs = core.runner.graphs
    assert graphs is not None
    stage_rows, staged = graphs.stage_rows, []
    graphs.stage_rows = lambda host: staged.append(stage_rows(host)) or staged[-1]  # type: ignore[method-assign]
    graphed = run(core)
    assert staged and staged[0] is not None and staged[0].input_ids.shape[0] == 19  # the prompts, as rows
    eager = run(make_core(model))
    assert graphed == eager
    assert all(len(lp) == len(p) - 1 for (_, lp), p in zip(graphed, prompts, strict=True))


def test_a_failed_capture_falls_back_to_eager_steps(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    from tokenmill.engine.cuda_graphs import DecodeGraphs

    def broken(self: DecodeGraphs) -> None:
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture", broken)
    model = tiny_model("llama")
    core = _graph_core(model)
    assert core.runner.graphs is None
    assert "CUDA graph capture failed" in caplog.text
    assert run_to_completion(core, PROMPTS, PARAMS) == run_to_completion(make_core(model), PROMPTS, PARAMS)
