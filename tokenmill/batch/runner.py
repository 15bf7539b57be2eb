"""`tokenmill batch`: run an OpenAI Batch API file in-process at full throughput, resumably.

    INPUT.jsonl ──parse──▶ engine requests (≤ max_in_flight at once, one continuous batch)
                                 │ step() until each line's n × prompts choices finish
    OUTPUT.jsonl ◀──append+flush─┘ one result line per input line, in finish order

Resume: lines already in the output (by custom_id) are skipped, so a killed job re-run with the
same arguments loses and duplicates nothing. A kill can leave a half-written last line; it is cut
off before appending. Lines without a readable custom_id are tracked by their line number.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tqdm import tqdm

from tokenmill.batch.beams import BeamLine
from tokenmill.batch.requests import (
    BatchLineError,
    BatchRequest,
    build_request,
    custom_id_of,
    error_line,
    line_id,
    read_envelope,
    success_line,
)
from tokenmill.engine.outputs import PromptLogprobsCarry, RequestOutput
from tokenmill.errors import RequestValidationError
from tokenmill.llm import LLM
from tokenmill.server.state import TokenTexts

log = logging.getLogger(__name__)

DEFAULT_MAX_IN_FLIGHT = 256  # engine requests; bounds host memory for outputs and pending text


@dataclass(slots=True)
class BatchSummary:
    num_succeeded: int = 0
    num_failed: int = 0
    num_skipped: int = 0  # already in the output, or a repeated custom_id
    num_generated_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(slots=True)
class _InFlight:
    request: BatchRequest
    outputs: dict[int, RequestOutput] = field(default_factory=dict)  # the finished engine request of each choice
    beams: BeamLine | None = None  # a use_beam_search line: its searches, whose steps are the engine requests


# ---------------------------------------------------------------------------- resume bookkeeping


def line_key(custom_id: str | None, line_no: int) -> str:
    """What identifies an input line across runs: its custom_id, else its line number."""
    return custom_id if custom_id is not None else f"@line{line_no}"


def completed_keys(output_path: Path) -> set[str]:
    """Keys of the lines already answered in `output_path`; drops a torn or corrupt line first,
    so appending starts on a clean line boundary."""
    if not output_path.exists():
        return set()
    raw = output_path.read_bytes()
    keys: set[str] = set()
    kept: list[bytes] = []
    for line in raw.split(b"\n"):
        key = _result_key(line)
        if key is not None:
            keys.add(key)
            kept.append(line)
    clean = b"".join(line + b"\n" for line in kept)
    if clean != raw:
        log.warning("%s: dropping %d bytes of incomplete or corrupt output lines", output_path,
                    len(raw) - len(clean))
        _atomic_write(output_path, clean)
    return keys


def _result_key(line: bytes) -> str | None:
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict):
        return None
    custom_id, result_id = record.get("custom_id"), record.get("id")
    if isinstance(custom_id, str):
        return custom_id
    prefix = line_id(0).removesuffix("0")
    if isinstance(result_id, str) and result_id.startswith(prefix) and result_id[len(prefix):].isdigit():
        return line_key(None, int(result_id[len(prefix):]))
    return None


def _atomic_write(path: Path, data: bytes) -> None:
    # Rewrite via a temporary file: a kill during the rewrite must not lose the finished lines.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _input_lines(input_path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of the non-blank lines; streamed, so inputs may be large."""
    with input_path.open(encoding="utf-8", errors="replace") as handle:
        for line_no, line in enumerate(handle, start=1):
            if line.strip():
                yield line_no, line


def _count_pending(input_path: Path, done: set[str]) -> int:
    keys = {line_key(custom_id_of(line), n) for n, line in _input_lines(input_path)}
    return len(keys - done)


# ----------------------------------------------------------------------------------- the job


