"""`tokenmill batch` lines take the same structured-output fields as HTTP bodies (shared parsing)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fixtures.tiny_models import _write_tokenizer
from tokenmill.batch.requests import BatchLineError, Endpoint, build_request
from tokenmill.engine.inputs import RequestLimits
from tokenmill.engine.structured.manager import StructuredOutputs
from tokenmill.models.loading.tokenizer import Tokenizer


def test_batch_lines_carry_grammars_and_refuse_bad_ones(tmp_path: Path) -> None:
    _write_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_hf_dir(tmp_path)
    grammars = StructuredOutputs(tokenizer, tokenizer.vocab_size, (0,))
    limits = RequestLimits(512, tokenizer.vocab_size)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    request = build_request("a", Endpoint.CHAT, body, tokenizer, limits, grammars)
    structured = request.children[0].params.structured
    assert structured is not None and structured.kind == "json" and grammars.num_cached == 1
    completion = build_request("b", Endpoint.COMPLETIONS, {"prompt": "x", "guided_choice": ["a", "b"]}, tokenizer,
                               limits, grammars)
    assert completion.children[0].params.structured is not None
    with pytest.raises(BatchLineError, match="regex cannot be compiled") as info:
        build_request("c", Endpoint.COMPLETIONS, {"prompt": "x", "guided_regex": "(("}, tokenizer, limits, grammars)
    assert info.value.param == "guided_regex"
