"""Native datasets: a job's items in a file instead of its body, named by `POST /v1/jobs`
with `input_file_id` (a file uploaded with `POST /v1/files`, `purpose: dataset`, an
extension) or `input_url` (read by the API itself: `s3://` in the configured blob store,
or `file://` under the folder the operator allows, FANOUT_INPUT_ROOT). JSONL in the
`fanout submit` format (one {"prompt" | "input_ids" | "messages", "sampling_params"?,
"custom_id"?} per line, every line the same kind; a bare JSON string is a prompt) or of
OpenAI batch lines ({custom_id, method, url, body}: each the item its body asks, with the
sampling parameters the batch would give it), or Parquet with the native columns
(api/batchfile.py; pyarrow), told apart by its first bytes.

The job is read as a stream: each line or row checked as the one item of a native body
would be (its own `sampling_params` over the job's, the configured limits), and laid out
by shard into the store as they come (items.Builder). So the body limit and
FANOUT_MAX_BATCH do not apply, and the API process holds a few shards' items (a Parquet
file is spooled to a temporary file first: its footer, which says where the rows are, is
at its end). Errors name the line or row: 422, `loc` ["body", "input_file_id" or
"input_url", LINE, ...the field in the line's item].
"""
from __future__ import annotations

import itertools
import json
import os
import random
import tempfile
from typing import Annotated, Iterable, Iterator
from urllib.parse import unquote, urlparse

from fastapi.exceptions import RequestValidationError
from pydantic import Field, TypeAdapter, ValidationError

from jobs import items
from jobs.settings import Settings
from jobs.spec import CustomId, NonEmptyStr
from worker.engine.sampling_params import TokenId
from results import blobs, keys

from . import jobs
from .batchfile import FIELDS, BatchFileError, item_field, parquet_rows
from .openai import batchinput
from .schemas import UNION_TAGS, JobRequest
from .tenants import Tenant
from .unique import Seen

MAX_ERRORS = 20
PARQUET = b"PAR1"  # the first (and last) bytes of a Parquet file
OPENAI_LINE = {"method", "url", "body"}  # the fields that tell an OpenAI batch line
LINE_FIELDS = set(FIELDS) | {"sampling_params", "custom_id"}


def open_url(url: str, settings: Settings, store: blobs.Store, tenant: Tenant | None) -> Iterator[bytes]:
    """The chunks of the dataset at `input_url`: a file:// under FANOUT_INPUT_ROOT, or an
    s3:// object in the configured blob store (its bucket, under its prefix), never one of
    the service's own objects (keys.SERVICE_BLOBS: uploaded files, jobs' items and results).
    With API keys a tenant reads only its own prefix: datasets/<its id>/ in the store,
    FANOUT_INPUT_ROOT/<its id>/ on disk. 422 naming input_url when it is none of these or is
    not there; StoreError (503) when the store fails."""
    def bad(msg: str) -> RequestValidationError:
        return RequestValidationError([{"loc": ("body", "input_url"), "type": "value_error", "msg": msg}])

    parsed = urlparse(url)
    if parsed.scheme == "file":
        if not settings.input_root:
            raise bad("file:// datasets are off: the operator allows a folder with FANOUT_INPUT_ROOT")
        root = os.path.realpath(settings.input_root)
        if tenant is not None:
            root = os.path.join(root, tenant.id)
        path = os.path.realpath(unquote(parsed.path))
        if parsed.netloc not in ("", "localhost") or os.path.commonpath([root, path]) != root:
            raise bad(f"not under {'your folder of ' if tenant else ''}FANOUT_INPUT_ROOT ({root})")
        try:
            f = open(path, "rb")
        except OSError as e:
            raise bad(f"cannot read it: {e.strerror}") from None
        return _chunks(f)
    if parsed.scheme == "s3":
        inside = urlparse(store.url)
        prefix = inside.path.strip("/")
        key = parsed.path.lstrip("/")
        if inside.scheme != "s3" or parsed.netloc != inside.netloc or (prefix and not key.startswith(prefix + "/")):
            raise bad(f"not in the configured blob store ({store.url}, FANOUT_STORAGE_URL)")
        key = key[len(prefix) + 1:] if prefix else key
        if key.startswith(keys.SERVICE_BLOBS):
            raise bad(f"the service's own objects ({', '.join(keys.SERVICE_BLOBS)}) are not readable by URL: "
                      "give an uploaded file's id as input_file_id")
        if tenant is not None and not key.startswith(keys.dataset_blobs(tenant.id)):
            raise bad(f"this key reads datasets under {store.url}/{keys.dataset_blobs(tenant.id)} only")
        try:
            return store.get(key)
        except blobs.Missing:
            raise bad("no such object in the blob store") from None
        except ValueError as e:  # a key that climbs out of the prefix
            raise bad(str(e)) from None
    raise bad("give s3://bucket/key (in the configured blob store) or file:///path (under FANOUT_INPUT_ROOT)")


