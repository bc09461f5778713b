"""OpenAI's response bodies built from our sample records (results.store.sample_record: the
stored samples and the stream's final entries have that shape): `chat.completion` and
`text_completion` objects, their streamed chunks, usage and logprobs. The online routes
and the batch output files both use them."""
from __future__ import annotations

import hashlib

from .schemas import ChatCompletion, Completion


def usage(items: list[list[dict]]) -> dict:
    """Each item's prompt counts once, whatever its number of samples (as OpenAI counts n)."""
    first = [samples[0]["usage"] for samples in items if samples]
    prompt = sum(u["prompt_tokens"] for u in first)
    completion = sum(r["usage"]["completion_tokens"] for samples in items for r in samples)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(u["cached_tokens"] for u in first)}}


def finish_reason(ours: str) -> str:
    # "abort" (a canceled request) has no OpenAI name; it ends the text like a stop.
    # "tool_calls" is OpenAI's own (chat_message gives it).
    return ours if ours in ("length", "tool_calls") else "stop"


def _top(entry: dict) -> dict:
    return {"token": entry["token"], "logprob": entry["logprob"], "bytes": list(entry["token"].encode())}


def chat_logprobs(records: list[dict] | None) -> dict | None:
    """Our per-token records -> `logprobs.content` (None when not asked)."""
    if records is None:
        return None
    return {"content": [{**_top(r), "top_logprobs": [_top(t) for t in r["top_logprobs"]]} for r in records],
            "refusal": None}


def legacy_logprobs(records: list[dict] | None, offset: int = 0) -> dict | None:
    """Our per-token records -> the completions API's parallel lists; `text_offset` counts
    characters of the choice's text from `offset` (what came before, when streamed). A
    prompt's first record (echo) has logprob and top_logprobs null, as OpenAI's."""
    if records is None:
        return None
    offsets = []
    for r in records:
        offsets.append(offset)
        offset += len(r["token"])
    return {"tokens": [r["token"] for r in records], "token_logprobs": [r["logprob"] for r in records],
            "top_logprobs": [None if r["top_logprobs"] is None else {t["token"]: t["logprob"] for t in r["top_logprobs"]}
                             for r in records],
            "text_offset": offsets}


def _echoed(prompt: str, r: dict) -> tuple[str, dict | None]:
    """The choice's text and logprobs with its prompt first (echo): the prompt's records
    (when logprobs were asked), then the output's, whose offsets start past the prompt."""
    if r["logprobs"] is None:
        return prompt + r["text"], None
    head, tail = legacy_logprobs(r["prompt_logprobs"]), legacy_logprobs(r["logprobs"], len(prompt))
    return prompt + r["text"], {k: head[k] + tail[k] for k in head}


def tool_calls(id: str, choice: int, r: dict) -> list[dict] | None:
    """The sample's parsed calls (worker/engine/tools.py) as OpenAI's, None without any. Ids
    come from (completion id, choice, call): the same after a retry, or in a batch's file."""
    calls = r.get("tool_calls")
    if not calls:
        return None
    return [{"id": "call_" + hashlib.blake2b(f"{id}:{choice}:{k}".encode(), digest_size=12).hexdigest(),
             "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for k, c in enumerate(calls)]


def chat_message(id: str, choice: int, r: dict) -> tuple[dict, str]:
    """(the choice's message, its finish_reason): with tool calls, the text outside them
    (null if none) and `tool_calls`."""
    calls = tool_calls(id, choice, r)
    if calls is None:
        return ({"role": "assistant", "content": r["text"], "refusal": None},
                finish_reason(r["finish_reason"]))
    return ({"role": "assistant", "content": r.get("content"), "refusal": None, "tool_calls": calls},
            "tool_calls")


def chat_completion(id: str, created: int, model: str, items: list[list[dict]]) -> dict:
    choices = []
    for i, r in enumerate(r for samples in items for r in samples):
        message, finish = chat_message(id, i, r)
        choices.append({"index": i, "message": message, "logprobs": chat_logprobs(r["logprobs"]),
                        "finish_reason": finish, "prompt_logprobs": r.get("prompt_logprobs")})
    return ChatCompletion(id=id, created=created, model=model, choices=choices, usage=usage(items)).model_dump()


def text_completion(id: str, created: int, model: str, items: list[list[dict]],
                    echo: list[str] | None = None) -> dict:
    """`echo`: each item's prompt text, to put first (the request's `echo`)."""
    choices = []
    for index, samples in enumerate(items):
        for r in samples:
            text, lps = _echoed(echo[index], r) if echo else (r["text"], legacy_logprobs(r["logprobs"]))
            choices.append({"index": len(choices), "text": text, "logprobs": lps,
                            "finish_reason": finish_reason(r["finish_reason"]),
                            # echoed, they are in logprobs already
                            "prompt_logprobs": None if echo else r.get("prompt_logprobs")})
    return Completion(id=id, created=created, model=model, choices=choices, usage=usage(items)).model_dump()


def chat_chunk(id: str, created: int, model: str, index: int, delta: dict, logprobs: list[dict] | None = None,
               finish: str | None = None) -> dict:
    return {"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None,
            "choices": [{"index": index, "delta": delta, "logprobs": chat_logprobs(logprobs),
                         "finish_reason": finish and finish_reason(finish)}]}


def text_chunk(id: str, created: int, model: str, index: int, text: str, logprobs: list[dict] | None = None,
               offset: int = 0, finish: str | None = None) -> dict:
    return {"id": id, "object": "text_completion", "created": created, "model": model, "system_fingerprint": None,
            "choices": [{"index": index, "text": text, "logprobs": legacy_logprobs(logprobs, offset),
                         "finish_reason": finish and finish_reason(finish)}]}
