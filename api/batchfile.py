"""Batch files, the input of `fanout submit`, `fanout generate` and cron entries, and the
results files `fanout submit --out` and `fanout results --out` write.

JSONL: one item per line: {"prompt": "..."} | {"input_ids": [...]} | {"messages": [...]},
with an optional per-item "sampling_params" object and "custom_id" (returned with the
item's results); a bare JSON string is a prompt. Every line of a file uses the same input
field.

Parquet (a file named *.parquet; pyarrow): the same as columns, one item per row: one of
`prompt` (string), `input_ids` (list of integers), `messages` (a list of {role, content}
structs, or the chat as JSON text); maybe `custom_id` (string) and `sampling_params` (a
struct, or JSON text). Results in Parquet are one row per item, in input order (RESULTS).
"""
from __future__ import annotations

import io
import itertools
import json
from typing import Any, Iterable, Iterator
from urllib.parse import urlparse

FIELDS = {"prompt": "prompts", "input_ids": "input_ids", "messages": "messages"}
ROWS = 1024  # Parquet rows read, or items written, per batch


class BatchFileError(ValueError):
    pass


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise BatchFileError("Parquet files need pyarrow: pip install pyarrow (the parquet extra, "
                             "pip install -e '.[parquet]' in Fanout's checkout)") from None
    return pyarrow


def is_parquet(path: str) -> bool:
    return path.lower().endswith(".parquet")


def _jsonl_rows(path: str) -> Iterator[tuple[str, Any]]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise BatchFileError(f"{path}:{n}: not JSON: {e}") from None


def _no_nulls(v):
    """A Parquet struct has every field of its type, null where a row has none: drop those,
    as a JSON object would not have them."""
    if isinstance(v, dict):
        return {k: _no_nulls(x) for k, x in v.items() if x is not None}
    if isinstance(v, list):
        return [_no_nulls(x) for x in v]
    return v


def parquet_rows(source, name: str) -> Iterator[tuple[int, dict | BatchFileError]]:
    """(row number, the row as a JSONL line's object, or the BatchFileError of that row) of
    the Parquet file `source` (a path or a seekable binary file) named `name`, a batch of
    ROWS rows in memory at a time."""
    pa = _pyarrow()
    try:
        f = pa.parquet.ParquetFile(source)
    except pa.ArrowException as e:
        raise BatchFileError(f"{name}: not a Parquet file: {e}") from None
    n = 0
    for batch in f.iter_batches(batch_size=ROWS):
        for row in batch.to_pylist():
            n += 1
            obj = {}
            try:
                for k, v in row.items():
                    if v is None:
                        continue
                    if k in ("messages", "sampling_params") and isinstance(v, str):  # JSON text
                        try:
                            v = json.loads(v)
                        except json.JSONDecodeError as e:
                            raise BatchFileError(f"{k}: not JSON: {e}") from None
                    obj[k] = _no_nulls(v)
            except BatchFileError as e:
                yield n, e
                continue
            yield n, obj


def _parquet_rows(path: str) -> Iterator[tuple[str, Any]]:
    for n, obj in parquet_rows(path, path):
        if isinstance(obj, BatchFileError):
            raise BatchFileError(f"{path}: row {n}: {obj}")
        yield f"{path}: row {n}", obj


def item_field(obj: Any, kind: str | None) -> tuple[dict, str]:
    """(the item as an object, its input field: prompt, input_ids or messages): exactly one,
    of the kind of the items before it (`kind`; None for the first). A bare JSON string is a
    prompt. BatchFileError says what is wrong, without where."""
    if isinstance(obj, str):
        obj = {"prompt": obj}
    given = [k for k in FIELDS if k in obj] if isinstance(obj, dict) else []
    if len(given) != 1:
        raise BatchFileError("give exactly one of prompt, input_ids, messages")
    if kind not in (None, FIELDS[given[0]]):
        raise BatchFileError("every item must use the same field as the first")
    return obj, given[0]


def read(path: str) -> tuple[str, list, list[dict | None], list[str | None]]:
    """(kind: prompts / input_ids / messages, items, per-item sampling params or None,
    per-item custom ids or None)."""
    kind, items, params, custom = None, [], [], []
    for where, obj in (_parquet_rows if is_parquet(path) else _jsonl_rows)(path):
        try:
            obj, field = item_field(obj, kind)
        except BatchFileError as e:
            raise BatchFileError(f"{where}: {e}") from None
        kind = FIELDS[field]
        items.append(obj[field])
        params.append(obj.get("sampling_params"))
        custom.append(obj.get("custom_id"))
    if not items:
        raise BatchFileError(f"{path}: no items")
    return kind, items, params, custom


