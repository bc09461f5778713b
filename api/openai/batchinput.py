"""The batch input file: JSONL, one request per line, as OpenAI's
`{"custom_id", "method": "POST", "url", "body"}`. Validated line by line at upload (every
line must be a request we would run: custom_id unique, body valid for its url, within the
limits), and again at batch creation, as a stream, into one native job: one item per line,
its own sampling parameters, its custom_id, laid out by shard into the blob store as the
lines come (no process holds the file or the job whole)."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Literal

from pydantic import ValidationError

from jobs import items
from worker.embedder.params import EmbedParams
from worker.engine.sampling_params import SamplingParams
from jobs.settings import Settings
from jobs.spec import CustomId

from .. import jobs
from ..unique import Seen
from .errors import OpenAIError, param
from . import embeddings, responses
from .schemas import ChatCompletionRequest, CompletionRequest, Endpoint, Strict, image_error, sampling_params

REQUESTS = {"/v1/chat/completions": ChatCompletionRequest, "/v1/completions": CompletionRequest,
            "/v1/responses": responses.ResponseRequest, "/v1/embeddings": embeddings.EmbeddingRequest}
TASKS = {"/v1/embeddings": "embed"}  # an endpoint's task (jobs.spec.TASKS): the others generate
MAX_ERRORS = 20  # reported per file


class Line(Strict):
    custom_id: CustomId
    method: Literal["POST"]
    url: Endpoint
    body: dict[str, Any]


@dataclass(slots=True)
class Request:
    line: int  # 1-based, as in errors.data[].line
    custom_id: str
    url: str
    body: Any  # ChatCompletionRequest | CompletionRequest | ResponseRequest | EmbeddingRequest
    params: SamplingParams | EmbedParams


@dataclass(slots=True)
class LineError:
    line: int | None
    message: str
    param: str | None = None
    code: str = "invalid_request"

    def data(self) -> dict:
        return {"code": self.code, "line": self.line, "message": self.message, "param": self.param}


TOO_DEEP = "not a JSON object this server reads: nested too deeply"


class Invalid(Exception):
    def __init__(self, errors: list[LineError]):
        super().__init__("; ".join(f"line {e.line}: {e.message}" if e.line else e.message for e in errors))
        self.errors = errors


def check(lines: Iterable[bytes], settings: Settings) -> int:
    """read() holding nothing but the custom ids (api/unique.py; an upload of any size);
    returns the count."""
    return sum(1 for _ in read(lines, settings))


def read(lines: Iterable[bytes], settings: Settings) -> Iterator[Request]:
    """Every line (without its newline), validated, as it comes; raises Invalid with the
    first MAX_ERRORS errors at the end (after yielding the lines before the first)."""
    with Seen() as seen:
        yield from _read(lines, settings, seen)


def _read(lines: Iterable[bytes], settings: Settings, seen: Seen) -> Iterator[Request]:
    errors, count = [], 0
    for n, raw in enumerate(lines, 1):
        if len(errors) >= MAX_ERRORS:
            break
        if not raw.strip():
            continue
        try:
            line = Line.model_validate(json.loads(raw))
        except ValidationError as e:
            errors.append(_error(n, e, ""))
            continue
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            errors.append(LineError(n, f"not a JSON object: {e}", code="invalid_json"))
            continue
        except RecursionError:  # json.loads of a line nested thousands deep
            errors.append(LineError(n, TOO_DEEP, code="invalid_json"))
            continue
        try:
            body = REQUESTS[line.url].model_validate(line.body)
        except ValidationError as e:
            errors.append(_error(n, e, "body."))
            continue
        except RecursionError:
            errors.append(LineError(n, TOO_DEEP, "body", code="invalid_json"))
            continue
        if not seen.add(line.custom_id):
            errors.append(LineError(n, f"custom_id {line.custom_id!r} is used by an earlier line", "custom_id",
                                    "duplicate_custom_id"))
            continue
        try:
            request = Request(n, line.custom_id, line.url, body, _params(body, settings))
        except OpenAIError as e:
            errors.append(LineError(n, e.message, e.param and f"body.{e.param}"))
            continue
        count += 1
        if not errors:
            yield request
    if count + len(errors) > settings.batch_max_requests:
        errors.append(LineError(None, f"{count + len(errors)} requests, over the limit of "
                                      f"{settings.batch_max_requests} (FANOUT_BATCH_MAX_REQUESTS)", code="too_many_requests"))
    if not count and not errors:
        errors.append(LineError(None, "the file has no requests", code="empty_file"))
    if errors:
        raise Invalid(errors)


def _error(n: int, e: ValidationError, prefix: str) -> LineError:
    err = e.errors()[0]
    name = prefix + (param(err["loc"]) or "") or None
    code = "unsupported_parameter" if err["type"] == "extra_forbidden" else "invalid_request"
    return LineError(n, f"{name}: {err['msg']}" if name else err["msg"], name, code)


class NotALine(ValueError):
    """An OpenAI batch line that is not one this server runs (LineError: what and where)."""

    def __init__(self, error: LineError):
        super().__init__(error.message)
        self.error = error


FIELD = {"messages": "messages", "prompts": "prompt", "input_ids": "input_ids"}  # a kind's field in a line


def native_line(obj: dict, settings: Settings) -> dict:
    """An OpenAI batch line ({custom_id, method, url, body}) as the native dataset line of
    the same item (api/dataset.py): its prompt or chat, its sampling parameters, its
    custom_id. NotALine says what is wrong (the body's `model` is not looked at: a native
    job runs on the workers of its queue)."""
    try:
        line = Line.model_validate(obj)
    except ValidationError as e:
        raise NotALine(_error(None, e, "")) from None
    if line.url in TASKS:
        raise NotALine(LineError(None, f"url {line.url}: not in a native job's dataset (POST /v1/batches runs "
                                       "these files)", "url", "unsupported_endpoint"))
    try:
        body = REQUESTS[line.url].model_validate(line.body)
    except ValidationError as e:
        raise NotALine(_error(None, e, "body.")) from None
    try:
        p = _params(body, settings)
    except OpenAIError as e:
        raise NotALine(LineError(None, e.message, e.param and f"body.{e.param}")) from None
    item, kind = _item(Request(0, line.custom_id, line.url, body, p))
    return {FIELD[kind]: item, "sampling_params": p.model_dump(mode="json", exclude_defaults=True),
            "custom_id": line.custom_id}


def _params(body, settings: Settings) -> SamplingParams | EmbedParams:
    """The line's sampling parameters (an embedding line's EmbedParams); OpenAIError for what
    a line may not ask here."""
    if isinstance(body, embeddings.EmbeddingRequest):
        x = body.input
        if isinstance(x, list) and not isinstance(x[0], int) and len(x) > 1:
            raise OpenAIError(400, f"input: one input per line in a batch (a text or a list of token ids), "
                                   f"not {len(x)}", "input")
        return body.params()
    if body.stream:
        raise OpenAIError(400, "stream: not in a batch (its lines stream on the job's events)", "stream")
    if isinstance(body, responses.ResponseRequest):
        if body.previous_response_id is not None:
            raise OpenAIError(400, "previous_response_id: not in a batch line (give the conversation as input items)",
                              "previous_response_id")
        responses.chat_of(body, [])  # its errors, at upload
        return responses.params_of(body, settings)
    if isinstance(body, CompletionRequest) and body.echo:
        raise OpenAIError(400, "echo: not in a batch line; ask prompt_logprobs for the prompt's logprobs "
                               "(each output body's choices carry them)", "echo")
    if isinstance(body, CompletionRequest) and not (isinstance(body.prompt, str) or isinstance(body.prompt[0], int)):
        raise OpenAIError(400, "prompt: one prompt per line (a text or a list of token ids)", "prompt")
    return sampling_params(body, settings)


def plan(requests: Iterable[Request], endpoint: str, served: dict[str, tuple[str, list[str]]],
         builder: items.Builder) -> tuple["jobs.Planned", str, str | None]:
    """The native job of a batch, one item per line, laid out by `builder` (into the blob
    store) as the lines come: (the job, its model, an embedding batch's encoding_format).
    Raises Invalid when a line does not fit the batch (another url, a model not served or
    served for another task, mixed kinds of prompt, an image its model's workers cannot
    take; in an embedding batch, parameters other than the first line's). `served`: each
    known model -> (its task, the image URL schemes its workers take: [] for a text
    model; None for what no live worker announced). Each line keeps its own sampling parameters; the job seed is new (a line's own
    `seed` still fixes its samples). An embedding batch is one embedding job: its lines
    share dimensions, truncation and encoding (the first line's)."""
    errors, model, kind = [], None, None
    tokens = 0
    task, first = TASKS.get(endpoint, "generate"), None
    for r in requests:
        model = model or r.body.model
        error = _misfit(r, endpoint, served, model)
        if error is not None:
            errors.append(error)
            if len(errors) >= MAX_ERRORS:
                break
            continue
        if task == "embed":
            first = first or r
            if (r.params, r.body.encoding_format) != (first.params, first.body.encoding_format):
                errors.append(LineError(r.line, "every line of an embedding batch asks the same dimensions, "
                                                "truncate_prompt_tokens and encoding_format (as the first line)",
                                        "body", "mismatched_parameters"))
                continue
        if errors:
            continue  # checked on, but nothing more written
        item, its_kind = _item(r)
        if kind not in (None, its_kind):
            raise Invalid([LineError(r.line, "prompts must be all texts or all token ids in one batch",
                                     "body.prompt", "mixed_prompts")])
        kind = its_kind
        p = r.params
        if task == "embed":  # the job's EmbedParams, no sampling parameters
            builder.add(json.dumps({"x": item}, separators=(",", ":")), 1, r.custom_id)
            continue
        builder.add(json.dumps({"x": item, "p": p.model_dump(mode="json", exclude_defaults=True)},
                               separators=(",", ":")), p.n, r.custom_id)
        tokens += p.n * p.max_new_tokens
    if errors:
        raise Invalid(errors)
    # The custom ids are in the items' entries (builder.add), not in the job's Redis keys.
    planned = jobs.Planned(kind, builder.ns, tokens, random.getrandbits(63), None, builder.finish(), task,
                           first.params if first else None, model or "")
    return planned, model, first.body.encoding_format if first else None


def _misfit(r: Request, endpoint: str, served: dict[str, tuple], model: str) -> LineError | None:
    if r.url != endpoint:
        return LineError(r.line, f"url {r.url} is not the batch's endpoint {endpoint}", "url", "mismatched_endpoint")
    if r.body.model not in served:
        return LineError(r.line, f"model {r.body.model!r} is not a model of this fleet (GET /v1/models lists "
                                 "the served ones)", "body.model", "model_not_found")
    task, schemes = served[r.body.model]
    if task != TASKS.get(endpoint, "generate"):
        return LineError(r.line, f"model {r.body.model!r} is {'an embedding' if task == 'embed' else 'a text'} "
                                 f"model: not for {endpoint}", "body.model", "model_not_supported")
    if endpoint == "/v1/chat/completions" and schemes is not None and \
            (bad := image_error(r.body.messages, r.body.model, schemes)):
        return LineError(r.line, f"body.{bad[1]}", f"body.{bad[0]}", "unsupported_parameter")
    if r.body.model != model:
        return LineError(r.line, f"every line must name the same model (the first names {model!r})",
                         "body.model", "mismatched_model")
    return None


def _item(r: Request) -> tuple[Any, str]:
    """(the line's item as a job entry holds it, its kind)."""
    if r.url == "/v1/chat/completions":
        return [m.job_message().model_dump(mode="json") for m in r.body.messages], "messages"
    if r.url == "/v1/responses":
        return responses.chat_of(r.body, []), "messages"
    if r.url == "/v1/embeddings":
        x = r.body.input
        x = x[0] if isinstance(x, list) and not isinstance(x[0], int) else x  # a list of one input
        return x, "prompts" if isinstance(x, str) else "input_ids"
    return r.body.prompt, "prompts" if isinstance(r.body.prompt, str) else "input_ids"
