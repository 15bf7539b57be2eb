"""Fit the step-time model while a fresh server idles: synthetic requests through real steps.

Without it the SLO-aware scheduler (engine/scheduler.py) knows nothing about the machine until
`min_step_samples` real steps have run, and in that window an interactive request that lands on a
replica busy with batch work gets the conservative fallback (`unfitted_step_tokens`), not its
target. Calibration runs a fixed mix of prompts and decodes, shaped to spread the fit's three
features apart (prefill steps: many tokens in few sequences; decode steps of 1, 4 and 16
sequences: tokens == sequences at several sizes). Token ids are drawn from a fixed seed over the
vocabulary; their values do not matter to the step time.

It runs in the engine thread's idle time after the server is ready (AsyncEngine), one step at a
time, so it never delays /ready (24 steps of a 1.5B model take ~20 s on 2 cores) and never makes a
real request wait for more than the one synthetic step in flight: the moment real work arrives,
the synthetic requests are aborted (their blocks freed) and the samples gathered so far stay in
the fit. `calibrate` runs the same to completion and resets the engine (offline use, tests).
"""

from __future__ import annotations

import logging
import random
from typing import TYPE_CHECKING

from tokenmill.engine.request import SamplingParams
from tokenmill.engine.service_class import ServiceClass
from tokenmill.engine.step_time import StepTimeFit

if TYPE_CHECKING:
    from tokenmill.engine.core import EngineCore

log = logging.getLogger(__name__)

# (prompt tokens, requests, output tokens) per wave; each wave runs to completion.
_WAVES = ((96, 1, 4), (24, 4, 6), (12, 16, 6), (48, 2, 4))
PREFIX = "calibrate-"


class IdleCalibration:
    """Synthetic steps, one per call, until `max_steps` ran or stop() (real work arrived)."""

    def __init__(self, core: EngineCore, max_steps: int, seed: int = 0) -> None:
        self.core = core
        self.max_steps = max_steps
        self.steps = 0
        self.active = max_steps > 0
        self._rng = random.Random(seed)
        self._in_flight: set[str] = set()
        self._wave = 0

    def has_other_work(self) -> bool:
        """Requests in the engine that are not this calibration's (a synthetic step must never
        run one: its tokens would go to nobody)."""
        return any(request_id not in self._in_flight for request_id in self.core.scheduler.requests)

    def step(self) -> None:
        if not self.active or self.has_other_work():
            return
        self._in_flight &= set(self.core.scheduler.requests)  # the finished ones are gone
        if not self._in_flight and not self._add_wave():
            self.stop()
            return
        self.core.step()  # its outputs belong to nobody
        self.steps += 1
        if self.steps >= self.max_steps:
            self.stop()

    def stop(self) -> None:
        """Abort the synthetic requests still in flight (freeing their blocks) and stop for good."""
        for request_id in sorted(self._in_flight):
            self.core.abort(request_id)
        self._in_flight.clear()
        if self.active:
            self.active = False
            _log_fit(self.core.scheduler.step_time.fit(), self.steps)

    def _add_wave(self) -> bool:
        if self._wave >= len(_WAVES):
            return False
        prompt_len, count, output_len = _WAVES[self._wave]
        prompt_len = max(1, min(prompt_len, self.core.max_model_len - output_len - 1))
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        vocab = self.core.limits.vocab_size
        for i in range(count):
            request_id = f"{PREFIX}{self._wave}-{i}"
            prompt = [self._rng.randrange(vocab) for _ in range(prompt_len)]
            self.core.add_request(request_id, prompt, params, (), service_class=ServiceClass.BATCH)
            self._in_flight.add(request_id)
        self._wave += 1
        return True


def calibrate(core: EngineCore, max_steps: int, seed: int = 0) -> StepTimeFit | None:
    """Run up to `max_steps` synthetic steps now, reset the engine, return the step-time fit."""
    calibration = IdleCalibration(core, max_steps, seed)
    while calibration.active:
        calibration.step()
    core.reset()
    return core.scheduler.step_time.fit()


def _log_fit(fit: StepTimeFit | None, steps: int) -> None:
    if fit is None:
        log.info("step-time calibration: %d steps, not enough for a fit yet (live steps will add to it)", steps)
    else:
        log.info("step-time calibration: %d steps, T = %.1f ms + %.2f ms/token + %.2f ms/seq", steps,
                 fit.base_s * 1e3, fit.per_token_s * 1e3, fit.per_seq_s * 1e3)
