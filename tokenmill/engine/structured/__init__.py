"""Structured outputs: JSON schema, regex, choice and EBNF grammars enforced while sampling.

`params` (plain data, imported by `engine.request`) and `backend` load no grammar library;
`manager.StructuredOutputs` is the engine's logits processor (import it from its module).
"""

from tokenmill.engine.structured.backend import GrammarError
from tokenmill.engine.structured.params import StructuredOutputParams

__all__ = ["GrammarError", "StructuredOutputParams"]