def _chunks(f) -> Iterator[bytes]:
    with f:
        while chunk := f.read(blobs.CHUNK):
            yield chunk


def rows(chunks: Iterable[bytes]) -> tuple[str, Iterator[tuple[int, bytes | dict | BatchFileError]]]:
    """(the dataset's format, "jsonl" or "parquet"; its rows as plan() takes them: number,
    the JSONL line, or the Parquet row as an object, or its error). Parquet when it starts
    as one ("PAR1"; spooled to a temporary file, which Parquet's footer needs, then read
    ROWS rows at a time), else JSONL."""
    chunks = iter(chunks)
    first = next(chunks, b"")
    whole = itertools.chain([first], chunks)
    if not first.startswith(PARQUET):
        return "jsonl", enumerate(blobs.lines(whole), 1)
    return "parquet", _parquet(whole)


def _parquet(chunks: Iterable[bytes]) -> Iterator[tuple[int, dict | BatchFileError]]:
    with tempfile.TemporaryFile(prefix="fanout-dataset-") as f:
        for chunk in chunks:
            f.write(chunk)
        f.seek(0)
        yield from parquet_rows(f, "the dataset")


def _loc(field: str, n: int, loc) -> list:
    return ["body", field, n, *(p for p in loc if p not in UNION_TAGS)]


def job_seed(req: JobRequest) -> int:
    """The seed of a dataset job: its own, else its shared sampling parameters', else a new
    one. Each line's samples draw from (seed, index, sample), unless the line has its own."""
    if req.seed is not None:
        return req.seed
    if req.sampling_params.seed is not None:
        return req.sampling_params.seed
    return random.getrandbits(63)


# A line whose item is a prompt or token ids, and whose own sampling_params an earlier line
# had (checked with its whole one-item body then: the parameters' checks do not depend on the
# item), has its item and custom id checked alone, against the same types: 2-3x as many
# lines a second. Any error there sends it down the whole check, which names the field.
FAST = {"prompt": TypeAdapter(NonEmptyStr),
        "input_ids": TypeAdapter(Annotated[list[TokenId], Field(min_length=1)])}
CUSTOM_ID = TypeAdapter(CustomId | None)
FAST_PARAMS = 256  # distinct sampling_params remembered (a seed per line would be a million)


def _params_key(own) -> str | None:
    try:
        return json.dumps(own, sort_keys=True)
    except (TypeError, ValueError):
        return None


def _fast(fast: dict, field: str, obj: dict, own, custom_id):
    """(the checked SamplingParams, its dump) of a line that may skip the whole check, else None."""
    if field not in FAST or not isinstance(own, dict):
        return None
    known = fast.get(_params_key(own))
    if known is None:
        return None
    try:
        FAST[field].validate_python(obj[field], strict=True)
        CUSTOM_ID.validate_python(custom_id, strict=True)
    except ValidationError:
        return None
    return known


