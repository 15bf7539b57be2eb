"""The grammar library seam: compile a spec against one vocabulary, and match tokens against it.

A backend owns everything library-specific; the engine sees only `GrammarBackend` (compile, new
matcher, fill one bitmask row, apply the bitmask) and `GrammarMatcher` (advance, roll back).
Bitmasks are int32 [rows, ceil(vocab / 32)], bit j of word w allows token 32 w + j (the layout
both xgrammar and llguidance use).
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.engine.structured.params import StructuredOutputParams
from tokenmill.errors import RequestValidationError


class GrammarError(RequestValidationError):
    """A spec the grammar library cannot compile (an HTTP 400, before queueing)."""


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """What a backend needs of the tokenizer. `size` is the logits width (may exceed the tokenizer's
    own vocabulary: rows beyond it are padding the model never should emit)."""

    tokenizer_json: str  # the HF `tokenizers` serialisation (byte-level / byte-fallback detected from it)
    tokens: list[str]  # id → token string as the tokenizer stores it ('' where an id has no token)
    size: int
    stop_token_ids: tuple[int, ...]


class GrammarMatcher(abc.ABC):
    """One request's position in its grammar."""

    @abc.abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar does not allow it."""

    def count_valid(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids`, in order, the grammar allows from here (the state is unchanged)."""
        n = 0
        for token in token_ids:
            if not self.accept(token):
                break
            n += 1
        self.rollback(n)
        return n

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative proposals being verified)."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask`."""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here whatever the model says (a JSON schema's keys and
        punctuation), without advancing; [] where the library cannot tell (the state is unchanged)."""
        return []

    @property
    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: nothing may follow."""


class GrammarBackend(abc.ABC):
    name: str

    @abc.abstractmethod
    def compile(self, params: StructuredOutputParams) -> Any:
        """A compiled grammar (library object); raises GrammarError naming the problem."""

    @abc.abstractmethod
    def new_matcher(self, compiled: Any) -> GrammarMatcher: ...

    @abc.abstractmethod
    def allocate_bitmask(self, rows: int) -> torch.Tensor:
        """int32 [rows, ceil(vocab / 32)], all tokens allowed."""

    def fill_bitmasks(self, matchers: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Fill row `row` of `bitmask` for each (matcher, row); backends may do it in parallel."""
        for matcher, row in matchers:
            matcher.fill_bitmask(bitmask, row)

    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        """In place: logits[row] = -inf wherever bitmask row `row` disallows a token."""
        rows = list(rows)
        self.apply_prepared(logits, self.prepare_apply(bitmask, rows, logits.shape[1]), rows)

    def prepare_apply(self, bitmask: torch.Tensor, rows: Sequence[int], width: int) -> Any:
        """What `apply_prepared` needs, computed without the logits (so it runs during the forward):
        here an additive float32 bias [len(rows), width], 0 where a token is allowed, -inf where not."""
        # numpy, single-threaded: torch ops wait on torch's intra-op pool when the cores are busy
        # (a torch row gather of a 32-row bitmask took 12 ms on the loaded 2-core machine, a torch
        # shift-and-mask unpack 90 ms). One table lookup per bitmask byte gives its 8 biases
        # (little-endian words: bit j of word w is token 32 w + j): 0.35 ms at 32 x 49k.
        words = bitmask.numpy()
        rows = list(rows)
        if rows != list(range(len(words))):
            words = words[rows]
        bias = np.take(_BYTE_BIAS, words.view(np.uint8), axis=0).reshape(len(rows), -1)
        if bias.shape[1] < width:  # ids past the mask's vocabulary: never allowed
            bias = np.concatenate([bias, np.full((len(rows), width - bias.shape[1]), -np.inf, np.float32)], 1)
        return bias[:, :width]

    def apply_prepared(self, logits: torch.Tensor, prepared: Any, rows: Sequence[int]) -> None:
        """In place: add the bias from `prepare_apply` (-inf on banned tokens) to the rows."""
        bias: np.ndarray = prepared[:, :logits.shape[1]]  # prepared for the vocabulary, may be wider
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            # numpy on the tensor's memory: an in-place add is 0.3 ms at 32 x 49k, where a boolean
            # fill took 1-3 ms and torch's add_ 12-20 ms (thread-pool waits) on the loaded machine.
            view = logits.numpy()
            if list(rows) == list(range(logits.shape[0])):
                np.add(view, bias, out=view)
            else:
                for i, row in enumerate(rows):
                    np.add(view[row], bias[i], out=view[row])
            return
        on_device = torch.from_numpy(np.ascontiguousarray(bias)).to(logits.device)
        for i, row in enumerate(rows):  # in place on row views: no gather/scatter copy of the rows
            logits[row].add_(on_device[i])


# _BYTE_BIAS[b, j]: 0 if bit j of byte b is set (the token is allowed), else -inf.
_BYTE_BIAS = np.where(np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1,
                      np.float32(0), np.float32(-np.inf)).astype(np.float32)


BackendFactory = Callable[[Vocabulary], GrammarBackend]
BACKENDS: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def register(factory: BackendFactory) -> BackendFactory:
        BACKENDS[name] = factory
        return factory
    return register


def build_backend(name: str, vocab: Vocabulary) -> GrammarBackend:
    # Importing the module registers its backend; the libraries load only when first used.
    from tokenmill.engine.structured import llguidance_backend, xgrammar_backend  # noqa: F401

    if name not in BACKENDS:
        raise RequestValidationError(f"unknown structured-output backend {name!r}: choose from {sorted(BACKENDS)}")
    return BACKENDS[name](vocab)
