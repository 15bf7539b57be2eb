"""Fill-in-the-middle prompts: the legacy completions API's `suffix` for code models trained on FIM.

A FIM model reads the code before and after the cursor framed by special tokens and writes the
middle. Two vocabularies of markers are in use (prefix-suffix-middle order, the one both were
trained on first):

    <|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>   Qwen2.5-Coder, DeepSeek-Coder-V2 style
    <fim_prefix>{prefix}<fim_suffix>{suffix}<fim_middle>         StarCoder / SantaCoder style

A model is FIM-capable when all three markers are single tokens of its vocabulary; the frame is
built from token ids, so text inside the prefix or suffix that looks like a marker stays text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# (prefix, suffix, middle, markers that also end a middle: padding and repository/file separators)
_STYLES: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", ("<|fim_pad|>", "<|file_sep|>", "<|repo_name|>")),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<fim_pad>", "<file_sep>", "<reponame>", "<filename>")),
)


class _Vocabulary(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


@dataclass(frozen=True, slots=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    stops: tuple[int, ...]  # ids after which no more middle can follow (the markers, padding, separators)

    def frame(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int]) -> list[int]:
        """The prompt of one fill: prefix, then suffix, then the cue to write the middle."""
        return [self.prefix, *prefix_ids, self.suffix, *suffix_ids, self.middle]


def fim_tokens(vocabulary: _Vocabulary) -> FimTokens | None:
    """The model's FIM markers, or None where its vocabulary has no complete set."""
    for prefix, suffix, middle, enders in _STYLES:
        ids = [vocabulary.token_to_id(t) for t in (prefix, suffix, middle)]
        if all(i is not None for i in ids):
            p, s, m = (int(i) for i in ids if i is not None)
            more = [vocabulary.token_to_id(t) for t in enders]
            return FimTokens(p, s, m, (p, s, m, *(i for i in more if i is not None)))
    return None
