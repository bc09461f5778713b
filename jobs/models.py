"""The fleet's models: what each worker announces in Redis, and what the API reads of it.

keys.models() is a hash, served name -> JSON entry. A worker writes its model's entry with
every heartbeat: `expires` (the heartbeat TTL ahead), `created`, and what the API checks a
request against (`task`, `max_model_len`, `images`, `tools`, ...; Engine.served). Before it
loads its weights, a starting worker announces the model as `loading` (with its task), unless
a live entry is there, so a job for it is taken while the weights load.

A model is, at one moment:
- live: a worker's heartbeat entry is ahead (GET /v1/models lists these);
- loading: a starting worker announced it, within LOADING_S;
- known but away: it was live within `memory` seconds (the job retention), or the operator
  names it in FANOUT_MODELS (a fleet whose workers scale to zero when idle);
- unknown: none of these. A job naming it is refused (404, naming the served ones).

A job for a known model waits, queued, whatever state its workers are in: its shards sit in
the model's queues (jobs.spec.queues) until a worker serving it takes them. A LoRA adapter is
a model whose entry names its `parent`, the base its workers serve: its jobs go to the
base's queues, so they interleave with the base's as any jobs of one model do (every worker
of a base model should serve the same adapters: one that lacks a job's adapter hands the
shard on, as a failed attempt).
"""
from __future__ import annotations

import functools
import json
import os
import time
from dataclasses import dataclass

from results import keys

from .settings import Settings

LOADING_S = 1800  # how long a starting worker's `loading` announcement holds, at most


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    entry: dict  # the announced entry (only its task for a model FANOUT_MODELS alone names)
    state: str  # "live", "loading" or "away"

    @property
    def task(self) -> str:
        """Its task (jobs.spec.TASKS)."""
        return self.entry.get("task", "generate")

    @property
    def live(self) -> bool:
        return self.state == "live"

    @property
    def parent(self) -> str | None:
        """A LoRA adapter's base model (whose workers serve it and whose queues it uses)."""
        return self.entry.get("parent")

    @property
    def base(self) -> str:
        """The model whose queues its jobs go to: its own, or a LoRA adapter's base's."""
        return self.parent or self.name


def configured() -> dict[str, str]:
    """The models FANOUT_MODELS lists, known even with no worker: served name -> task, as
    `NAME` (a text generation model) or `NAME=embed`, comma-separated."""
    out = {}
    for part in os.environ.get("FANOUT_MODELS", "").split(","):
        name, _, task = part.strip().partition("=")
        if name:
            if task not in ("", "generate", "embed"):
                raise ValueError(f"FANOUT_MODELS: {part.strip()!r}: the task after '=' is generate or embed")
            out[name.strip()] = task or "generate"
    return out


@functools.cache
def _retention() -> int:
    return Settings.from_env().result_ttl


def read(redis, memory: float | None = None, now: float | None = None) -> dict[str, Model]:
    """Every known model, by name (one HGETALL); `memory`: how long a model stays known after
    its last worker (default: the job retention, FANOUT_RESULT_TTL)."""
    now = time.time() if now is None else now
    memory = _retention() if memory is None else memory
    out = {name: Model(name, {"task": task}, "away") for name, task in configured().items()}
    for raw_name, raw in redis.hgetall(keys.models()).items():
        name, entry = raw_name.decode(), json.loads(raw)
        expires = float(entry.get("expires", 0))
        if entry.get("loading"):
            state = "loading" if expires > now else "away"
        else:
            state = "live" if expires > now else "away"
        if state != "away" or expires > now - memory or name in out:
            out[name] = Model(name, entry, state)
    return out


def live(redis) -> dict[str, Model]:
    """The models a live worker serves now."""
    return {n: m for n, m in read(redis, 0).items() if m.live}


def get(redis, name: str) -> Model | None:
    """One known model, None when unknown."""
    return read(redis).get(name)


# Announce a starting worker's model as loading, unless a live entry is there. KEYS: keys.models.
# ARGV: name, entry JSON, now.
_LOADING = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if raw then
  local e = cjson.decode(raw)
  if not e['loading'] and tonumber(e['expires']) > tonumber(ARGV[3]) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


def announce_loading(redis, name: str, task: str, parent: str | None = None) -> bool:
    """Before a worker loads its weights: its model (or a LoRA adapter of it, `parent` the
    base) is known, loading. False if it is live."""
    now = time.time()
    entry = {"loading": True, "task": task, "created": int(now), "expires": now + LOADING_S}
    if parent is not None:
        entry["parent"] = parent
    return bool(redis.eval(_LOADING, 1, keys.models(), name, json.dumps(entry), now))


def announce(pipe, name: str, created: int, ttl: float, served: dict, adapters: list[str] = ()) -> None:
    """A worker's heartbeat of its model's entry, and of its LoRA adapters' (each a model of
    its own whose `parent` is the base), in the beat's pipeline."""
    expires = time.time() + ttl
    pipe.hset(keys.models(), name, json.dumps({"created": created, "expires": expires, **served}))
    for adapter in adapters:
        pipe.hset(keys.models(), adapter, json.dumps({"created": created, "expires": expires, **served,
                                                      "parent": name}))


def waiting(model: Model | None, name: str) -> str | None:
    """Why a queued job for `name` does not run yet: None while a worker serves it."""
    if model is not None and model.live:
        return None
    if model is not None and model.state == "loading":
        return f"a worker is loading the model '{name}': the job runs once it has"
    return f"no live worker serves the model '{name}': the job runs when one starts"


ROUTES = {"generate": "/v1/chat/completions, /v1/completions, /v1/responses, /v1/messages or a job",
          "embed": "/v1/embeddings or a job with task embed"}


class ModelError(Exception):
    """A request's model that cannot take it: status 404 (unknown) or 400 (another task's
    model, or none named while the fleet has several); `code` as OpenAI names it."""

    def __init__(self, status: int, message: str, code: str):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def resolve(redis, name: str | None, task: str | None) -> Model:
    """The known model a request for `task` runs on (None: any task). `name` None picks the
    one model of that task that live workers serve, or with none live the one known."""
    known = read(redis)
    if name is None:  # the one model of the task a live worker serves, else the one known
        fits = [m for m in known.values() if task is None or m.task == task]
        live = [m for m in fits if m.live]
        if len(live) == 1 or len(fits) == 1:
            return (live or fits)[0]
        fits = live or fits
        if not fits:
            raise ModelError(404, "model: no worker serves a model" + (f" for task {task}" if task else "")
                             + " now, nor has one lately: start one, or name the model it will serve",
                             "model_not_found")
        raise ModelError(400, f"model: the fleet serves several models ({_names(fits)}): name one", "model_required")
    model = known.get(name)
    if model is None:
        raise ModelError(404, f"The model '{name}' does not exist or no worker serves it (served: "
                              f"{_names(m for m in known.values() if m.live) or 'none now'}; GET /v1/models)",
                         "model_not_found")
    if task is not None and model.task != task:
        kind = "an embedding model" if model.task == "embed" else "a text generation model"
        raise ModelError(400, f"The model '{name}' is {kind}: use it with {ROUTES[model.task]}",
                         "model_not_supported")
    return model


def _names(models) -> str:
    return ", ".join(sorted(m.name for m in models))
