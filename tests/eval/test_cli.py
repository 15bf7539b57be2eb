"""`tokenmill eval` end to end: the exit code of `compare` is the test (a CI job reads nothing else)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.eval.fake import FakeModel, FakeServer
from tokenmill.cli.main import main


@pytest.fixture(scope="module")
def good() -> Iterator[FakeServer]:
    with FakeServer(FakeModel(0.6, 0.3)) as server:
        yield server


def _compare(reference: str, candidate: str, out: Path, *extra: str, limit: int = 3) -> int:
    return main(["eval", "compare", "--reference", reference, "--candidate", candidate, "--limit", str(limit),
                 "--output-dir", str(out), "--no-progress", *extra])


def test_identical_endpoints_pass_the_quant_gates(good: FakeServer, tmp_path: Path) -> None:
    with FakeServer(FakeModel(0.6, 0.3)) as same:
        assert _compare(good.url, same.url, tmp_path, "--gates", "quant") == 0
    document = json.loads(next(tmp_path.glob("compare_*.json")).read_text())
    assert document["comparison"]["passed"]
    assert {g["gate"] for g in document["comparison"]["gates"]} == {"next-token.top1_agreement>=0.99",
                                                                  "ppl-*.ppl_delta_pct<=1"}
    assert sorted(document["reference_tasks"]) == ["next-token", "ppl-docstrings", "ppl-heldout"]
    assert next(tmp_path.glob("compare_*.png")).stat().st_size > 0


def test_wrong_logprobs_fail_the_quant_gates(good: FakeServer, tmp_path: Path) -> None:
    with FakeServer(FakeModel(0.65, 0.33)) as off:  # the same top-1 everywhere, less mass on the rest
        assert _compare(good.url, off.url, tmp_path, "--gates", "quant") == 1
    gates = {g["gate"]: g for g in json.loads(next(tmp_path.glob("compare_*.json")).read_text())["comparison"]["gates"]}
    assert gates["next-token.top1_agreement>=0.99"]["passed"]  # agreement alone would not catch it ...
    assert not gates["ppl-*.ppl_delta_pct<=1"]["passed"]  # ... perplexity does


def test_a_sampler_at_the_wrong_temperature_fails_the_spec_gate(good: FakeServer, tmp_path: Path) -> None:
    with FakeServer(FakeModel(0.6, 0.3, temperature_bug=1.0)) as hot:
        assert _compare(good.url, hot.url, tmp_path, "--gates", "spec") == 1
    with FakeServer(FakeModel(0.6, 0.3)) as same:
        assert _compare(good.url, same.url, tmp_path, "--gates", "spec") == 0


def test_a_gate_that_names_nothing_fails(good: FakeServer, tmp_path: Path) -> None:
    assert _compare(good.url, good.url, tmp_path, "--tasks", "ppl-heldout", "--gate", "ppl-heldout.pll<=1") == 1
    assert _compare(good.url, good.url, tmp_path, "--tasks", "ppl-heldout", "--gate", "ppl-heldout.ppl_delta<=0") == 0


def test_bad_input_is_a_one_line_error(good: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _compare(good.url, good.url, tmp_path, "--gate", "nonsense") == 1
    assert "bad gate" in capsys.readouterr().err
    assert main(["eval", "run", "--target", good.url, "--tasks", "nope", "--no-progress"]) == 1
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert main(["eval", "run", "--target", "http://127.0.0.1:9", "--no-progress"]) == 1
    assert "failed" in capsys.readouterr().err


def test_run_writes_json_with_every_task(good: FakeServer, tmp_path: Path) -> None:
    assert main(["eval", "run", "--target", good.url, "--limit", "2", "--output-dir", str(tmp_path),
                 "--no-progress"]) == 0
    document = json.loads(next(tmp_path.glob("run_*.json")).read_text())
    assert set(document["tasks"]) == {"ppl-docstrings", "ppl-heldout", "next-token", "arithmetic", "code", "mc",
                                      "greedy"}
    assert document["tasks"]["code"]["metrics"]["pass_at_1"] == 0.0  # the byte model writes no Python
    assert document["target"] == {"kind": "http", "url": good.url, "model": "fake"}


def _noisy_copy(model_dir: Path, out: Path, scale: float) -> Path:
    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if tensor.dim() == 2:
            weights[name] = tensor + scale * tensor.std() * torch.randn(tensor.shape, generator=generator)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.mark.slow  # four engine loads and runs: ~25 s on a quiet 2-core machine
def test_in_process_engine_with_noisy_weights_fails_and_an_identical_one_passes(tiny_model_dir: Path,
                                                                                tmp_path: Path) -> None:
    noisy = _noisy_copy(tiny_model_dir, tmp_path / "noisy", scale=0.5)
    reference = f"model={tiny_model_dir},dtype=float32,device=cpu,quantization=none"
    args = ("--gates", "quant,spec")
    same = f"model={tiny_model_dir},dtype=float32,device=cpu"
    assert _compare(reference, same, tmp_path / "same", *args, limit=2) == 0
    assert _compare(reference, f"model={noisy},dtype=float32,device=cpu", tmp_path / "noisy_out", *args, limit=2) == 1
    document = json.loads(next((tmp_path / "noisy_out").glob("compare_*.json")).read_text())
    failed = {g["gate"] for g in document["comparison"]["gates"] if not g["passed"]}
    assert "next-token.top1_agreement>=0.99" in failed and "greedy.identity>=1" in failed
