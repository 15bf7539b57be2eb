"""Owns text: incremental detokenization, stop strings, and turning engine deltas into outputs.

Stop strings are matched on text, possibly across token boundaries. While a request runs we
hold back the last (longest stop string - 1) characters, since they could be the start of a
stop string; a match truncates the text (the stop string itself is not emitted unless asked)
and the request's id comes back in `reqs_to_abort`: the engine core still runs it until aborted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Protocol

from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from tokenmill.engine.request import EngineOutput, FinishReason, SamplingParams, TokenLogprob


class DecodeStream(Protocol):
    def step(self, token_id: int) -> str: ...


class TextTokenizer(Protocol):
    def new_decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream: ...


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    index: int
    stream: DecodeStream
    text: str = ""
    num_emitted_chars: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def holdback(self) -> int:
        return max((len(s) for s in self.params.stop), default=1) - 1


@dataclass(slots=True)
class ProcessedOutputs:
    outputs: list[RequestOutput]  # one per engine output of a request still tracked, in engine order
    reqs_to_abort: list[str]  # ended by a stop string here: abort them in the engine core


class OutputProcessor:
    def __init__(self, tokenizer: TextTokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
            index: int = 0) -> None:
        stream = self.tokenizer.new_decode_stream(skip_special_tokens=params.skip_special_tokens)
        self.states[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params, index, stream)

    def process_outputs(self, engine_outputs: Iterable[EngineOutput]) -> ProcessedOutputs:
        """Text for every engine output; outputs of requests already finished here are dropped."""
        result = ProcessedOutputs([], [])
        for out in engine_outputs:
            state = self.states.get(out.request_id)
            if state is None:
                continue
            output, stopped_by_string = self._process(state, out)
            result.outputs.append(output)
            if stopped_by_string:
                result.reqs_to_abort.append(out.request_id)
        return result

    def _process(self, state: _RequestState, out: EngineOutput) -> tuple[RequestOutput, bool]:
        finish = out.finish_reason
        stop_reason: str | int | None = None
        if finish is FinishReason.STOP and out.new_token_ids and out.new_token_ids[-1] in state.params.stop_token_ids:
            stop_reason = out.new_token_ids[-1]
        finish_by_text, stop_str = self._append(state, out)
        if finish_by_text:
            finish, stop_reason = FinishReason.STOP, stop_str
        finished = finish is not None
        if finished:
            del self.states[out.request_id]
        delta = self._emit(state, finished)
        metrics = None if out.times is None else RequestMetrics.from_times(out.times, out.num_cached_tokens, out.spec)
        # Snapshots, not the live lists: the server renders an update on its own thread, possibly
        # after this processor has appended the next step's tokens; ids and logprobs must agree.
        completion = CompletionOutput(state.index, state.text[:state.num_emitted_chars], list(state.token_ids),
                                      list(state.logprobs) if state.params.logprobs is not None else None,
                                      finish, stop_reason, delta, len(out.new_token_ids))
        result = RequestOutput(out.request_id, state.prompt, state.prompt_token_ids, [completion], finished,
                               metrics, out.num_cached_tokens)
        if out.prompt_logprobs is not None:
            result.prompt_logprobs = [None, *out.prompt_logprobs]
        return result, finish_by_text and out.finish_reason is None

    def _append(self, state: _RequestState, out: EngineOutput) -> tuple[bool, str | None]:
        if state.params.stop and len(out.new_token_ids) > 1:
            # Several tokens in one step (speculative decoding): look for stop strings after each,
            # as if they had come one per step, so the tokens past the one completing a stop
            # string are dropped exactly as the engine would never have generated them.
            last = len(out.new_token_ids) - 1
            for i, token_id in enumerate(out.new_token_ids):
                one = replace(out, new_token_ids=[token_id], new_logprobs=out.new_logprobs[i:i + 1],
                              finish_reason=out.finish_reason if i == last else None)
                found = self._append_tokens(state, one)
                if found[0]:
                    return found
            return False, None
        return self._append_tokens(state, out)

    def _append_tokens(self, state: _RequestState, out: EngineOutput) -> tuple[bool, str | None]:
        state.token_ids.extend(out.new_token_ids)
        state.logprobs.extend(out.new_logprobs)
        is_eos_end = out.finish_reason is FinishReason.STOP and not state.params.include_stop_str_in_output
        pieces = []
        for i, token_id in enumerate(out.new_token_ids):
            last = i == len(out.new_token_ids) - 1
            if last and is_eos_end:
                break  # the EOS / stop token's text is not part of the completion
            pieces.append(state.stream.step(token_id))
        previous_len = len(state.text)
        state.text += "".join(pieces)
        return self._find_stop(state, previous_len)

    def _find_stop(self, state: _RequestState, previous_len: int) -> tuple[bool, str | None]:
        if not state.params.stop:
            return False, None
        start = max(0, previous_len - state.holdback)
        best: tuple[int, str] | None = None
        for stop in state.params.stop:
            pos = state.text.find(stop, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return False, None
        pos, stop = best
        end = pos + len(stop) if state.params.include_stop_str_in_output else pos
        state.text = state.text[:end]
        return True, stop

    def _emit(self, state: _RequestState, finished: bool) -> str:
        """Advance the emitted prefix; keep back a possible stop-string start unless finished."""
        limit = len(state.text) if finished or not state.params.stop else \
            max(state.num_emitted_chars, len(state.text) - state.holdback)
        delta = state.text[state.num_emitted_chars:limit]
        state.num_emitted_chars = limit
        return delta

    def abort(self, request_id: str) -> None:
        self.states.pop(request_id, None)
