"""The mask path on its own, per backend: the logits a grammar row keeps are exactly the tokens its
matcher accepts (brute force over the vocabulary), on a subset of rows, with logits wider than the
tokenizer's vocabulary; prepared on the worker or not."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.tiny_models import EOS_TOKEN_ID, _write_tokenizer
from tokenmill.engine.request import Request, SamplingParams
from tokenmill.engine.structured import StructuredOutputParams
from tokenmill.engine.structured.manager import StructuredOutputs
from tokenmill.models.loading.tokenizer import Tokenizer

PAD = 5  # logits columns past the tokenizer's vocabulary (a padded embedding): never allowed


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("masks_tokenizer")
    _write_tokenizer(path)
    return Tokenizer.from_hf_dir(path)


@pytest.mark.parametrize("backend", ["llguidance", "xgrammar"])
@pytest.mark.parametrize("overlap", [True, False])
def test_kept_logits_are_exactly_the_accepted_tokens(tokenizer: Tokenizer, backend: str, overlap: bool) -> None:
    if backend == "xgrammar":
        pytest.importorskip("xgrammar")
    width = tokenizer.vocab_size + PAD
    grammars = StructuredOutputs(tokenizer, width, (EOS_TOKEN_ID,), backend=backend, overlap=overlap)
    specs = [StructuredOutputParams.regex(r"[a-c]+-\d"), None, StructuredOutputParams.json({"type": "object"}),
             StructuredOutputParams.choice(["yes", "no"])]
    requests = [Request(f"{backend}-{overlap}-{i}", [1, 2], SamplingParams(structured=s), (EOS_TOKEN_ID,))
                for i, s in enumerate(specs)]
    for generated in ([], tokenizer.encode("ab")):  # the second round: after the rows' first tokens
        for r in requests:
            if r.params.structured is not None and r.params.structured.kind == "regex":
                r.token_ids = [1, 2, *generated]
        grammars.prepare(requests)
        logits = torch.randn(len(requests), width)
        plain = logits[1].clone()
        grammars(logits, requests)
        assert torch.equal(logits[1], plain)  # the row without a grammar is untouched
        for row in (0, 2, 3):
            state = grammars._states[requests[row].request_id]
            accepted = {t for t in range(tokenizer.vocab_size) if state.matcher.count_valid([t]) == 1}
            kept = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
            assert kept == accepted and accepted, (row, sorted(kept ^ accepted)[:10])
    assert grammars.num_overlapped == (2 if overlap else 0)
