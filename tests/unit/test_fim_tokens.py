"""Fill-in-the-middle markers (models/loading/fim.py): found only as a complete set of single tokens."""

from __future__ import annotations

from tokenmill.models.loading.fim import FimTokens, fim_tokens


class _Vocab:
    def __init__(self, tokens: dict[str, int]) -> None:
        self.tokens = tokens

    def token_to_id(self, token: str) -> int | None:
        return self.tokens.get(token)


def test_qwen_style_markers_frame_prefix_suffix_middle_and_stop_on_separators() -> None:
    vocab = _Vocab({"<|fim_prefix|>": 10, "<|fim_suffix|>": 11, "<|fim_middle|>": 12, "<|fim_pad|>": 13,
                    "<|file_sep|>": 14, "<fim_prefix>": 20, "<fim_suffix>": 21, "<fim_middle>": 22})
    fim = fim_tokens(vocab)
    assert fim == FimTokens(10, 11, 12, (10, 11, 12, 13, 14))
    assert fim.frame([1, 2], [3]) == [10, 1, 2, 11, 3, 12]
    assert fim.frame([], []) == [10, 11, 12]


def test_starcoder_style_markers_and_an_incomplete_set() -> None:
    starcoder = _Vocab({"<fim_prefix>": 1, "<fim_suffix>": 2, "<fim_middle>": 3})
    assert fim_tokens(starcoder) == FimTokens(1, 2, 3, (1, 2, 3))
    assert fim_tokens(_Vocab({"<|fim_prefix|>": 1, "<|fim_middle|>": 3})) is None
    assert fim_tokens(_Vocab({})) is None
