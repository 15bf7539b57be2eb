"""The prompts of the speculative-decoding benchmarks (speculative.py, draft_confidence.py): code edits
whose answers copy most of the prompt ("rewrite this function with type hints"), and chat prompts
whose answers do not."""

from __future__ import annotations

from collections.abc import Callable

FUNCTIONS = [
    '''def merge_intervals(intervals):
    intervals.sort(key=lambda x: x[0])
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged
''',
    '''def word_counts(path, min_len=1):
    counts = {}
    with open(path) as f:
        for line in f:
            for word in line.lower().split():
                word = word.strip(".,;:!?")
                if len(word) >= min_len:
                    counts[word] = counts.get(word, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])
''',
    '''def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''',
]
CHAT = "Explain in three short paragraphs how a hash map handles collisions."
CHATS = [CHAT, "Write a short story about a robot learning to paint.",
         "What are the main differences between TCP and UDP?"]


def edit_prompt(i: int, context: str = "") -> list[dict[str, str]]:
    """Code edit i; `context`: source code an agent would have put in the prompt first (a system message)."""
    code = FUNCTIONS[i % len(FUNCTIONS)]
    edit = [{"role": "user", "content": f"Rewrite this function with type hints. Change nothing else.\n\n{code}"}]
    if not context:
        return edit
    return [{"role": "system", "content": f"Files of the repository you are working in:\n\n{context}"}, *edit]


def code_context(encode: Callable[[str], list[int]], tokens: int) -> str:
    """About `tokens` tokens of Python source (the stdlib modules `tokenmill bench` cuts code from), cut
    at a line end: a long agent prompt whose code is not the function being edited."""
    from tokenmill.bench.corpus import TextKind, corpus_text

    lines, total = [], 0
    for line in corpus_text(TextKind.CODE).splitlines(keepends=True):
        total += len(encode(line))
        if total > tokens:
            break
        lines.append(line)
    return "".join(lines)
