"""The proposer interface and its registry: one abstract base, one name per kind."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Protocol

import torch

from tokenmill.engine.request import Request


class ProposalGate(Protocol):
    """Asked by a proposer that knows how sure it is of each guess (a draft model: its top-1
    probability), guess by guess, whether the guess is worth a verification row; at the first no the
    request's proposal ends there (controller.DraftGate)."""

    def keep(self, request_id: str, confidence: float) -> bool: ...


class Proposer(abc.ABC):
    """Guesses up to k tokens to follow each request's token_ids. Never changes a request."""

    # The model forwards the last propose() ran (a draft model's; none for proposers without a model):
    # the wall times of those that were decode-like (no sequence computing more than a few tokens),
    # which price a draft forward, and (tokens beyond one per sequence, seconds) of the others, the
    # catch-ups over a new prompt or a long gap, which cost like a prefill and are priced per token.
    last_decode_forward_s: tuple[float, ...] = ()
    last_catch_ups: tuple[tuple[int, float], ...] = ()
    # Per request, the distributions the last propose() drew its guesses from, [k, vocab] (a draft
    # sampling for a sampled request); absent: point masses. Replaced, never mutated, by propose().
    last_draft_probs: Mapping[str, torch.Tensor] = MappingProxyType({})
    # Whether propose() consults a ProposalGate (one knowing its confidence per guess): the speculator
    # builds a gate only for those.
    takes_gate: bool = False

    @abc.abstractmethod
    def propose(self, requests: list[Request], num_tokens: list[int],
                gate: ProposalGate | None = None) -> list[list[int]]:
        """Proposals per request, request i at most num_tokens[i] long (empty: nothing to offer).
        `gate`: where given, a proposer with a confidence per guess ends a proposal at its first
        guess the gate does not keep (the n-gram proposer has none and ignores it)."""

    def buckets(self, requests: list[Request]) -> list[int | None]:
        """Per request, the kind of proposal it would get now, by what the proposer knows of its
        quality (acceptance.py): the controller learns each kind's acceptance position by position.
        0: nothing to propose; None (the default): no kinds, one acceptance rate per request."""
        return [None] * len(requests)

    def catch_up_tokens(self, requests: list[Request]) -> list[int]:
        """Per request, the tokens the proposer must compute before it can guess (a draft model that
        sat out steps is behind by the tokens emitted since); 0 for proposers without a model."""
        return [0] * len(requests)

    def bucket_prior(self, bucket: int) -> float | None:
        """What the proposer knows beforehand of a bucket's acceptance at position 1 (the controller's
        prior until the bucket's own drafts outweigh it); None: the controller's default."""
        return None

    def forget(self, request_id: str) -> None:  # noqa: B027 - stateless proposers keep nothing
        """Drop what the proposer keeps for a request that finished or was aborted."""

    def retain(self, request_ids: Iterable[str]) -> None:  # noqa: B027
        """Drop state of every request not in `request_ids` (those the engine still holds)."""

    @property
    def cached_tokens(self) -> int:
        """Tokens of finished requests' outputs kept to guess from for others (suffix.py); 0 for the rest."""
        return 0

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of KV cache the proposer keeps per block of the target's (a draft model's own pool)."""
        return 0

    def allocate_kv(self, num_blocks: int) -> None:  # noqa: B027 - only a draft model keeps a KV cache
        """Allocate the proposer's KV cache: as many blocks as the target's."""

    def set_max_model_len(self, max_model_len: int) -> None:  # noqa: B027
        """The engine's context after the KV cache capped it."""


PROPOSERS: dict[str, type[Proposer]] = {}


def register_proposer(name: str) -> Callable[[type[Proposer]], type[Proposer]]:
    def add(cls: type[Proposer]) -> type[Proposer]:
        PROPOSERS[name] = cls
        return cls
    return add
