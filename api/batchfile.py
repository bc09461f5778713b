"""JSONL batch files, the input of `fanout submit`, `fanout generate` and cron entries.

One item per line: {"prompt": "..."} | {"input_ids": [...]} | {"messages": [...]}, with an
optional per-item "sampling_params" object and "custom_id" (returned with the item's
results); a bare JSON string is a prompt. Every line of a file uses the same input field.
"""
from __future__ import annotations

import json
from typing import Any

FIELDS = {"prompt": "prompts", "input_ids": "input_ids", "messages": "messages"}


class BatchFileError(ValueError):
    pass


def read(path: str) -> tuple[str, list, list[dict | None], list[str | None]]:
    """(kind: prompts / input_ids / messages, items, per-line sampling params or None,
    per-line custom ids or None)."""
    kind, items, params, custom = None, [], [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise BatchFileError(f"{path}:{n}: not JSON: {e}") from None
            if isinstance(obj, str):
                obj = {"prompt": obj}
            given = [k for k in FIELDS if k in obj] if isinstance(obj, dict) else []
            if len(given) != 1:
                raise BatchFileError(f"{path}:{n}: give exactly one of prompt, input_ids, messages")
            if kind not in (None, FIELDS[given[0]]):
                raise BatchFileError(f"{path}:{n}: every line must use the same field as the first")
            kind = FIELDS[given[0]]
            items.append(obj[given[0]])
            params.append(obj.get("sampling_params"))
            custom.append(obj.get("custom_id"))
    if not items:
        raise BatchFileError(f"{path}: no items")
    return kind, items, params, custom


def job_body(path: str, sampling_params: dict[str, Any] | None = None, **fields) -> dict[str, Any]:
    """A POST /v1/jobs body: the file's items; per-line sampling params override the shared ones."""
    kind, items, per_line, custom = read(path)
    base = sampling_params or {}
    sp: Any = [{**base, **(p or {})} for p in per_line] if any(per_line) else base
    ids = {"custom_ids": custom} if any(c is not None for c in custom) else {}
    return {kind: items, "sampling_params": sp, **ids, **fields}
