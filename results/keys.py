"""Redis key names, all derived from the job id so any API process can serve any job."""
from __future__ import annotations

PREFIX = "fanout"


def stream(job_id: str) -> str:
    """The job's event stream (XADD by the worker, XREAD by clients)."""
    return f"{PREFIX}:job:{job_id}:events"


def results(job_id: str) -> str:
    """Hash of finished samples: field "index:sample" -> JSON sample."""
    return f"{PREFIX}:job:{job_id}:results"


def info(job_id: str) -> str:
    """Hash of the job's shape and progress counters (totals, done, usage, error)."""
    return f"{PREFIX}:job:{job_id}"


def cancel(job_id: str) -> str:
    """Present when a cancel was requested; the worker checks it every engine step."""
    return f"{PREFIX}:job:{job_id}:cancel"


def custom_ids(job_id: str) -> str:
    """List of the items' custom ids, in index order ("" for an item without one); absent
    when the job has none."""
    return f"{PREFIX}:job:{job_id}:custom_ids"


def items(job_id: str) -> str:
    """List of the job's items, one element per shard (the JSON array of its items'
    entries, jobs.spec.JobSpec.layout): shard k reads element k; deleted when the job ends."""
    return f"{PREFIX}:job:{job_id}:items"


def shards(job_id: str) -> str:
    """Hash of the job's shard counters (jobs/shards.py): total, released, ended, and per
    shard its claims (`claims:<k>`) and attempts that stored nothing (`strikes:<k>`)."""
    return f"{PREFIX}:job:{job_id}:shards"


def taking() -> str:
    """Hash of the shards taken off a queue and not claimed yet: shard id -> "<time> <queue
    key>". A worker that dies between the two leaves its entry; the reapers put it back."""
    return f"{PREFIX}:taking"


def running(job_id: str) -> str:
    """Hash of the job's running shards: shard number -> JSON {worker, execution, stored}."""
    return f"{PREFIX}:job:{job_id}:running"


def jobs(tenant: str | None) -> str:
    """Sorted set of the tenant's job ids (every job in open mode), scored by submit time:
    GET /v1/jobs lists it newest first."""
    return f"{PREFIX}:jobs" if tenant is None else f"{PREFIX}:tenant:{tenant}:jobs"


def by_status(listed: str, status: str) -> str:
    """Sorted set of the jobs of listing `listed` (a keys.jobs key) whose status is `status`,
    scored as the listing (results/listing.py; its Lua builds the same name)."""
    return f"{listed}:{status}"


def healthz() -> str:
    """The key /healthz writes (a full Redis answers reads but refuses writes); expires at once."""
    return f"{PREFIX}:healthz"


def tokenizer(model: str) -> str:
    """Hash of a served model's tokenizer files (file name -> bytes, plus `digest`), written by
    each of its workers when it starts: the API's /tokenize and /detokenize load it."""
    return f"{PREFIX}:model:{model}:tokenizer"


def models() -> str:
    """Hash of the served models: name -> JSON {created, expires}; each worker refreshes its
    model's entry with its heartbeat, so a model is served while `expires` is ahead."""
    return f"{PREFIX}:models"


def file(file_id: str) -> str:
    """An OpenAI file's object (JSON); its bytes are in the blob store (api.openai.files)."""
    return f"{PREFIX}:file:{file_id}"


def storage() -> str:
    """The blob store's URL, set by the first API process or worker: all of a Redis's must use
    the same store (one that did not would write what the others cannot read)."""
    return f"{PREFIX}:storage"


def blobs_due() -> str:
    """Sorted set of what the blob store may hold past its owner, scored by when the sweep
    (api/sweep.py) may delete it: `file:<id>` (a file's bytes, due when its object expires;
    a deleted file's at once) and `job:<id>:<start>:<end>` (shards [start, end) of a job's
    items and results, due when it expires)."""
    return f"{PREFIX}:blobs:due"


def due_file(file_id: str) -> str:
    return f"file:{file_id}"


def due_job(job_id: str, start: int, end: int) -> str:
    """Shards [start, end) of a job's items."""
    return f"job:{job_id}:{start}:{end}"


# In the blob store, the service's own objects: uploaded files (file_blob) and jobs' items
# and results (items_blob, results_blob). No URL a client gives reaches them (api/dataset.py).
SERVICE_BLOBS = ("files/", "jobs/")


def file_blob(file_id: str) -> str:
    """In the blob store: an uploaded file's bytes (api/openai/files.py)."""
    return f"files/{file_id}.jsonl"


def dataset_blobs(tenant_id: str) -> str:
    """In the blob store: the prefix of the datasets a tenant may name by `input_url`
    (s3://BUCKET/PREFIX/datasets/<tenant id>/...), written there by the operator or the
    tenant's own tools, never by the service."""
    return f"datasets/{tenant_id}/"


def items_blob(job_id: str, k: int) -> str:
    """In the blob store: shard k's items (JSON array of entries), for a job that keeps its
    items there (jobs/items.py)."""
    return f"jobs/{job_id}/items/{k}.json"


def results_blob(job_id: str, k: int) -> str:
    """In the blob store: shard k's results once it is done, for a job that keeps its items
    there (JSONL, one line per item as GET /results gives it: results/store.py)."""
    return f"jobs/{job_id}/results/{k}.jsonl"


def kept(job_id: str) -> str:
    """Bitmap: bit k set once shard k's results are in the blob store (keys.results_blob)
    and out of the results hash."""
    return f"{PREFIX}:job:{job_id}:kept"


def validating() -> str:
    """Set of the dataset jobs being validated (api/validation.py): the sweep starts again
    any whose lease (keys.validation) has expired."""
    return f"{PREFIX}:validating"


