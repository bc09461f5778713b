"""POST /tokenize and /detokenize and GET /tokenizer_info, in vLLM's shapes, with a served
model's own tokenizer (`model` may be left out while the fleet serves one model).

The API never reads a model's files: each worker publishes its tokenizer's files to Redis
when it starts (keys.tokenizer, with their digest), and an API process loads them once per
digest. Ids are the engine's: a prompt is tokenized as a job's prompt is (special tokens
added unless `add_special_tokens: false`), a chat as a job's chat is (its template with the
generation prompt, then tokenized without adding special tokens again). Errors are
OpenAI-shaped, as vLLM answers them.
"""
from __future__ import annotations

import os
import tempfile
import threading
from typing import Annotated

import anyio
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, model_validator

from jobs import models as fleet
from jobs.spec import Strict
from results import keys
from worker.engine.sampling_params import TokenId

from .openai.errors import OpenAIError
from .openai.schemas import ChatMessage

router = APIRouter()

_loaded: dict[str, tuple[str, object, threading.Lock]] = {}  # model -> (digest, tokenizer, its lock)
_loading = threading.Lock()  # one load at a time (transformers' lazy imports race across threads too)


MODEL = Field(None, min_length=1, description="the served model (default: the one the fleet serves, "
                                              "when it serves one)")


class TokenizeRequest(Strict):
    model: str | None = MODEL
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = Field(None, description="prompts: true by default; chats: false "
                                                              "(the template holds them)")
    add_generation_prompt: bool = Field(True, description="chats: end with the assistant's turn, as a job's chat does")
    return_token_strs: bool = Field(False, description="also each token's string (the tokenizer's own pieces)")

    @model_validator(mode="after")
    def _one(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int | None
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(Strict):
    model: str | None = MODEL
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


def model_named(redis, model: str | None):
    """The known model `model` names, or when it is None the one model the fleet knows (a 400
    naming `model` when it knows several, a 404 when none): a jobs.models.Model."""
    try:
        return fleet.resolve(redis, model, None)
    except fleet.ModelError as e:
        code = "missing_required_parameter" if e.code == "model_required" else e.code
        raise OpenAIError(e.status, e.message, param="model", code=code) from None


def tokenizer(redis, model: str):
    """The model's tokenizer and its lock (a tokenizer is not used by two threads at once)."""
    digest = redis.hget(keys.tokenizer(model), "digest")
    if digest is None:
        raise OpenAIError(503, f"the workers of {model!r} have not published their tokenizer yet",
                          type="server_error", code="tokenizer_unavailable")
    digest = digest.decode()
    got = _loaded.get(model)
    if got is None or got[0] != digest:
        with _loading:
            got = _loaded.get(model)
            if got is None or got[0] != digest:
                got = _loaded[model] = (digest, _load(redis, model), threading.Lock())
    return got[1], got[2]


def _load(redis, model: str):
    from transformers import AutoTokenizer

    files = redis.hgetall(keys.tokenizer(model))
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            name = name.decode()
            if name != "digest" and os.path.basename(name) == name:
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
        return AutoTokenizer.from_pretrained(tmp)


def _tokenize(redis, req: TokenizeRequest) -> dict:
    model = model_named(redis, req.model)
    tok, lock = tokenizer(redis, model.base)  # a LoRA adapter's: its base's
    with lock:
        if req.prompt is not None:
            ids = tok(req.prompt, add_special_tokens=req.add_special_tokens is not False)["input_ids"]
        else:
            for i, m in enumerate(req.messages):
                if m.image_parts():
                    raise OpenAIError(400, "tokenize takes text chats: an image's tokens depend on its pixels",
                                      param=f"messages[{i}].content", code="unsupported_parameter")
            chat = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=req.add_generation_prompt)
            except Exception as e:
                raise OpenAIError(400, f"chat template failed: {e}", param="messages") from None
            ids = tok(text, add_special_tokens=bool(req.add_special_tokens))["input_ids"]
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": model.entry.get("max_model_len"), "tokens": ids,
            "token_strs": strs}


def _detokenize(redis, req: DetokenizeRequest) -> dict:
    tok, lock = tokenizer(redis, model_named(redis, req.model).base)
    size = len(tok)
    for i, t in enumerate(req.tokens):
        if t >= size:
            raise OpenAIError(400, f"token {t} is outside the vocabulary ({size} tokens)", param=f"tokens[{i}]",
                              code="invalid_value")
    with lock:
        return {"prompt": tok.decode(req.tokens)}


def _info(redis, model: str | None) -> dict:
    """What a client needs to tokenize as the engine does (lm-eval's remote tokenizer reads
    it): the tokenizer's class, special tokens and chat template."""
    model = model_named(redis, model)
    tok, lock = tokenizer(redis, model.base)  # a LoRA adapter's: its base's
    with lock:
        return {"tokenizer_class": type(tok).__name__, "model": model.name,
                **{f"{name}_token": getattr(tok, f"{name}_token") for name in ("bos", "eos", "pad", "unk")},
                "chat_template": getattr(tok, "chat_template", None), "vocab_size": len(tok),
                "model_max_length": model.entry.get("max_model_len"),
                "add_bos_token": getattr(tok, "add_bos_token", None)}


@router.post("/tokenize", response_model=TokenizeResponse)
async def tokenize(req: TokenizeRequest, request: Request):
    """Token ids of a prompt or a text chat, as the model's engine makes them."""
    return await anyio.to_thread.run_sync(_tokenize, request.app.state.redis, req)


@router.post("/detokenize", response_model=DetokenizeResponse)
async def detokenize(req: DetokenizeRequest, request: Request):
    """The text of token ids."""
    return await anyio.to_thread.run_sync(_detokenize, request.app.state.redis, req)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request, model: str | None = None):
    """The tokenizer's class, special tokens (bos, eos, pad, unk), chat template and sizes."""
    return await anyio.to_thread.run_sync(_info, request.app.state.redis, model)
