"""The llguidance backend (Microsoft's Rust grammar engine, vLLM's `guidance`): the default.

Picked over xgrammar because it is exact where xgrammar 0.2.9 is not: xgrammar's rule for a string
with `maxLength` lets raw control bytes into the string, so sampled output fails `json.loads`
(found by tests/structured/test_http.py). Measured figures: docs/structured_outputs.md.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tokenmill.engine.structured.backend import (
    GrammarBackend,
    GrammarError,
    GrammarMatcher,
    Vocabulary,
    register_backend,
)
from tokenmill.engine.structured.params import StructuredOutputParams

_WHAT = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice list",
         "grammar": "grammar"}


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id)) and not self.matcher.is_error()

    def count_valid(self, token_ids: Sequence[int]) -> int:
        return int(self.matcher.validate_tokens(list(token_ids)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    def forced_tokens(self) -> list[int]:
        # llguidance's fast-forward tokens: the forced bytes, tokenized so that they can be appended
        # (it holds back a last token a longer one could still replace).
        return list(self.matcher.compute_ff_tokens())

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_stopped())


@register_backend("llguidance")
class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, vocab: Vocabulary) -> None:
        import llguidance

        self._ll = llguidance
        self.vocab_size = vocab.size
        self._tokenizer = llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab.size,
                                                 eos_token=list(vocab.stop_token_ids) or None)
        self._executor = llguidance.LLExecutor(num_threads=2)

    def _grammar(self, params: StructuredOutputParams) -> str:
        m = self._ll.LLMatcher
        # Compact JSON (no free whitespace): a model (a random one above all) could otherwise pad
        # the object with whitespace until max_tokens.
        options: Any = {"whitespace_flexible": False}
        if params.kind == "json":
            return str(m.grammar_from_json_schema(params.spec, defaults=options))
        if params.kind == "json_object":  # OpenAI's json_object is an object, not any JSON value
            return str(m.grammar_from_json_schema('{"type": "object"}', defaults=options))
        if params.kind == "regex":
            return str(m.grammar_from_regex(params.spec))
        if params.kind == "choice":
            return str(m.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choices)))
        from llguidance.gbnf_to_lark import any_to_lark

        return str(m.grammar_from_lark(any_to_lark(params.spec)))  # Lark, or GBNF/EBNF (`::=`) converted

    def compile(self, params: StructuredOutputParams) -> Any:
        try:
            grammar = self._grammar(params)
            error = self._ll.LLMatcher.validate_grammar(grammar, self._tokenizer)
        except Exception as exc:  # the converters raise on syntax they cannot read
            error = str(exc) or type(exc).__name__
        if error:
            raise GrammarError(f"the {_WHAT[params.kind]} cannot be compiled: {' '.join(error.split())[:500]}")
        # A template matcher: each request deep-copies it (cheap) instead of re-parsing the grammar.
        return self._ll.LLMatcher(self._tokenizer, grammar, log_level=0)

    def new_matcher(self, compiled: Any) -> GrammarMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())

    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        # numpy memory behind the tensor: torch.full waited ~12 ms on its thread pool at 32 rows on
        # the loaded 2-core machine, numpy's single-threaded fill takes microseconds.
        return torch.from_numpy(np.full((rows, (self.vocab_size + 31) // 32), -1, dtype=np.int32))

    def fill_bitmasks(self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        if len(matchers) <= 1:
            super().fill_bitmasks(matchers, bitmask)
            return
        # One call for the batch: the library computes the masks on its threads, without the GIL.
        pairs = [(m.matcher, row) for m, row in matchers if isinstance(m, LLGuidanceMatcher)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
