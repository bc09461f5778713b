"""What the API and the worker share, and nothing of either: the job contract (spec.py), how a
job is cut into shards and their transitions in Redis (shards.py), the items' layout by shard
(items.py), the settings read from the environment (settings.py), logging (logs.py), the
Redis client from REDIS_URL (redis_url.py) and what counts as Redis unavailable (unavailable.py).

It imports `results/` and the engine's pure definitions (worker.engine.sampling_params,
worker.engine.tools), never `api/`, the worker process or the CLI."""
