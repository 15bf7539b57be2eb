"""Token-level stop rules (stop strings are text-level and live in the output processor)."""

from __future__ import annotations

from tokenmill.engine.request import FinishReason, Request


def check_stop(request: Request, max_model_len: int) -> FinishReason | None:
    """Decide after a token was appended. EOS and stop ids are ignored until min_tokens."""
    params = request.params
    num_output = request.num_output_tokens
    last = request.token_ids[-1]
    if num_output >= params.min_tokens:
        if not params.ignore_eos and last in request.eos_token_ids:
            return FinishReason.STOP
        if last in params.stop_token_ids:
            return FinishReason.STOP
    if length_reached(request, max_model_len):
        return FinishReason.LENGTH
    return None


def length_reached(request: Request, max_model_len: int) -> bool:
    """max_tokens or the context is used up: the request ends whatever its last token is."""
    max_tokens = request.params.max_tokens
    return (max_tokens is not None and request.num_output_tokens >= max_tokens) or request.num_tokens >= max_model_len
