"""Step-time calibration at engine start (engine/calibration.py): a fit before the first request,
and nothing of the synthetic requests left behind."""

from __future__ import annotations

from tests.engine.tiny import greedy, random_prompts, tiny_model
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServiceClassConfig
from tokenmill.engine.core import EngineCore


def _core(calibration_steps: int) -> EngineCore:
    model = tiny_model("llama")
    classes = ServiceClassConfig(calibration_steps=calibration_steps, min_step_samples=16)
    config = EngineConfig(ModelConfig("tiny", dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, num_blocks=256),
                          SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, service_classes=classes))
    return EngineCore(config, model.arch, model.state_dict)


def test_calibration_fits_the_step_time_model_and_leaves_a_clean_engine() -> None:
    core = _core(24)
    fit = core.scheduler.step_time.fit()
    assert fit is not None and fit.num_samples >= 16
    assert fit.predict(64, 1) > 0 and fit.predict(16, 16) > 0
    assert not core.has_unfinished and not core.scheduler.requests
    assert core.kv.usage == 0.0 and not core.kv.block_tables  # no blocks held: a fresh block manager
    # And it serves as usual afterwards: the same greedy tokens as an engine that never calibrated.
    prompts = random_prompts([5, 9], seed=3)
    plain = _core(0)
    assert plain.scheduler.step_time.fit() is None

    def run(engine: EngineCore) -> list[list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy(6), ())
        out: dict[str, list[int]] = {}
        while engine.has_unfinished:
            for o in engine.step().outputs:
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return [out[f"r{i}"] for i in range(len(prompts))]

    assert run(core) == run(plain)
