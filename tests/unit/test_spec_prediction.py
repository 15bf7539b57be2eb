"""Predicted outputs: the prediction's cursor follows the output through copies and edits, and the
speculator proposes from it (bucket PREDICTION_BUCKET) ahead of the method's own guess."""

from __future__ import annotations

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request, RequestStatus, SamplingParams
from tokenmill.engine.spec.ngram import NgramProposer
from tokenmill.engine.spec.prediction import PredictionCursor, Predictions
from tokenmill.engine.spec.speculator import PREDICTION_BUCKET, Speculator

PREDICTION = list(range(100, 160))


def _after(output: list[int]) -> PredictionCursor:
    cursor = PredictionCursor(PREDICTION)
    cursor.advance(output)
    return cursor


def test_a_copy_follows_the_prediction_and_edits_realign_it() -> None:
    assert _after([]).guess(3) == [100, 101, 102]
    assert _after([100, 101]).guess(2) == [102, 103]
    assert _after([100, 101, 7, 8]).guess(2) == []  # mid-edit: nothing of the prediction to follow
    assert _after([100, 101, 7, 8, 104, 105]).guess(2) == [106, 107]  # replaced 102-103, copy resumed
    assert _after([100, 101, 106, 107]).guess(2) == [108, 109]  # 102-105 deleted
    assert _after([100, 101, 9, 102]).guess(2) == [103, 104]  # 9 inserted: one token re-aligns nearby
    assert _after(PREDICTION).guess(3) == []  # used up


def test_realigning_looks_near_the_last_position_first() -> None:
    """Deep into a long prediction, a one-token re-alignment after an insertion searches from where the
    copy was, not from the start; a repeated 2-gram resolves to its first occurrence after it."""
    prediction = [5, 6, 7, 8] * 10 + list(range(200, 240))
    cursor = PredictionCursor(prediction)
    cursor.advance([*prediction[:50], 999, 210])
    assert cursor.guess(2) == [211, 212]
    cursor = PredictionCursor(prediction)
    cursor.advance([*prediction[:21], 999, 6, 7])  # 6 re-aligns at the first 6 after position 21, not at 1
    assert cursor.pos == 23 and cursor.guess(1) == [8]


def test_predictions_forget_and_retain() -> None:
    predictions = Predictions()
    assert predictions.guess("a", PREDICTION, [100], 2) == [101, 102]
    assert predictions.guess("a", PREDICTION, [100, 101], 2) == [102, 103]  # incremental
    predictions.guess("b", PREDICTION, [], 1)
    predictions.retain({"b"})
    assert set(predictions._cursors) == {"b"}
    predictions.forget("b")
    assert not predictions._cursors


def _decoding(rid: str, prompt: list[int], output: list[int], prediction: list[int] | None) -> Request:
    request = Request(rid, prompt, SamplingParams(max_tokens=100, temperature=0.0, prediction=prediction))
    request.token_ids += output
    request.num_computed_tokens, request.status = request.num_tokens - 1, RequestStatus.RUNNING
    return request


def test_the_speculator_proposes_the_prediction_ahead_of_its_lookup() -> None:
    speculator = Speculator(SpeculativeConfig("ngram", 4, adaptive=False), NgramProposer(1, 4), 1000)
    predicted = _decoding("p", [1, 2, 3, 1, 2], [100, 101], PREDICTION)  # its lookup would say 3
    plain = _decoding("q", [1, 2, 3, 1, 2], [], None)
    speculator.propose([predicted, plain])
    assert predicted.spec_token_ids == [102, 103, 104, 105] and predicted.spec_from_prediction
    assert plain.spec_token_ids[:1] == [3] and not plain.spec_from_prediction
    assert speculator._bucket_prior(PREDICTION_BUCKET) == 0.9
    lost = _decoding("r", [1, 2, 3, 1, 2], [7, 7], PREDICTION)  # not aligned: the lookup's guess again
    speculator.propose([lost])
    assert not lost.spec_from_prediction


def test_a_repeated_ngram_realigns_at_its_first_occurrence_after_the_last_position() -> None:
    """The output copied the prediction to position 10, wrote something else, then two tokens the
    prediction has twice (at its start and after position 40): the copy resumes at the later one."""
    prediction = [1, 2, 3, *range(10, 50), 1, 2, 3, 50, 51]
    cursor = PredictionCursor(prediction)
    cursor.advance([*prediction[:10], 99, 1, 2])
    assert cursor.guess(3) == [3, 50, 51]
    early = PredictionCursor(prediction)
    early.advance([99, 1, 2])  # nothing copied yet: the first occurrence is at or after position 0
    assert early.guess(2) == [3, 10]