class BatchJob:
    """Feeds parsed lines into the engine core and writes each line's result when it completes."""

    def __init__(self, llm: LLM, output: IO[str], model_name: str, max_in_flight: int, bar: tqdm[Any]) -> None:
        self.engine = llm.engine
        self.output = output
        self.model_name = model_name
        self.texts = TokenTexts(llm.engine.tokenizer)  # logprobs' token texts, cached across lines
        self.max_in_flight = max_in_flight
        self.bar = bar
        self.in_flight: dict[str, _InFlight] = {}
        self._prompt_logprobs = PromptLogprobsCarry()
        self.num_engine_requests = 0
        self.summary = BatchSummary()
        self._started = time.monotonic()
        self._next_key = 0

    def run(self, lines: Iterator[tuple[int, str]], done: set[str]) -> BatchSummary:
        for line_no, line in lines:
            self._take(line_no, line, done)
        while self.engine.has_unfinished:
            self._step()
        self.summary.elapsed_s = time.monotonic() - self._started
        return self.summary

    def _take(self, line_no: int, line: str, done: set[str]) -> None:
        custom_id = custom_id_of(line)
        key = line_key(custom_id, line_no)
        if key in done:
            self.summary.num_skipped += 1
            return
        done.add(key)  # a repeated custom_id later in the file is skipped, not answered twice
        beams = None
        try:
            checked_id, endpoint, body = read_envelope(line)
            request = build_request(checked_id, endpoint, body, self.engine.tokenizer, self.engine.limits,
                                    self.engine.structured)
            if request.use_beam_search:
                beams = BeamLine(request, self.engine.limits.max_model_len, self.engine.eos_token_ids)
        except RequestValidationError as exc:  # a beam width the engine cannot score
            self._write(error_line(custom_id, BatchLineError(str(exc), param=exc.param), line_no))
            self.summary.num_failed += 1
            return
        except BatchLineError as error:
            self._write(error_line(custom_id, error, line_no))
            self.summary.num_failed += 1
            return
        self._wait_for_room(request.num_choices if beams is None else beams.num_engine_requests)
        self._submit(request, beams)

    def _wait_for_room(self, num_needed: int) -> None:
        # A line wider than the bound alone still runs: once nothing else is in flight.
        while self.num_engine_requests and self.num_engine_requests + num_needed > self.max_in_flight:
            self._step()

    def _submit(self, request: BatchRequest, beams: BeamLine | None) -> None:
        key = str(self._next_key)
        self._next_key += 1
        self.in_flight[key] = _InFlight(request, beams=beams)
        if beams is not None:
            self._submit_beam_step(key, beams)
            return
        for child in request.children:
            self.engine.add_request(f"{key}/{child.index}", child.prompt, child.params, index=child.index,
                                    priority=request.priority, service_class=request.service_class)
        self.num_engine_requests += request.num_choices

    def _submit_beam_step(self, key: str, beams: BeamLine) -> None:
        for suffix, prompt, params in beams.step_requests():
            self.engine.add_request(f"{key}/{suffix}", prompt, params, priority=beams.request.priority,
                                    service_class=beams.request.service_class)
            self.num_engine_requests += 1

    def _step(self) -> None:
        step = self.engine.step()
        self.summary.num_generated_tokens += step.stats.num_generation_tokens
        for output in map(self._prompt_logprobs.carry, step.outputs):
            if output.finished:
                self._finish_choice(output.request_id, output)
        self._show_rate()

    def _finish_choice(self, engine_id: str, output: RequestOutput) -> None:
        key, _, index = engine_id.partition("/")
        entry = self.in_flight[key]
        self.num_engine_requests -= 1
        request, beams = entry.request, entry.beams
        if beams is not None:
            if not beams.record(index, output):
                return
            if not beams.advance():
                self._submit_beam_step(key, beams)
                return
            request, outputs = beams.answer(self.engine.tokenizer)
        else:
            entry.outputs[int(index)] = output
            if len(entry.outputs) < request.num_choices:
                return
            outputs = [entry.outputs[i] for i in range(request.num_choices)]
        del self.in_flight[key]
        self._write(success_line(request, outputs, self.model_name, self.texts))
        self.summary.num_succeeded += 1

    def _write(self, record: dict[str, Any]) -> None:
        # One write per line, flushed: a kill loses at most the line being written.
        self.output.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.output.flush()
        self.bar.update(1)

    def _show_rate(self) -> None:
        elapsed = time.monotonic() - self._started
        if elapsed > 0:
            rate = self.summary.num_generated_tokens / elapsed
            self.bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)


def run_batch(llm: LLM, input_path: Path, output_path: Path, *, model_name: str,
              max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, progress: bool = True) -> BatchSummary:
    """Answer every line of `input_path` not yet answered in `output_path` (appending to it)."""
    if max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    done = completed_keys(output_path)
    pending = _count_pending(input_path, done)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    with output_path.open("a", encoding="utf-8") as output, \
            tqdm(total=pending, desc="batch", unit="req", disable=not progress, dynamic_ncols=True) as bar:
        job = BatchJob(llm, output, model_name, max_in_flight, bar)
        return job.run(_input_lines(input_path), done)
