"""Step-time calibration (engine/calibration.py): a fit from synthetic steps, nothing of them left
behind, and in the server's engine thread only while it idles."""

from __future__ import annotations

from tests.engine.tiny import greedy, random_prompts, tiny_model
from tokenmill.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServiceClassConfig
from tokenmill.engine.calibration import IdleCalibration, calibrate
from tokenmill.engine.core import EngineCore


def _core() -> EngineCore:
    model = tiny_model("llama")
    classes = ServiceClassConfig(min_step_samples=16)
    config = EngineConfig(ModelConfig("tiny", dtype="float32", device="cpu"),
                          CacheConfig(block_size=4, num_blocks=256),
                          SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, service_classes=classes))
    return EngineCore(config, model.arch, model.state_dict)


def _run(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy(6), ())
    out: dict[str, list[int]] = {}
    while engine.has_unfinished:
        for o in engine.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [out[f"r{i}"] for i in range(len(prompts))]


def test_calibration_fits_the_step_time_model_and_leaves_a_clean_engine() -> None:
    core = _core()
    fit = calibrate(core, 24)
    assert fit is not None and fit.num_samples >= 16
    assert fit.predict(64, 1) > 0 and fit.predict(16, 16) > 0
    assert not core.has_unfinished and not core.scheduler.requests
    assert core.kv.usage == 0.0 and not core.kv.block_tables  # no blocks held: a fresh block manager
    plain = _core()
    assert plain.scheduler.step_time.fit() is None
    prompts = random_prompts([5, 9], seed=3)
    assert _run(core, prompts) == _run(plain, prompts)  # it serves as before


def test_real_work_stops_idle_calibration_at_once_and_the_samples_stay() -> None:
    core = _core()
    calibration = IdleCalibration(core, 24)
    for _ in range(5):
        calibration.step()
    assert calibration.active and calibration.steps == 5 and core.scheduler.requests
    prompts = random_prompts([7], seed=4)
    core.add_request("real", prompts[0], greedy(6), ())
    assert calibration.has_other_work()
    calibration.stop()
    assert not calibration.active and list(core.scheduler.requests) == ["real"]  # synthetic ones aborted
    assert core.scheduler.step_time.num_samples == 5  # type: ignore[attr-defined]
    out: list[int] = []
    while core.has_unfinished:
        for o in core.step().outputs:
            out.extend(o.new_token_ids)
    assert out == _run(_core(), prompts)[0]



def test_a_real_request_is_never_run_by_a_synthetic_step() -> None:
    """After a wave finishes, its ids are stale: a real request added then must still count as other
    work, and step() must not run it (its tokens would be lost)."""
    core = _core()
    calibration = IdleCalibration(core, 24)
    calibration.step()
    while core.scheduler.requests:  # let the first wave finish outside the calibration
        core.step()
    core.add_request("real", random_prompts([5], seed=6)[0], greedy(4), ())
    assert calibration.has_other_work()
    calibration.step()
    assert core.scheduler.requests["real"].num_computed_tokens == 0  # untouched
