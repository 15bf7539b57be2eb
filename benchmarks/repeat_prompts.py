"""Prompts whose answers repeat *across* requests (benchmarks/suffix_cache.py): what agents, extraction
jobs and tool callers send, many requests of one shape with different values. Deterministic: request i
of a workload is always the same prompt, and no two of the first 24 are equal."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

Messages = list[dict[str, str]]

NAMES = ["Alice", "Bob", "Chen", "Dara", "Emeka", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi", "Lena",
         "Mateo", "Nadia", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor", "Wen", "Yara"]
CITIES = ["Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Quito", "Hanoi", "Perth", "Dublin", "Accra", "Seoul"]
JOBS = ["engineer", "nurse", "teacher", "pilot", "chef", "lawyer", "farmer", "artist"]
HOBBIES = ["the violin", "chess", "rock climbing", "pottery", "birdwatching", "sailing"]
TASKS = ["reverses a string", "checks whether a number is prime", "computes the factorial of n",
         "returns the n-th Fibonacci number", "counts vowels in a string", "flattens a nested list",
         "merges two sorted lists", "removes duplicates from a list keeping order", "computes the GCD of two integers",
         "checks whether a string is a palindrome", "transposes a matrix given as a list of lists",
         "finds the maximum subarray sum", "converts Celsius to Fahrenheit", "returns the median of a list",
         "chunks a list into pieces of size n", "counts word frequencies in a text",
         "validates an email address with a regex", "computes the dot product of two vectors",
         "returns the longest common prefix of strings", "rotates a list by k positions",
         "parses a date string YYYY-MM-DD", "sums the digits of an integer", "checks balanced parentheses",
         "converts a Roman numeral to an integer"]
TOOLS_SYSTEM = (
    "You are an agent. Call a tool by replying with exactly one line of JSON: "
    "{\"tool\": NAME, \"arguments\": {...}}. Tools: get_weather(city: str, unit: 'celsius'|'fahrenheit'), "
    "search_flights(origin: str, destination: str, date: str), send_email(to: str, subject: str, body: str).")
ASKS = ["What's the weather in {c}?", "Find me a flight from {c} to {d} on 2027-03-{day:02d}.",
        "Email {n} at {lower}@example.com that the meeting moved to Friday.",
        "Is it cold in {c} right now, in fahrenheit?"]


def extraction(i: int) -> Messages:
    """A record extraction into JSON with fixed keys (a data-processing job)."""
    rng = random.Random(i)
    name, city, job, hobby = NAMES[i % len(NAMES)], rng.choice(CITIES), rng.choice(JOBS), rng.choice(HOBBIES)
    text = f"{name} works as a {job} in {city}. Last spring {name} turned {rng.randint(20, 70)} and took up {hobby}."
    return [{"role": "system", "content": "You extract records. Reply with one JSON object with the keys \"name\", "
                                          "\"age\", \"occupation\", \"city\", \"hobbies\" (a list) and nothing else."},
            {"role": "user", "content": text}]


def tool_call(i: int) -> Messages:
    """One tool call of an agent (the envelope and argument names repeat, the values do not)."""
    rng = random.Random(1000 + i)
    c, d = rng.sample(CITIES, 2)
    name = NAMES[i % len(NAMES)]
    ask = ASKS[i % len(ASKS)].format(c=c, d=d, n=name, lower=name.lower(), day=1 + i % 28)
    return [{"role": "system", "content": TOOLS_SYSTEM}, {"role": "user", "content": ask}]


def code_function(i: int) -> Messages:
    """A short function to write (docstring and typing boilerplate repeat)."""
    return [{"role": "user", "content": f"Write a Python function with type hints and a docstring that "
                                        f"{TASKS[i % len(TASKS)]}. Only the code."}]


# name → (prompt i, max_tokens)
WORKLOADS: dict[str, tuple[Callable[[int], Messages], int]] = {
    "extraction": (extraction, 96), "tool-call": (tool_call, 64), "code-function": (code_function, 160)}

# --schema: the JSON schema each workload's answers are constrained to (structured outputs), where it has one.
SCHEMAS: dict[str, dict[str, Any]] = {
    "extraction": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "occupation": {"type": "string"},
                       "city": {"type": "string"}, "hobbies": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "occupation", "city", "hobbies"], "additionalProperties": False},
    "tool-call": {
        "type": "object",
        "properties": {"tool": {"enum": ["get_weather", "search_flights", "send_email"]},
                       "arguments": {"type": "object", "additionalProperties": {"type": "string"}}},
        "required": ["tool", "arguments"], "additionalProperties": False},
}
