"""Each metric on inputs small enough to compute by hand, and each task on a scripted model."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tests.eval.fake import BOS, FakeBackend, FakeModel
from tokenmill.eval import metrics
from tokenmill.eval.compare import compare_runs, parse_gate
from tokenmill.eval.runner import SuiteConfig, run_task
from tokenmill.eval.tasks.base import TaskConfig, get_task
from tokenmill.eval.tasks.multiple_choice import NUM_CHOICES, questions
from tokenmill.eval.texts import corpus, passages

REST = 0.1 / 256  # the fake model's probability of any token but the next and the same


def test_perplexity_and_bits_per_byte_by_hand() -> None:
    nll = -math.log(REST) - math.log(0.6)  # "ab" after BOS: 'a' is neither BOS+1 nor BOS; 'b' follows 'a'
    assert metrics.perplexity(nll, 2) == pytest.approx(math.exp(nll / 2))
    assert metrics.bits_per_byte(nll, 2) == pytest.approx(nll / (2 * math.log(2)))
    scored = FakeBackend().score([[BOS, ord("a"), ord("b")]], top_k=0)[0]
    assert -sum(p.logprob for p in scored) == pytest.approx(nll)
    assert math.isnan(metrics.perplexity(1.0, 0))


def test_topk_kl_by_hand() -> None:
    ref = {"a": math.log(0.5), "b": math.log(0.3)}
    expected = 0.5 * math.log(0.5 / 0.4) + 0.3 * math.log(0.3 / 0.4)  # the rest buckets are 0.2 on both sides
    assert metrics.topk_kl(ref, {"a": math.log(0.4), "b": math.log(0.4)}) == pytest.approx(expected)
    # b missing from the candidate: it gets the unlisted mass 0.1 (below its smallest listed 0.3); rest 0.3.
    expected = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.1) + 0.2 * math.log(0.2 / 0.3)
    assert metrics.topk_kl(ref, {"a": math.log(0.6), "c": math.log(0.3)}) == pytest.approx(expected)
    assert metrics.topk_kl(ref, ref) == pytest.approx(0.0, abs=1e-12)


def test_pass_at_k_accuracy_choice_and_mcnemar_by_hand() -> None:
    assert metrics.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert metrics.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert metrics.pass_at_k(3, 3, 2) == 1.0
    assert metrics.accuracy([True, False, True, True]) == 0.75
    assert metrics.choose([-3.0, -2.0, -5.0]) == 1
    assert metrics.choose([-3.0, -2.0], lengths=[6, 2]) == 0  # -0.5 per byte beats -1 per byte
    assert metrics.mcnemar_p([True] * 5, [False] * 5) == pytest.approx(2 / 32)
    assert metrics.mcnemar_p([True, False], [False, True]) == 1.0
    assert metrics.mcnemar_p([True, True], [True, True]) == 1.0


def test_bootstrap_interval_is_fixed_by_its_seed_and_about_the_right_width() -> None:
    cols = {"x": np.arange(20.0) ** 1.5}
    agg = metrics.Metric("mean", lambda c: float(np.mean(c["x"]))).aggregate
    first = metrics.bootstrap_interval(cols, agg, seed=7)
    assert first == metrics.bootstrap_interval(cols, agg, seed=7)
    assert first != metrics.bootstrap_interval(cols, agg, seed=8)
    assert metrics.bootstrap_interval({"x": np.full(10, 2.5)}, agg) == metrics.Interval(2.5, 2.5)
    coin = {"x": np.array([0.0, 1.0] * 200)}  # p = 0.5, n = 400: the normal interval is ±1.96·√(.25/400)
    interval = metrics.bootstrap_interval(coin, agg, num_resamples=2000, seed=0)
    assert interval.high - interval.low == pytest.approx(2 * 1.96 * math.sqrt(0.25 / 400), rel=0.1)
    assert interval.contains(0.5)


def test_paired_bootstrap_cancels_item_difficulty() -> None:
    ref = {"x": np.linspace(0.0, 10.0, 50)}  # very different items ...
    cand = {"x": ref["x"] + 0.1}  # ... each shifted by exactly 0.1
    agg = metrics.Metric("mean", lambda c: float(np.mean(c["x"]))).aggregate
    interval = metrics.paired_bootstrap_delta(ref, cand, agg)
    assert interval.low == pytest.approx(0.1) and interval.high == pytest.approx(0.1)
    assert metrics.sign_flip_p([0.1] * 20) < 0.001
    assert metrics.sign_flip_p([0.1, -0.1] * 10) == 1.0


def test_perplexity_task_matches_the_fake_models_logprobs() -> None:
    run = run_task(get_task("ppl-heldout"), FakeBackend(), SuiteConfig(task=TaskConfig(num_items=3)))
    texts = passages(corpus("heldout"), 3, 1000)
    nll, tokens = 0.0, 0
    for text in texts:
        ids = [BOS, *text.encode()]
        for prev, tok in itertools.pairwise(ids):
            p = 0.6 if tok == (prev + 1) % 256 else 0.3 if tok == (prev if prev < 256 else 0) else REST
            nll -= math.log(p)
            tokens += 1
    assert run.metrics["ppl"] == pytest.approx(math.exp(nll / tokens))
    assert run.metrics["bits_per_byte"] == pytest.approx(nll / (sum(len(t.encode()) for t in texts) * math.log(2)))
    assert run.intervals["ppl"].contains(run.metrics["ppl"])


def test_long_texts_are_scored_in_rolling_windows_with_the_same_result() -> None:
    config = SuiteConfig(task=TaskConfig(num_items=3))
    whole = run_task(get_task("ppl-docstrings"), FakeBackend(), config)
    windowed_backend = FakeBackend(max_len=64)
    windowed = run_task(get_task("ppl-docstrings"), windowed_backend, config)
    assert windowed_backend.num_score_requests > 3 * 20  # ~1000 bytes each, 32 new tokens a window
    # The fake model looks one token back, so windows change nothing: every token scored exactly once.
    assert [i.values["tokens"] for i in windowed.items] == [i.values["tokens"] for i in whole.items]
    assert windowed.metrics["ppl"] == pytest.approx(whole.metrics["ppl"], rel=1e-12)


def test_next_token_agreement_and_kl_against_a_reference() -> None:
    config = SuiteConfig(task=TaskConfig(num_items=2))
    task = get_task("next-token")
    ref = run_task(task, FakeBackend(FakeModel(0.6, 0.3)), config)
    same = run_task(task, FakeBackend(FakeModel(0.6, 0.3)), config)
    flipped = run_task(task, FakeBackend(FakeModel(0.3, 0.6)), config)  # a different top-1 everywhere
    identical = compare_runs([ref], [same], [parse_gate("next-token.top1_agreement>=1")], config)
    assert identical.values()["next-token.top1_agreement"] == 1.0
    assert identical.values()["next-token.kl_mean"] == pytest.approx(0.0, abs=1e-9)
    assert identical.passed
    broken = compare_runs([ref], [flipped], [parse_gate("next-token.top1_agreement>=0.99")], config)
    assert broken.values()["next-token.top1_agreement"] == 0.0
    # Per position: 0.6 ln 2 + 0.3 ln 0.5 over the two swapped tokens; the rest match.
    assert broken.values()["next-token.kl_mean"] == pytest.approx(0.6 * math.log(2) + 0.3 * math.log(0.5), rel=1e-6)
    assert not broken.passed


def test_arithmetic_exact_match_on_scripted_answers() -> None:
    from tokenmill.eval.tasks.arithmetic import problems, prompt

    items = problems(6, 0)
    answers = {prompt(p): f" {p.answer if i % 3 else p.answer + 1}\n" for i, p in enumerate(items)}
    run = run_task(get_task("arithmetic"), FakeBackend(completions=answers), SuiteConfig(task=TaskConfig(num_items=6)))
    assert run.metrics["exact_match"] == pytest.approx(4 / 6)  # items 0 and 3 are off by one


def test_code_pass_at_1_runs_the_completions() -> None:
    from tokenmill.eval.tasks.code_problems import PROBLEMS

    scripted = {PROBLEMS[0].prompt: "    return a + b\n", PROBLEMS[1].prompt: "    return n % 2 == 0\n",
                PROBLEMS[2].prompt: "    return max(xs)\n", PROBLEMS[3].prompt: "    while True:\n        pass\n",
                PROBLEMS[4].prompt: "    return 0\n"}
    task = get_task("code")
    task.limits = type(task.limits)(timeout_s=2.0)  # type: ignore[attr-defined]
    run = run_task(task, FakeBackend(completions=scripted), SuiteConfig(task=TaskConfig(num_items=5)))
    assert [item.values["passed"] for item in run.items] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert run.metrics["pass_at_1"] == pytest.approx(3 / 5)
    assert run.items[3].detail["timed_out"]


class _Chooser(FakeBackend):
    """Scores the right choice highest on even items and a wrong one on odd items."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.questions = questions(count, 0)

    def score(self, prompts, top_k, progress=None):  # type: ignore[no-untyped-def]
        out = super().score(prompts, top_k)
        for p, positions in zip(prompts, out, strict=True):
            text = bytes(t for t in p if t < 256).decode()
            index = next(i for i, q in enumerate(self.questions) if text.startswith(q.context))
            q = self.questions[index]
            winner = q.answer if index % 2 == 0 else (q.answer + 1) % NUM_CHOICES
            lp = 0.0 if text.endswith(q.choices[winner]) else -1.0
            positions[:] = [type(x)(x.token, lp, x.top) for x in positions]
        return out


