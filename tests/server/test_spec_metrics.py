"""Speculative-decoding counters in ServerMetrics, from synthetic step stats."""

from __future__ import annotations

from tests.server.test_server_metrics import MODEL, _samples, _stats, _value
from tokenmill.server.metrics import ServerMetrics


def test_spec_counters_add_each_steps_drafts_and_per_position_acceptance() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_stats(spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=5,
                           spec_accepted_per_position=[2, 2, 1], spec_is_on=True, spec_num_gated_tokens=3,
                           spec_num_forced_tokens=5, spec_num_prediction_accepted=4, spec_num_prediction_rejected=1),
                    [])
    metrics.on_step(_stats(spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=1,
                           spec_accepted_per_position=[1], spec_is_on=False, spec_cached_tokens=4096), [])
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:spec_decode_num_drafts_total") == 3
    assert _value(samples, "tokenmill:spec_decode_num_draft_tokens_total") == 12
    assert _value(samples, "tokenmill:spec_decode_num_accepted_tokens_total") == 6
    assert _value(samples, "tokenmill:spec_decode_num_gated_tokens_total") == 3
    assert _value(samples, "tokenmill:spec_decode_num_forced_tokens_total") == 5
    assert _value(samples, "tokenmill:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 3
    assert _value(samples, "tokenmill:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1
    assert _value(samples, "tokenmill:spec_decode_enabled") == 0
    assert _value(samples, "tokenmill:spec_decode_suffix_cache_tokens") == 4096
    assert _value(samples, "tokenmill:spec_decode_num_prediction_tokens_total", outcome="accepted") == 4
    assert _value(samples, "tokenmill:spec_decode_num_prediction_tokens_total", outcome="rejected") == 1


def test_without_speculation_the_series_stay_at_zero() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_stats(), [])
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:spec_decode_num_drafts_total") == 0
    assert _value(samples, "tokenmill:spec_decode_enabled") == 0


def test_the_request_log_line_carries_the_mean_accepted_length() -> None:
    from tokenmill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from tokenmill.engine.request import FinishReason, RequestTimes, SpecRequestStats
    from tokenmill.server.request_log import request_fields

    spec = SpecRequestStats(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6)
    times = RequestTimes(arrival=1.0, first_scheduled=1.1, first_token=1.5, finished=2.0)
    completion = CompletionOutput(0, "x", [1, 2], None, FinishReason.STOP)

    def fields(stats: SpecRequestStats | None) -> dict[str, object]:
        output = RequestOutput("r", "p", [1], [completion], True, RequestMetrics.from_times(times, 0, stats))
        return request_fields(output, request_id="r", model=MODEL, mode="meta")

    assert fields(spec)["spec_mean_accepted_length"] == 2.5  # 1 + 6 / 4
    assert "spec_mean_accepted_length" not in fields(None)
    assert "accepted_prediction_tokens" not in fields(spec)  # no prediction
    spec.num_prediction_accepted, spec.num_prediction_rejected = 5, 1
    assert (fields(spec)["accepted_prediction_tokens"], fields(spec)["rejected_prediction_tokens"]) == (5, 1)