def job_body(path: str, sampling_params: dict[str, Any] | None = None, **fields) -> dict[str, Any]:
    """A POST /v1/jobs body: the file's items; per-item sampling params override the shared ones."""
    kind, items, per_line, custom = read(path)
    base = sampling_params or {}
    sp: Any = [{**base, **(p or {})} for p in per_line] if any(per_line) else base
    ids = {"custom_ids": custom} if any(c is not None for c in custom) else {}
    return {kind: items, "sampling_params": sp, **ids, **fields}


# A results row: the item's index and custom id, and its samples as /results has them; the
# fields that a sample has only when asked (logprobs, prompt_logprobs, tool_calls, content)
# are JSON text. An embedding job's samples add `embedding`, float32, a fixed-size list when
# the job's vectors are known to share a length (always, but in a file whose first ROWS
# items all failed).
JSON_TEXT = ("logprobs", "prompt_logprobs", "tool_calls", "content")


def _results_schema(pa, embedding: int | bool = False):
    usage = pa.struct([("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()),
                       ("cached_tokens", pa.int64())])
    vector = [("embedding", pa.list_(pa.float32(), embedding) if embedding is not True
               else pa.list_(pa.float32()))] if embedding else []
    sample = pa.struct([("sample", pa.int64()), ("text", pa.string()), ("token_ids", pa.list_(pa.int64())),
                        ("finish_reason", pa.string()), ("error", pa.string()), ("usage", usage),
                        *((k, pa.string()) for k in JSON_TEXT), *vector])
    return pa.schema([("index", pa.int64()), ("custom_id", pa.string()), ("samples", pa.list_(sample))])


def _dimensions(items: Iterator[dict]) -> tuple[int | bool, list[dict]]:
    """(the vectors' length, or True when none of the first ROWS items has one; those items)."""
    head = []
    for item in items:
        head.append(item)
        found = next((len(s["embedding"]) for s in item["samples"] if s.get("embedding") is not None), None)
        if found is not None:
            return found, head
        if len(head) == ROWS:
            break
    return True, head


def _row(item: dict) -> dict:
    samples = []
    for s in item["samples"]:
        row = {k: s.get(k) for k in ("sample", "text", "token_ids", "finish_reason", "error", "embedding")}
        row["usage"] = {k: (s.get("usage") or {}).get(k) for k in ("prompt_tokens", "completion_tokens",
                                                                  "cached_tokens")}
        row.update({k: json.dumps(s[k], ensure_ascii=False) if s.get(k) is not None else None for k in JSON_TEXT})
        samples.append(row)
    return {"index": item["index"], "custom_id": item.get("custom_id"), "samples": samples}


def write_results(items: Iterable[dict], out, embedding: bool = False) -> None:
    """Results items (as /results pages them) to `out`: a path or file:// URL, an s3://
    URL (results.blobs, with the standard AWS_* variables; the object appears once whole,
    nothing at all if the writing fails), or a text stream (JSONL). A name ending in
    .parquet is written as Parquet, any other as JSONL. Written a batch at a time.
    `embedding`: an embedding job's (its Parquet has the vectors' column)."""
    if isinstance(out, str) and out.startswith("file://"):
        out = urlparse(out).path
    if isinstance(out, str) and out.startswith("s3://"):
        from results import blobs

        url = urlparse(out)
        folder, _, name = url.path.strip("/").rpartition("/")
        if not name:
            raise BatchFileError(f"{out}: name an object (s3://bucket/path/results.jsonl)")
        with blobs.S3Store(url.netloc, folder).writer(name) as w:
            _write(items, _Sink(w), is_parquet(name), embedding)
        return
    if isinstance(out, str):
        if is_parquet(out):
            _write(items, out, True, embedding)
        else:
            with open(out, "w") as f:
                _write(items, f, False)
        return
    _write(items, out, False)


def _write(items: Iterable[dict], f, parquet: bool, embedding: bool = False) -> None:
    """To `f`, a path or file (Parquet), or a text or binary stream (JSONL)."""
    if parquet:
        pa = _pyarrow()
        if embedding:
            rest = iter(items)
            dim, head = _dimensions(rest)
            items = itertools.chain(head, rest)
        schema = _results_schema(pa, dim if embedding else False)
        with pa.parquet.ParquetWriter(f, schema) as w:
            rows = []
            for item in items:
                rows.append(_row(item))
                if len(rows) == ROWS:
                    w.write_table(pa.Table.from_pylist(rows, schema=schema))
                    rows.clear()
            if rows:
                w.write_table(pa.Table.from_pylist(rows, schema=schema))
        return
    binary = isinstance(f, (io.RawIOBase, io.BufferedIOBase))
    for item in items:
        line = json.dumps(item, ensure_ascii=False) + "\n"
        f.write(line.encode() if binary else line)


class _Sink(io.RawIOBase):
    """A blob writer (results.blobs.Writer) as the binary file pyarrow and _write write to;
    the writer's own context commits or aborts it."""

    def __init__(self, writer):
        self.w = writer

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.w.write(bytes(b))
        return len(b)

    def tell(self) -> int:  # Parquet's footer records offsets; the stream cannot seek
        return self.w.size
