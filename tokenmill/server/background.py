"""Background responses (`background: true` on POST /v1/responses): the request is answered at once with a
`queued` response while the engine runs it on; the client polls GET /v1/responses/{id}, streams its events
(GET ...?stream=true&starting_after=N: resumable, every event is kept with its sequence number), or
cancels it (POST /v1/responses/{id}/cancel).

    POST ──▶ BackgroundJob ──task──▶ GenerationRun.updates() ──▶ ResponseEvents ──▶ job.events (append-only)
                 ▲                                                                    │
      GET: snapshot()      GET ?stream / POST with stream: follow(after) ◀────────────┘

A job is held in `BackgroundJobs` while it runs (never evicted: admission bounds how many run at once, and
a running job keeps its admission ticket, so a SIGTERM drain waits for it) and its event log is kept after
it ends, bounded like the response store, so a client that lost its stream resumes it from the last
sequence number it saw. The finished response goes to the response store like any other. A client leaving
a stream does not stop the job: only cancel, DELETE or the server's shutdown do.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any

from tokenmill.bounded_lru import BoundedLru
from tokenmill.server.errors import api_error_for

if TYPE_CHECKING:  # the server state holds the jobs, and the run and the renderer import the state
    from tokenmill.server.fanout import GenerationRun
    from tokenmill.server.responses_output import ResponseEvents

Json = dict[str, Any]

_TERMINAL = frozenset({"completed", "incomplete", "cancelled", "failed"})


class BackgroundJob:
    """One background response. Once it has ended it keeps only its events and final response (what a
    resumed stream and GET read), not its run, prompt or conversation: ended jobs are kept by the hundred."""

    def __init__(self, renderer: ResponseEvents, run: GenerationRun) -> None:
        self.response_id = renderer.ctx.response_id
        self.owner = renderer.ctx.owner
        self.input_items = renderer.ctx.input_items  # while it runs; then the response store has them
        self.events: list[Json] = []  # events[i]["sequence_number"] == i
        self.status = "queued"
        self.final: Json | None = None  # the response object once it ended
        self.num_bytes = 0  # of the events' JSON, for the ended jobs' size budget
        self._renderer: ResponseEvents | None = renderer  # None once ended
        self._run_ = run
        self._changed = asyncio.Event()  # replaced on every change: a follower waits on the one it saw
        self._task: asyncio.Task[None] | None = None
        self._on_end: Callable[[BackgroundJob], None] | None = None

    @property
    def is_done(self) -> bool:
        return self.final is not None

    def start(self, on_end: Callable[[BackgroundJob], None]) -> None:
        assert self._renderer is not None
        self._on_end = on_end
        self._append(self._renderer.opening())
        self._task = asyncio.create_task(self._run(self._run_, self._renderer), name=f"background {self.response_id}")
        del self._run_  # the task owns the run: it closes it whichever way the job ends

    def snapshot(self) -> Json:
        """The response as it stands: the final object once ended, else its status and output so far."""
        if self.final is not None:
            return self.final
        assert self._renderer is not None
        return self._renderer.ctx.response(self._renderer.partial_output(), None, self.status)

    def cancel(self) -> Json:
        """Stop the run (its KV blocks are freed within a step) and end as "cancelled"; an ended job's
        response unchanged (cancelling twice, or after the end, is not an error)."""
        if self._renderer is not None:
            self._stop(self._renderer, "cancelled", None)
            if self._task is not None:
                self._task.cancel()
        assert self.final is not None
        return self.final

    async def follow(self, after: int) -> AsyncIterator[Json]:
        """The events after sequence number `after`, then each new one as it comes, until the job ends."""
        index = max(after + 1, 0)
        while True:
            changed = self._changed
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.is_done:
                return
            await changed.wait()

    async def _run(self, run: GenerationRun, renderer: ResponseEvents) -> None:
        # cancel() ends the job before this task sees its CancelledError: nothing renders after the end
        try:
            async for update in run.updates():
                if self.status == "queued":
                    self.status = "in_progress"
                    self._append([renderer.started()])
                self._append(renderer.render(update))
            closing = renderer.closing()
            if closing:
                self._end(closing[-1]["response"], closing)
            else:  # the run ended without a last output: its requests were aborted under it
                self._stop(renderer, "cancelled", None)
        except asyncio.CancelledError:
            if not self.is_done:  # the server's shutdown cancelled the task
                self._stop(renderer, "cancelled", None)
        except Exception as exc:
            run.state.note_restarts()
            if not self.is_done:
                self._stop(renderer, "failed", {"code": "server_error", "message": api_error_for(exc).message})
        finally:
            run.close()

    def _stop(self, renderer: ResponseEvents, status: str, error: Json | None) -> None:
        """End early, with the output so far; a failure ends the stream with `response.failed`."""
        response = renderer.ctx.stopped(renderer.partial_output(), status, error)
        self._end(response, [renderer.failed(response)] if status == "failed" else [])

    def _end(self, response: Json, events: Iterable[Json]) -> None:
        self.final, self.status = response, response["status"]
        assert self.status in _TERMINAL, self.status
        self._append(events)
        self._renderer, self.input_items = None, []
        if self._on_end is not None:
            self._on_end(self)

    def _append(self, events: Iterable[Json]) -> None:
        for event in events:
            self.events.append(event)
            self.num_bytes += len(json.dumps(event, ensure_ascii=False))
        self._changed.set()
        self._changed = asyncio.Event()


class BackgroundJobs:
    """The server's background jobs: those running, and the event logs of those ended (bounded)."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        self._running: dict[str, BackgroundJob] = {}
        self._ended: BoundedLru[str, BackgroundJob] = BoundedLru(capacity, max_bytes, lambda job: job.num_bytes)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def start(self, job: BackgroundJob) -> None:
        self._running[job.response_id] = job
        job.start(self._ended_job)

    def get(self, response_id: str, owner: str | None) -> BackgroundJob | None:
        job = self._running.get(response_id) or self._ended.get(response_id)
        return job if job is not None and job.owner == owner else None

    def forget(self, response_id: str) -> None:
        self._running.pop(response_id, None)
        self._ended.pop(response_id)

    def shutdown(self) -> None:
        """End every running job as cancelled (the server is stopping: nothing would finish them)."""
        for job in list(self._running.values()):
            job.cancel()

    def _ended_job(self, job: BackgroundJob) -> None:
        if self._running.pop(job.response_id, None) is not None:
            self._ended.put(job.response_id, job)