def test_multiple_choice_accuracy_on_scripted_logprobs() -> None:
    run = run_task(get_task("mc"), _Chooser(10), SuiteConfig(task=TaskConfig(num_items=10)))
    assert run.metrics["acc"] == 0.5
    assert run.metrics["acc_norm"] == 0.5


def test_greedy_identity_against_a_golden_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tokenmill.eval.tasks.greedy import golden_path, write_golden

    config = SuiteConfig(task=TaskConfig(num_items=4, golden_dir=tmp_path))
    task = get_task("greedy")
    first = run_task(task, FakeBackend(name="fake"), config)
    assert math.isnan(first.metrics["golden_identity"])  # no golden file yet
    write_golden(golden_path("fake", tmp_path), "fake", first.items)
    again = run_task(get_task("greedy"), FakeBackend(name="fake"), config)
    assert again.metrics["golden_identity"] == 1.0
    hot = run_task(get_task("greedy"), FakeBackend(FakeModel(temperature_bug=1.0), name="fake"), config)
    assert hot.metrics["golden_identity"] == 0.0
    assert hot.metrics["golden_prefix_match"] < 0.5


def test_shipped_golden_files_cover_todays_prompts() -> None:
    """A changed corpus or prompt cut would silently turn every golden score into NaN: catch it here."""
    import hashlib
    import json

    from tokenmill.eval.tasks.greedy import GOLDEN_DIR, MAX_TOKENS, prompts

    files = sorted(GOLDEN_DIR.glob("*.json"))
    assert files, "no golden files shipped"
    want = {item_id: hashlib.sha256(text.encode()).hexdigest()[:16]
            for item_id, text in prompts(get_task("greedy").default_items)}
    for path in files:
        data = json.loads(path.read_text())
        assert data["max_tokens"] == MAX_TOKENS and data["model"] == path.stem
        assert {k: v["prompt_sha256"] for k, v in data["items"].items()} == want, path.name
        assert all(len(v["token_ids"]) <= MAX_TOKENS for v in data["items"].values())


class _Recorder(FakeBackend):
    def __init__(self, bos: int | None) -> None:
        super().__init__()
        self.bos = bos
        self.prompts: list[list[int]] = []

    def prompt_bos(self) -> int | None:
        return self.bos

    def score(self, prompts, top_k, progress=None):  # type: ignore[no-untyped-def]
        self.prompts.extend(prompts)
        return super().score(prompts, top_k, progress)


def test_multiple_choice_puts_bos_first_only_for_models_that_want_it() -> None:
    config = SuiteConfig(task=TaskConfig(num_items=3))
    gemma_like, llama_like = _Recorder(BOS), _Recorder(None)
    run_task(get_task("mc"), gemma_like, config)
    run_task(get_task("mc"), llama_like, config)
    assert all(p[0] == BOS for p in gemma_like.prompts)
    assert [p[1:] for p in gemma_like.prompts] == llama_like.prompts  # lm-eval's request, BOS aside
    assert not any(p[0] == BOS for p in llama_like.prompts)