def plan(records: Iterable[tuple[int, bytes | dict | BatchFileError]], req: JobRequest, settings: Settings,
         builder: items.Builder, seed: int, checkpoint=None, resume: dict | None = None) -> jobs.Planned:
    """The job of `req` (which names its dataset) from the dataset's rows (rows()), laid out
    by `builder`; RequestValidationError naming the lines or rows at fault (MAX_ERRORS at most).
    `checkpoint(state)` gets, every few seconds while no row is at fault, where a reader
    could resume (the row to read next and what the rows before it came to); `resume`, such
    a state: the rows before it are skipped, their shards already written."""
    shared = req.sampling_params.model_dump(mode="json", exclude_defaults=True)
    shared.pop("seed", None)  # the job seed (job_seed), not each line's own
    errors, kind, seen = [], None, Seen()
    fast: dict = {}  # a line's own sampling_params (as _params_key) -> (the checked SamplingParams, its dump)
    tokens, row = 0, 0  # row: the row in hand, the first of the shard it starts when a checkpoint comes
    if resume is not None:
        builder.restore(resume)
        tokens, kind = resume["tokens"], resume["kind"]
        for custom_id in builder.custom_ids():
            seen.add(custom_id)
    if checkpoint is not None:
        builder.on_shards = lambda state: checkpoint({**state, "row": row, "tokens": tokens, "kind": kind})

    def error(n: int, msg: str, loc=(), kind_="value_error") -> None:
        errors.append({"loc": _loc(req.input, n, loc), "msg": msg, "type": kind_})

    for n, raw in records:
        if resume is not None and n < resume["row"]:
            continue  # laid out before
        row = n
        if len(errors) >= MAX_ERRORS:
            break
        if isinstance(raw, BatchFileError):
            error(n, str(raw))
            continue
        if isinstance(raw, dict):  # a Parquet row
            obj = raw
        elif not raw.strip():
            continue
        else:
            try:
                obj = json.loads(raw)
            except (ValueError, RecursionError) as e:
                error(n, f"not JSON: {e}", kind_="json_invalid")
                continue
        if isinstance(obj, dict) and OPENAI_LINE <= set(obj):  # an OpenAI batch line: its item
            try:
                obj = batchinput.native_line(obj, settings)
            except batchinput.NotALine as e:
                error(n, e.error.message, tuple(e.error.param.split(".")) if e.error.param else ())
                continue
        try:
            obj, field = item_field(obj, kind)
        except BatchFileError as e:
            error(n, str(e))
            continue
        if unknown := sorted(set(obj) - LINE_FIELDS):
            error(n, "extra field not permitted", (unknown[0],), "extra_forbidden")
            continue
        own = obj.get("sampling_params") or {}
        custom_id = obj.get("custom_id")
        known = _fast(fast, field, obj, own, custom_id)
        if known is not None:  # its parameters were checked with an earlier line, its item is checked now
            p, dump = known
            if custom_id is not None and not seen.add(custom_id):
                error(n, f"custom_id {custom_id!r} is used by an earlier line", ("custom_id",))
                continue
            kind = FIELDS[field]
            if not errors:
                builder.add(json.dumps({"x": obj[field], "p": dump}, separators=(",", ":")), p.n, custom_id)
                tokens += p.n * p.max_new_tokens
            continue
        try:
            if not isinstance(own, dict):
                raise ValueError("sampling_params: must be an object")
            # A list of one: the line's own seed stays its own, as an item's does in a body.
            one = JobRequest.model_validate({FIELDS[field]: [obj[field]], "sampling_params": [{**shared, **own}],
                                             "custom_ids": [custom_id]})
            spec = one.spec(seed=0)
            jobs.check_limits(one, spec, settings)  # the native route's
        except ValidationError as e:
            for x in e.errors()[:3]:
                loc = [p for p in x["loc"] if p not in UNION_TAGS]
                # The one-item body's locations: items.0 -> the line's field, sampling_params.0 -> sampling_params.
                loc = [field if p == FIELDS[field] else p for p in loc]
                if len(loc) > 1 and loc[1] == 0 and loc[0] in (field, "sampling_params", "custom_ids"):
                    loc = [loc[0] if loc[0] != "custom_ids" else "custom_id"] + loc[2:]
                error(n, x["msg"], loc, x["type"])
            continue
        except RequestValidationError as e:
            for x in e.errors()[:3]:
                error(n, x["msg"], [p for p in x["loc"][1:] if not isinstance(p, int)], x["type"])
            continue
        except ValueError as e:
            error(n, str(e), ("sampling_params",))
            continue
        if custom_id is not None and not seen.add(custom_id):
            error(n, f"custom_id {custom_id!r} is used by an earlier line", ("custom_id",))
            continue
        kind = FIELDS[field]
        if errors:
            continue  # checked on, nothing more written
        p = spec.sampling_params[0]
        if field in FAST and len(fast) < FAST_PARAMS:  # lines with these parameters take the fast path now
            fast[_params_key(own)] = (p, p.model_dump(mode="json", exclude_defaults=True))
        item = spec.model_dump(mode="json", include={kind})[kind][0] if kind == "messages" else spec.items[0]
        builder.add(json.dumps({"x": item, "p": p.model_dump(mode="json", exclude_defaults=True)},
                               separators=(",", ":")), p.n, custom_id)
        tokens += p.n * p.max_new_tokens
    seen.close()
    if not errors and not len(builder.ns):
        errors.append({"loc": ["body", req.input], "msg": "the dataset has no items", "type": "too_short"})
    if errors:
        raise RequestValidationError(errors)
    # The custom ids are in the items' entries (builder.add), not in the job's Redis keys.
    return jobs.Planned(kind, builder.ns, tokens, seed, None, builder.finish(), model=req.model)
