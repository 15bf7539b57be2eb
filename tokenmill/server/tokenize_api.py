"""POST /tokenize, POST /detokenize, GET /tokenizer_info: the model's tokenizer over HTTP, as vLLM
serves it, so that tools like lm-evaluation-harness can count and split tokens exactly."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from tokenmill.server.openai_inputs import chat_prompt, encode_text
from tokenmill.server.pipeline import api_key_id, get_state, serving
from tokenmill.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeTextRequest
from tokenmill.server.response_bodies import DetokenizeResponse, TokenizeResponse

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeTextRequest | TokenizeChatRequest, request: Request) -> TokenizeResponse:
    state, engine = serving(request, body.model)
    if isinstance(body, TokenizeTextRequest):
        token_ids = encode_text(engine.tokenizer, body.prompt, "prompt", add_special_tokens=body.add_special_tokens)
    else:
        # the prompt a chat request with these messages runs: calls sent back unchanged as the model wrote them
        messages = state.written_calls.restore(body.messages, api_key_id(request))
        token_ids = chat_prompt(engine.tokenizer, messages, body.add_generation_prompt, body.tools,
                                continue_final=body.continue_final_message,
                                template_kwargs=body.chat_template_kwargs).token_ids
    strs = [engine.tokenizer.id_to_token(t) or "" for t in token_ids] if body.return_token_strs else None
    return TokenizeResponse(count=len(token_ids), max_model_len=engine.max_model_len, tokens=token_ids,
                            token_strs=strs)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    _, engine = serving(request, body.model)
    engine.limits.check_token_ids(body.tokens, "tokens")
    return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens, skip_special_tokens=False))


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """The fields of a Hugging Face tokenizer_config.json that a remote client needs."""
    engine = get_state(request).require_engine()
    tok = engine.tokenizer
    pad = tok.id_to_token(tok.pad_token_id) if tok.pad_token_id is not None else None
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": engine.max_model_len,
        "vocab_size": tok.vocab_size,
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "pad_token": pad,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "add_bos_token": tok.add_bos_token,
        "chat_template": tok.chat_template,
    }
