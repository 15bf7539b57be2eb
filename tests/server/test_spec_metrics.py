"""Speculative-decoding counters in ServerMetrics, from synthetic step stats."""

from __future__ import annotations

from tests.server.test_server_metrics import MODEL, _samples, _stats, _value
from tokenmill.server.metrics import ServerMetrics


def test_spec_counters_add_each_steps_drafts_and_per_position_acceptance() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_stats(spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=5,
                           spec_accepted_per_position=[2, 2, 1], spec_is_on=True), [])
    metrics.on_step(_stats(spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=1,
                           spec_accepted_per_position=[1], spec_is_on=False), [])
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:spec_decode_num_drafts_total") == 3
    assert _value(samples, "tokenmill:spec_decode_num_draft_tokens_total") == 12
    assert _value(samples, "tokenmill:spec_decode_num_accepted_tokens_total") == 6
    assert _value(samples, "tokenmill:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 3
    assert _value(samples, "tokenmill:spec_decode_num_accepted_tokens_per_pos_total", position="2") == 1
    assert _value(samples, "tokenmill:spec_decode_enabled") == 0


def test_without_speculation_the_series_stay_at_zero() -> None:
    metrics = ServerMetrics(MODEL)
    metrics.on_step(_stats(), [])
    samples = _samples(metrics)
    assert _value(samples, "tokenmill:spec_decode_num_drafts_total") == 0
    assert _value(samples, "tokenmill:spec_decode_enabled") == 0
