"""Native datasets: a job's items in a file instead of its body. The file is JSONL in the
`fanout submit` format (one {"prompt" | "input_ids" | "messages", "sampling_params"?,
"custom_id"?} per line, every line the same kind; a bare JSON string is a prompt),
uploaded with `POST /v1/files` and `purpose: dataset` (extension), and named by `POST
/v1/jobs` with `input_file_id` instead of items.

The job is read from the blob store as a stream: each line checked as the one item of a
native body would be (its own `sampling_params` over the job's, the configured limits),
and laid out by shard into the store as the lines come (items.Builder). So the body limit
and FANOUT_MAX_BATCH do not apply, and the API process holds a few shards' items and, per
line, its custom id and n. Errors name the line: 422, `loc` ["body", "input_file_id",
LINE, ...the field in the line's item].
"""
from __future__ import annotations

import json
import random
from typing import Iterable

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from worker import items
from worker.settings import Settings

from . import jobs
from .batchfile import FIELDS, BatchFileError, item_field
from .schemas import UNION_TAGS, JobRequest
from .unique import Seen

MAX_ERRORS = 20
LINE_FIELDS = set(FIELDS) | {"sampling_params", "custom_id"}


def _loc(n: int, loc) -> list:
    return ["body", "input_file_id", n, *(p for p in loc if p not in UNION_TAGS)]


def plan(lines: Iterable[bytes], req: JobRequest, settings: Settings, builder: items.Builder) -> jobs.Planned:
    """The job of `req` (which names its input file) from the file's lines, laid out by
    `builder`; RequestValidationError naming the lines at fault (MAX_ERRORS at most)."""
    shared = req.sampling_params.model_dump(mode="json", exclude_defaults=True)
    shared_seed = shared.pop("seed", None)  # the job seed: each line's samples draw from (seed, index, sample)
    seed = req.seed if req.seed is not None else shared_seed
    errors, kind, seen = [], None, Seen()
    tokens = 0

    def error(n: int, msg: str, loc=(), kind_="value_error") -> None:
        errors.append({"loc": _loc(n, loc), "msg": msg, "type": kind_})

    for n, raw in enumerate(lines, 1):
        if len(errors) >= MAX_ERRORS:
            break
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except (ValueError, RecursionError) as e:
            error(n, f"not JSON: {e}", kind_="json_invalid")
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
        item = spec.model_dump(mode="json", include={kind})[kind][0] if kind == "messages" else spec.items[0]
        builder.add(json.dumps({"x": item, "p": p.model_dump(mode="json", exclude_defaults=True)},
                               separators=(",", ":")), p.n, custom_id)
        tokens += p.n * p.max_new_tokens
    seen.close()
    if not errors and not len(builder.ns):
        errors.append({"loc": ["body", "input_file_id"], "msg": "the file has no items", "type": "too_short"})
    if errors:
        raise RequestValidationError(errors)
    # The custom ids are in the items' entries (builder.add), not in the job's Redis keys.
    return jobs.Planned(kind, builder.ns, tokens, seed if seed is not None else random.getrandbits(63),
                        None, builder.finish())