def validation(job_id: str) -> str:
    """The lease of the API process validating a dataset job (api/validation.py)."""
    return f"{PREFIX}:job:{job_id}:validation"


def checkpoint(job_id: str) -> str:
    """JSON: how far a dataset job's validation got, its shards written up to there
    (api/validation.py); the process that takes over after one died resumes from it."""
    return f"{PREFIX}:job:{job_id}:checkpoint"


def files(tenant: str | None) -> str:
    """Sorted set of the tenant's file ids (every file in open mode), scored by creation time."""
    return f"{PREFIX}:files" if tenant is None else f"{PREFIX}:tenant:{tenant}:files"


def batch(batch_id: str) -> str:
    """An OpenAI batch's object (JSON); its job is the native job of the same hex id."""
    return f"{PREFIX}:batch:{batch_id}"


def batches(tenant: str | None) -> str:
    """Sorted set of the tenant's batch ids (every batch in open mode), scored by creation time."""
    return f"{PREFIX}:batches" if tenant is None else f"{PREFIX}:tenant:{tenant}:batches"


def response(response_id: str) -> str:
    """A stored Responses API response and its conversation (JSON; api.openai.responses)."""
    return f"{PREFIX}:response:{response_id}"


def message_batch(job_id: str) -> str:
    """An Anthropic message batch's record (JSON; api.anthropic.batches): its job is job_id."""
    return f"{PREFIX}:msgbatch:{job_id}"


def message_batches(tenant: str | None) -> str:
    """Sorted set of the tenant's message batch ids (every one in open mode), by creation time."""
    return f"{PREFIX}:msgbatches" if tenant is None else f"{PREFIX}:tenant:{tenant}:msgbatches"


def batches_open() -> str:
    """Set of the batches not ended yet: every API process moves them along (api.openai.batches)."""
    return f"{PREFIX}:batches:open"


def api_wake(process: str) -> str:
    """An API process's wake stream: its stream reader blocks on it too (api/streams.py)."""
    return f"{PREFIX}:api:{process}:wake"


def batch_lock(batch_id: str) -> str:
    """The lease of the API process that writes a batch's output files (api.openai.batches.Lease)."""
    return f"{PREFIX}:batch:{batch_id}:lock"


def closed(job_id: str) -> str:
    """Guard so exactly one terminal status entry is written to the stream."""
    return f"{PREFIX}:job:{job_id}:closed"


def idempotency(key: str, tenant: str | None = None) -> str:
    """A client's Idempotency-Key: per tenant (API key), global in open mode."""
    if tenant is None:
        return f"{PREFIX}:idempotency:{key}"
    return f"{PREFIX}:tenant:{tenant}:idempotency:{key}"


def api_key(digest: str) -> str:
    """An API key's tenant record (JSON), by the sha256 of the key: the key itself is never stored."""
    return f"{PREFIX}:apikey:{digest}"


def api_keys() -> str:
    """Hash of every API key ever created: tenant id -> sha256 of its key. Auth is on while it exists."""
    return f"{PREFIX}:apikeys"


def inflight(tenant: str) -> str:
    """The tenant's jobs queued, scheduled or running: +1 at submit, -1 when the job is closed."""
    return f"{PREFIX}:tenant:{tenant}:inflight"


def rate(tenant: str) -> str:
    """The tenant's request rate limiter: when its next request is due (api.auth)."""
    return f"{PREFIX}:tenant:{tenant}:rate"


def job_of_stream(stream_key: str) -> str:
    """The job id of a job's stream key (stream's inverse)."""
    return stream_key.removeprefix(f"{PREFIX}:job:").removesuffix(":events")


FOLLOWED_TTL = 30  # seconds a stream's followed flag lasts unless renewed
FOLLOWED_RENEW = 10.0  # seconds between a follower's renewals of it


def followed(stream_key: str) -> str:
    """Set while someone follows the stream `stream_key` (an API process: api/streams.py;
    results.reader.follow), with a TTL of FOLLOWED_TTL renewed every FOLLOWED_RENEW seconds:
    the job's workers send its deltas only then (worker/publish.py). The job's close deletes
    it, and it is set only while the job is open (reader.mark_followed)."""
    return f"{stream_key}:followed"


def wake(queue: str) -> str:
    """Pub/sub channel of an rq queue's workers (queue: its name, jobs.spec.queue_name):
    published when they should look at Redis now rather than at their next send (at most
    `--delta-interval` later): a job's first shards queued (jobs.shards.create), a cancel
    (api/jobs.py). A worker whose full engine carries its writes (worker/publish.py) then
    sends at once, so a new job joins it, and a cancel acts, within a step."""
    return f"{PREFIX}:wake:{queue}"


def webhooks() -> str:
    """The webhook outbox: sorted set of deliveries (`job:<id>`, `batch:<id>`) by when each is
    due; an API process sending one pushes it a lease ahead (api/webhooks.py)."""
    return f"{PREFIX}:webhooks"


def webhook_attempts() -> str:
    """Hash: a pending delivery -> the attempts made so far."""
    return f"{PREFIX}:webhooks:attempts"


def webhook(tenant: str | None) -> str:
    """Hash of a tenant's webhook settings (open mode's when None): `secret`, `url` (its default)."""
    return f"{PREFIX}:webhook:open" if tenant is None else f"{PREFIX}:tenant:{tenant}:webhook"


def all_for(job_id: str) -> list[str]:
    """Every key a job owns (for expiry)."""
    return [stream(job_id), results(job_id), info(job_id), cancel(job_id), closed(job_id), custom_ids(job_id),
            items(job_id), shards(job_id), running(job_id), kept(job_id)]
