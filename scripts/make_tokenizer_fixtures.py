"""Write tests/fixtures/tokenizer_golden.json: token ids and chat renders from Hugging Face transformers.

transformers loads each catalog GGUF (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`) in
30-80 s, too slow for the fast tests, so its answers are recorded once here and checked in.
Run after `tokenmill pull` of the models, from the repository root:

    PYTHONPATH=. python scripts/make_tokenizer_fixtures.py [model ...]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tokenmill.models.resolve import installed_models

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tokenizer_golden.json"
MODELS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")

TEXTS = [
    "Hello world",
    "Hello, world! How are you today?",
    "  leading spaces and trailing   ",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot\n\t\treturn sum;",
    "numbers: 1 12 123 1234 12345 3.14159 -42 1e10 0x1F 1,000,000 ²½",
    "unicode: café naïve Zürich São Paulo Ελληνικά русский 日本語 中文 한국어 العربية हिन्दी",
    "emoji: 🤗🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ✨",
    "whitespace\t\ttabs\n\n\nnewlines\r\n   \n  mixed \u00a0nbsp",
    "a     b          c\n\n\n\n\n\nd",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
    "<|endoftext|><|fim_prefix|>x = <|fim_suffix|>\nprint(x)<|fim_middle|>",
    "I'm sure they'll say it's fine, won't they? She'd've DONE IT'S",
    "URL: https://example.com/path?q=1&r=2#frag — email a.b@c.io",
    " ",
    "\n",
    "a" * 50 + " " + "ab" * 20,
    "Mixed123Numbers456and789Letters",
    '`code` **bold** _it_ [link](x) <div class="a">&amp;</div>',
    "e\u0301 decomposed vs é composed",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a prime."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "Another one, in 日本語?"},
    ],
]


def reference_tokenizer(name: str, gguf_path: Path) -> Any:
    """transformers' tokenizer for a GGUF, corrected where its GGUF loader is known to be wrong.

    transformers has no split regex for `tokenizer.ggml.pre = "smollm"` and falls back to GPT-2's,
    which keeps digits together (" ²½" becomes one piece). SmolLM2's own tokenizer.json, and
    llama.cpp, split every digit first: restore that pre-tokenizer so the reference is the model's.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if name.startswith("smollm"):
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    return tokenizer


def golden_for(name: str, gguf_path: Path) -> dict[str, Any]:
    tokenizer = reference_tokenizer(name, gguf_path)
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in TEXTS]
    entry: dict[str, Any] = {
        "gguf_name": gguf_path.name,
        "gguf_size": gguf_path.stat().st_size,
        "ids": ids,
        "ids_with_special": [tokenizer(text)["input_ids"] for text in TEXTS],
        "decoded": [tokenizer.decode(i, skip_special_tokens=True) for i in ids],
        "chats": None,
    }
    if tokenizer.chat_template:
        entry["chats"] = [
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in CONVERSATIONS
        ]
    print(f"{name}: {len(TEXTS)} texts, chat template: {tokenizer.chat_template is not None}", file=sys.stderr)
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    args = parser.parse_args()
    installed = installed_models()
    golden = json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else {}
    if golden.get("texts") != TEXTS or golden.get("conversations") != CONVERSATIONS:
        golden = {"models": {}}  # other models' ids were recorded for other inputs
    golden.update({"texts": TEXTS, "conversations": CONVERSATIONS})
    for name in args.models:
        if name not in installed:
            sys.exit(f"model {name!r} is not installed: run `tokenmill pull {name}` first")
        golden["models"][name] = golden_for(name, installed[name])
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {FIXTURE}", file=sys.stderr)


if __name__ == "__main__":
    main()
