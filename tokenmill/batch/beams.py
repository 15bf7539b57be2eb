"""`use_beam_search` lines of `tokenmill batch`: the server's search (server/beam_api.py over
engine/beam_search.py), stepped by the batch job instead of an event loop.

Each step scores every live beam of every prompt of the line as its own engine request (one token, the top
candidates' logprobs), batched with whatever else the job runs; when a step's last score is in, every live
search advances and the next step's requests go in. The line's answer is built from the n best beams of
each prompt, as the server builds it.
"""

from __future__ import annotations

from dataclasses import replace

from tokenmill.batch.requests import BatchRequest
from tokenmill.engine.inputs import ChildRequest, EncodedPrompt
from tokenmill.engine.outputs import RequestOutput
from tokenmill.engine.request import SamplingParams, TokenLogprob
from tokenmill.models.loading.tokenizer import Tokenizer
from tokenmill.server.beam_api import beam_choice, beam_logprobs, prompt_searches
from tokenmill.server.protocol import ChatRequest, CompletionRequest


class BeamLine:
    """One line's searches, one per prompt. Raises RequestValidationError for a width the engine cannot score."""

    def __init__(self, request: BatchRequest, max_model_len: int, eos_token_ids: tuple[int, ...]) -> None:
        assert isinstance(request.body, CompletionRequest | ChatRequest) and request.body.use_beam_search
        self.request = request
        self.body = request.body
        self.num_logprobs = beam_logprobs(self.body)
        self.prompts = prompt_searches(self.body, request.children, max_model_len, eos_token_ids, self.num_logprobs)
        self._tops: list[dict[int, TokenLogprob]] = [{} for _ in self.prompts]  # this step's scores, by beam
        self.step = 0
        self._num_pending = 0

    @property
    def num_engine_requests(self) -> int:
        """The most engine requests one step runs: every prompt's full width."""
        return len(self.prompts) * self.prompts[0].search.params.beam_width

    def step_requests(self) -> list[tuple[str, EncodedPrompt, SamplingParams]]:
        """This step's scoring requests: (an id suffix unique within the line, prompt, parameters)."""
        requests = []
        for p, run in enumerate(self.prompts):
            if run.search.is_done:
                continue
            params = run.step_params(self.step)
            prompt = run.child.prompt
            requests += [(f"{self.step}.{p}.{i}",
                          replace(prompt, text=None, token_ids=[*prompt.token_ids, *beam.token_ids]), params)
                         for i, beam in enumerate(run.search.beams)]
        self._num_pending = len(requests)
        return requests

    def record(self, suffix: str, output: RequestOutput) -> bool:
        """A finished scoring request (its id's suffix from `step_requests`); True when it was the step's last."""
        _, p, i = (int(part) for part in suffix.split("."))
        run = self.prompts[p]
        logprobs = output.outputs[0].logprobs
        assert logprobs, "a scoring request ended without its logprobs"
        self._tops[p][i] = logprobs[0]
        if self.step == 0 and i == 0:
            run.note_first(output)
        self._num_pending -= 1
        return self._num_pending == 0

    def advance(self) -> bool:
        """Every live search takes the step just scored; True when all are done."""
        for run, tops in zip(self.prompts, self._tops, strict=True):
            if not run.search.is_done:
                run.search.advance([tops[i] for i in range(len(run.search.beams))])
                tops.clear()
        self.step += 1
        return all(run.search.is_done for run in self.prompts)

    def answer(self, tokenizer: Tokenizer) -> tuple[BatchRequest, list[RequestOutput]]:
        """The line's request and one finished output per choice (choice i of prompt p: p's i-th best beam),
        as `success_line` takes them; a choice past a search's results is left out, as the server does."""
        kept: list[ChildRequest] = []
        outputs: list[RequestOutput] = []
        for child in self.request.children:
            run = self.prompts[child.prompt_index]
            choice = beam_choice(child, run.search, self.body.n, tokenizer, self.num_logprobs)
            if choice is not None:
                kept.append(child)
                outputs.append(RequestOutput(str(child.index), child.prompt.text, child.prompt.token_ids, [choice],
                                             True, run.first, prompt_logprobs=run.prompt_logprobs))
        return replace(self.request, children=kept), outputs
