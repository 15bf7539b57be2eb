"""A scripted byte-level model, as an in-process `Backend` and as an OpenAI-compatible HTTP server.

Tokens are UTF-8 bytes (0-255) plus BOS (256) and EOS (257). After token t the model puts
probability `p_next` on (t + 1) % 256, `p_same` on t itself, and spreads the rest evenly over the
other 256 tokens, so every logprob it reports can be written down by hand.
"""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tokenmill.eval.client import Backend, GenerateOptions, Generation, PositionLogprobs, Progress, Prompt

BOS, EOS, VOCAB = 256, 257, 258


@dataclass(frozen=True)
class FakeModel:
    p_next: float = 0.6
    p_same: float = 0.3
    temperature_bug: float | None = None  # sample at this temperature when asked for greedy

    def logprobs(self, previous: int) -> list[float]:
        rest = (1.0 - self.p_next - self.p_same) / (VOCAB - 2)
        probs = [rest] * VOCAB
        probs[(previous + 1) % 256] = self.p_next
        probs[previous % 256 if previous < 256 else 0] = self.p_same
        return [math.log(p) for p in probs]

    def top(self, previous: int, k: int) -> list[tuple[int, float]]:
        lps = self.logprobs(previous)
        order = sorted(range(VOCAB), key=lambda t: (-lps[t], t))
        return [(t, lps[t]) for t in order[:k]]

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def score(self, prompt: list[int], top_k: int) -> list[PositionLogprobs]:
        out = []
        for i in range(1, len(prompt)):
            lps = self.logprobs(prompt[i - 1])
            top: dict[int | str, float] = {t: v for t, v in self.top(prompt[i - 1], top_k)}
            top.setdefault(prompt[i], lps[prompt[i]])
            out.append(PositionLogprobs(prompt[i], lps[prompt[i]], top))
        return out

    def generate(self, prompt: list[int], options: GenerateOptions, rng: random.Random) -> list[int]:
        tokens: list[int] = []
        last = prompt[-1]
        temperature = options.temperature if self.temperature_bug is None else self.temperature_bug
        for _ in range(options.max_tokens):
            lps = self.logprobs(last)
            if temperature == 0:
                token = max(range(256), key=lambda t: lps[t])
            else:
                weights = [math.exp(v / temperature) for v in lps[:256]]
                token = rng.choices(range(256), weights)[0]
            tokens.append(token)
            last = token
        return tokens

    def decode(self, tokens: list[int]) -> str:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")


class FakeBackend(Backend):
    """The fake model in process; `completions` overrides generate for scripted outputs."""

    def __init__(self, model: FakeModel | None = None, completions: dict[str, str] | None = None,
                 name: str = "fake", max_len: int = 4096) -> None:
        self.model = model or FakeModel()
        self.max_len = max_len
        self.num_score_requests = 0
        self.completions = completions
        self.name = name
        self.rng = random.Random(0)

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text)

    def prefix_token(self) -> int:
        return BOS

    def max_length(self) -> int:
        return self.max_len

    def prompt_bos(self) -> int | None:
        return None

    def score(self, prompts: Sequence[list[int]], top_k: int,
              progress: Progress | None = None) -> list[list[PositionLogprobs]]:
        assert all(len(p) <= self.max_len for p in prompts)
        self.num_score_requests += len(prompts)
        return [self.model.score(list(p), top_k) for p in prompts]

    def generate(self, prompts: Sequence[Prompt], options: GenerateOptions,
                 progress: Progress | None = None) -> list[Generation]:
        out = []
        for prompt in prompts:
            ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
            if self.completions is not None:
                text = self.completions.get(prompt if isinstance(prompt, str) else "", "")
                out.append(Generation(text, self.tokenize(text)))
                continue
            tokens = self.model.generate(ids, options, self.rng)
            out.append(Generation(self.model.decode(tokens), tokens))
        return out

    def describe(self) -> dict[str, Any]:
        return {"kind": "fake", "model": self.name}


class FakeServer:
    """The fake model behind /v1/models, /tokenize, /tokenizer_info and /v1/completions."""

    def __init__(self, model: FakeModel | None = None, name: str = "fake") -> None:
        self.model = model or FakeModel()
        self.name = name
        self.requests: list[dict[str, Any]] = []
        self.rng = random.Random(0)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, payload: dict[str, Any]) -> None:
                body = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    card = {"id": fake.name, "object": "model", "max_model_len": 4096}
                    self._send({"object": "list", "data": [card]})
                elif self.path == "/tokenizer_info":
                    self._send({"bos_token_id": BOS, "eos_token_id": EOS})
                else:
                    self.send_error(404)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append(body)
                if self.path == "/tokenize":
                    self._send({"tokens": fake.model.tokenize(body["prompt"])})
                elif self.path == "/v1/completions":
                    self._send(fake.complete(body))
                else:
                    self.send_error(404)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        prompt = body["prompt"]
        ids = self.model.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        options = GenerateOptions(int(body.get("max_tokens", 16)), temperature=float(body.get("temperature", 1.0)))
        out = self.model.generate(ids, options, self.rng)
        k = body.get("logprobs")

        def name(t: int) -> str:
            return f"token_id:{t}" if body.get("return_tokens_as_token_ids") else self.model.decode([t])

        tokens, lps, tops = [], [], []
        seq = [*ids, *out] if body.get("echo") else out
        offset = len(ids) if not body.get("echo") else 0
        for i, t in enumerate(seq):
            pos = i + offset
            previous = ids[pos - 1] if pos - 1 < len(ids) else out[pos - 1 - len(ids)]
            tokens.append(name(t))
            if pos == 0:
                lps.append(None)
                tops.append(None)
                continue
            lp = self.model.logprobs(previous)
            lps.append(lp[t])
            top = {name(a): v for a, v in self.model.top(previous, k or 0)}
            top.setdefault(name(t), lp[t])
            tops.append(top)
        text = (self.model.decode(ids) if body.get("echo") else "") + self.model.decode(out)
        logprobs = {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops} if k is not None else None
        return {"choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "length"}]}
