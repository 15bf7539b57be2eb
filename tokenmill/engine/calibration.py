"""Fit the step-time model before serving: synthetic requests through real steps at start-up.

Without it the SLO-aware scheduler (engine/scheduler.py) knows nothing about the machine until
`min_step_samples` real steps have run, and in that window an interactive request that lands on a
replica busy with batch work gets the conservative fallback (`unfitted_step_tokens`), not its
target. Calibration runs a fixed mix of prompts and decodes, shaped to spread the fit's three
features apart (prefill steps: many tokens in few sequences; decode steps of 1, 4 and 16
sequences: tokens == sequences at several sizes), then resets the engine: requests, blocks and
prefix cache are gone, the fit stays (EngineCore.reset keeps it). Token ids are drawn from a fixed
seed over the vocabulary; their values do not matter to the step time.
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


def calibrate(core: EngineCore, max_steps: int, seed: int = 0) -> StepTimeFit | None:
    """Run up to `max_steps` synthetic steps, reset the engine, return the step-time fit."""
    rng = random.Random(seed)
    vocab = core.limits.vocab_size
    steps = 0
    for wave, (prompt_len, count, output_len) in enumerate(_WAVES):
        prompt_len = max(1, min(prompt_len, core.max_model_len - output_len - 1))
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        for i in range(count):
            prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
            core.add_request(f"calibrate-{wave}-{i}", prompt, params, (), service_class=ServiceClass.BATCH)
        while core.has_unfinished and steps < max_steps:
            core.step()
            steps += 1
        if steps >= max_steps:
            break
    core.reset()
    fit = core.scheduler.step_time.fit()
    if fit is None:
        log.info("step-time calibration: %d steps, not enough for a fit yet", steps)
    else:
        log.info("step-time calibration: %d steps, T = %.1f ms + %.2f ms/token + %.2f ms/seq", steps,
                 fit.base_s * 1e3, fit.per_token_s * 1e3, fit.per_seq_s * 1e3)
    return fit
