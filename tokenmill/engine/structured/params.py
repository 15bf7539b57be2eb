"""What a request asks its output to match: one grammar spec, as plain data (no library types)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from tokenmill.errors import RequestValidationError

GrammarKind = Literal["json", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """`spec`: the JSON schema (compact JSON text), the regex, the JSON list of choices, or the EBNF
    grammar; empty for `json_object`. Frozen and hashable: `(kind, spec)` keys the compile cache."""

    kind: GrammarKind
    spec: str = ""

    @classmethod
    def json(cls, schema: dict[str, Any] | str | bool) -> StructuredOutputParams:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestValidationError(f"the JSON schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, (dict, bool)):
            raise RequestValidationError("the JSON schema must be a JSON object")
        # Key order kept: it is the order properties are generated in (a model writes "name" first).
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> StructuredOutputParams:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutputParams:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutputParams:
        if not choices or not all(isinstance(c, str) for c in choices):
            raise RequestValidationError("guided_choice must be a non-empty list of strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, ebnf: str) -> StructuredOutputParams:
        if not ebnf.strip():
            raise RequestValidationError("the grammar must not be empty")
        return cls("grammar", ebnf)

    @property
    def choices(self) -> list[str]:
        result: list[str] = json.loads(self.spec)
        return result
