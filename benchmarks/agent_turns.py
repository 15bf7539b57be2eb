"""An agent's tool loop over /v1/responses with `previous_response_id` (or, with --api chat, over
/v1/chat/completions sending the whole conversation back each turn, the assistant's messages as received):
how much of each turn's prompt the prefix cache already holds, and how long each turn takes to its first event.

A server is started on --model; the agent (system instructions, one `read_file` tool) asks a question that
invites a call, answers every call with a file's text, and asks a follow-up where the model answered in
text, for --turns turns. Per turn it prints the prompt tokens, the cached ones, the tokens the conversation
held before the turn (the previous prompt and answer, less the answer's last token, which no step computed:
what a perfect cache could hold), their ratio, and the first-event time. The ratio is the figure: 1.0 means
every token of the earlier turns was reused (full blocks and, since partial blocks, the last one's rows: the
history repeats the tokens the model wrote), and each turn pays only for its new input. And
how many turns called a tool again right after a tool result: an agent that does so every time never answers
(how a history shown in a form the model did not learn showed itself; docs/structured_outputs.md).

    flock /tmp/tokenmill-bench.lock python benchmarks/agent_turns.py --model qwen2.5-coder-1.5b
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from typing import Any

import common  # type: ignore[import-not-found]

TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file of the repository",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
QUESTION = "What does setup.py in this repository do? Call read_file on it."
INSTRUCTIONS = ("You are a coding agent working in a Python repository. Use the read_file tool to inspect files "
                "before you answer; answer briefly once you know enough. ") * 4
FILE_TEXT = "from setuptools import setup\n\nsetup(name='demo', version='0.1', packages=['demo'])\n"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-1.5b")
    p.add_argument("--api", choices=["responses", "chat"], default="responses")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-output-tokens", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args()


def run_turns(client: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    turns: list[dict[str, Any]] = []
    kwargs: dict[str, Any] = {"model": args.model, "instructions": INSTRUCTIONS, "tools": TOOLS, "temperature": 0.0,
                              "max_output_tokens": args.max_output_tokens}
    inputs: Any = QUESTION
    previous: Any = None
    for turn in range(args.turns):
        started = time.perf_counter()
        stream = client.responses.create(stream=True, input=inputs, **kwargs,
                                         **({"previous_response_id": previous.id} if previous is not None else {}))
        first_s, response = None, None
        for event in stream:
            if first_s is None and event.type in ("response.output_text.delta", "response.output_item.added"):
                first_s = time.perf_counter() - started
            if event.type in ("response.completed", "response.incomplete"):
                response = event.response
        assert response is not None, "the stream ended without a response"
        held = 0 if previous is None else previous.usage.input_tokens + previous.usage.output_tokens
        reusable = max(held - 1, 0)
        cached = response.usage.input_tokens_details.cached_tokens
        calls = [item for item in response.output if item.type == "function_call"]
        turns.append({"turn": turn, "input_tokens": response.usage.input_tokens, "cached_tokens": cached,
                      "reusable_tokens": reusable, "cached_of_reusable": cached / reusable if reusable else None,
                      "first_event_s": first_s, "output_tokens": response.usage.output_tokens,
                      "items": [item.type for item in response.output]})
        if calls:
            inputs = [{"type": "function_call_output", "call_id": c.call_id, "output": json.dumps({"text": FILE_TEXT})}
                      for c in calls]
        else:
            inputs = f"Good. Now read demo/module_{turn}.py with the tool."
        previous = response
    return turns


def run_chat_turns(client: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same loop as a chat-completions agent keeps it: the whole conversation sent every turn."""
    tools = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
    messages: list[Any] = [{"role": "system", "content": INSTRUCTIONS},
                           {"role": "user", "content": QUESTION}]
    turns: list[dict[str, Any]] = []
    held = 0
    for turn in range(args.turns):
        started = time.perf_counter()
        first_s, usage, calls, content = None, None, {}, ""
        for chunk in client.chat.completions.create(model=args.model, messages=messages, tools=tools, temperature=0.0,
                                                    max_tokens=args.max_output_tokens, stream=True,
                                                    stream_options={"include_usage": True}):
            usage = chunk.usage or usage
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            if first_s is None and (delta.content or delta.tool_calls):
                first_s = time.perf_counter() - started
            content += delta.content or ""
            for d in delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += d.id or ""
                entry["name"] += (d.function.name or "") if d.function else ""
                entry["arguments"] += (d.function.arguments or "") if d.function else ""
        assert usage is not None, "the stream ended without its usage"
        reusable = max(held - 1, 0)
        cached = usage.prompt_tokens_details.cached_tokens
        turns.append({"turn": turn, "input_tokens": usage.prompt_tokens, "cached_tokens": cached,
                      "reusable_tokens": reusable, "cached_of_reusable": cached / reusable if reusable else None,
                      "first_event_s": first_s, "output_tokens": usage.completion_tokens,
                      "items": ["function_call"] * len(calls) or ["message"]})
        held = usage.prompt_tokens + usage.completion_tokens
        message: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            message["tool_calls"] = [{"id": c["id"], "type": "function",
                                      "function": {"name": c["name"], "arguments": c["arguments"]}}
                                     for _, c in sorted(calls.items())]
        messages.append(message)
        if calls:
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": json.dumps({"text": FILE_TEXT})}
                         for _, c in sorted(calls.items())]
        else:
            messages.append({"role": "user", "content": f"Good. Now read demo/module_{turn}.py with the tool."})
    return turns


def main() -> None:
    args = parse_args()
    import openai

    port = common.free_port()
    argv = [sys.executable, "-m", "tokenmill", "serve", args.model, "--port", str(port), "--threads", str(args.threads)]
    log = common.ROOT / ".cache" / "agent-turns-logs" / f"{args.api}_{args.model}.log"
    with common.server_process(argv, f"http://127.0.0.1:{port}/ready", log, args.threads):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        turns = (run_chat_turns if args.api == "chat" else run_turns)(client, args)
    common.print_table(["turn", "items", "prompt", "cached", "reusable", "cached/reusable", "first event s"],
                       [[t["turn"], ",".join(t["items"]), t["input_tokens"], t["cached_tokens"], t["reusable_tokens"],
                         t["cached_of_reusable"], t["first_event_s"]] for t in turns])
    ratios = [t["cached_of_reusable"] for t in turns if t["cached_of_reusable"] is not None]
    # A turn that follows a tool result should answer; calling again is how a history the model misreads shows
    # (an agent framework then loops to its turn limit)
    recalls = sum("function_call" in later["items"] for earlier, later in itertools.pairwise(turns)
                  if "function_call" in earlier["items"])
    summary = {"min_cached_of_reusable": min(ratios) if ratios else None, "calls_right_after_a_result": recalls}
    print(f"cached / reusable, the worst turn: {summary['min_cached_of_reusable']}; turns that called again right "
          f"after a tool result: {recalls}")
    common.save_json(f"agent_turns_{args.api}", args.model, {"args": vars(args), "turns": turns, **summary})


if __name__ == "__main__":
    main()
